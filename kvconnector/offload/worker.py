"""Worker-side core of the CPU-tier connector: one host pool and one copy engine per worker.

No vLLM imports, so the same code runs under vLLM and on a GPU machine where vLLM cannot be
installed (a stand-in step drives it there). It takes the per-layer KV cache tensors an engine
hands over, finds what lies behind them (kvconnector.layout.recognize) and moves whole blocks:
- block-major buffer: one copy per block (block b of every layer is one chunk);
- anything else (a layer-major layout, an engine override, a backend that refused): the per-layer
  fallback, one copy per layer (per run of a page) per block, into the same slot format.
`mode` and `reason` say which and why.

With a shared pool (`mapping`, transfer/shared/): no private pool; the worker maps the segment
its jobs name (at the first job, and again when a restarted daemon names a new one, after
finishing every job on the old mapping) and copies into its part of each slot. Its blocks carry
checksums (pool_checks.py): a store reports the row sums its copy took (hashed after the
commit), or else hashes this worker's part once copied and reports it; a load
copies a block only once checked (checked_loads.py) and fails from the first block that differs.

Per step (see StepJobs): `flush` before the forward (stores whose blocks a preemption freed),
`start_loads` after the forward launch, `submit_stores` after the forward (a store is ordered after
the work the compute stream had queued), then `poll` and `take_report`.

The tiers below the pool (`attach`, transfer.tier.TierWorker) run the step's writes first; a
store or a load's fetch whose pool slots a write still reads out waits for it here, never on a
lane. A load with fetches waits for them (each tier fills its part of the load's last slots),
then copies the head of its slots that holds good blocks; the rest of its blocks are load errors
(vLLM recomputes them). A load that cannot run fails at the next `poll`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvconnector.layout.recognize import BLOCK_MAJOR_HINT, recognize
from kvconnector.offload.jobs import JobReport, StepJobs, TransferEvents, TransferJob
from kvconnector.offload.pool_checks import PoolChecks
from transfer.copy.base import CopyBackend
from transfer.engine import DEFAULT_MAX_STORE_BYTES, CopyResult, TransferEngine
from transfer.pool import HostPool
from transfer.tier import OpResult, TierOp, TierWorker


class PoolPart(Protocol):
    """This worker's part of a pool other processes map too (transfer/shared/mapping.py): bytes
    [offset, offset + block bytes) of every slot of pool `name`, whose `segment`s it maps;
    `rank`: its place in each block's per-rank checksums; `room`: the bytes from `offset` that are
    this worker's (0: the block's only)."""

    name: str
    offset: int
    rank: int
    room: int

    def map(self, segment: str, pinned: bool | None) -> HostPool: ...


BLOCK_MAJOR = "block-major"
PER_LAYER = "per-layer"


class OffloadWorker:
    """Executes StepJobs against this worker's KV cache (see module doc).

    `kv_caches`: layer name -> tensor, all views of one buffer (vLLM: what `register_kv_caches`
    gets); `num_slots`: host pool blocks, the scheduler's index size; `cache_groups` and
    `num_blocks` as for `recognize`; `backend`: the copy backend (default: make_backend("auto"):
    on CUDA batched DMA with small-page loads on 12 SMs, threads on CPU); `pinned`: pin the
    pool (default: when CUDA is available); `mapping`: this worker's part of a shared pool's
    slots (then `num_slots` is unused: the daemon's segment says).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_slots: int, *,
                 cache_groups: Sequence[Sequence[str]] | None = None,
                 num_blocks: int | None = None, backend: CopyBackend | None = None,
                 max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
                 pinned: bool | None = None, mapping: PoolPart | None = None) -> None:
        found = recognize(kv_caches, cache_groups, num_blocks)
        if not found.layers:
            raise ValueError(f"no KV cache layer to offload: {found.reason}")
        if found.block_chunks is not None:
            self.mode, self.reason = BLOCK_MAJOR, None
            gpu_rows = [found.block_chunks.chunks]
        else:
            self.mode, self.reason = PER_LAYER, found.reason
            gpu_rows = [run for name in found.layers for run in _rows(found.layer_pages[name])]
        self.num_blocks = found.num_blocks
        self.block_bytes = sum(int(rows.shape[1]) for rows in gpu_rows)
        self.copies_per_block = len(gpu_rows)
        self.mapping = mapping
        self._gpu_rows, self._backend, self._pinned = gpu_rows, backend, pinned
        self._max_store_bytes = max_store_bytes
        self.pool: HostPool | None = None
        self.engine: TransferEngine | None = None
        self._segment = ""  # the pool segment mapped now
        self._stash = TransferEvents()  # events of a mapping let go, for the next poll
        self._loads: dict[int, tuple[str, tuple[int, ...]]] = {}  # job -> request, GPU blocks
        self._stores: dict[int, str] = {}  # job -> request
        self._held: set[str] = set()
        self._report = JobReport()
        self.tiers: dict[str, TierWorker] = {}  # the tiers below the pool, by name
        self.failures: dict[str, int] = {}  # per tier: ops that failed or could not run
        self._writing: dict[int, tuple[TierOp, frozenset[int]]] = {}  # write id -> op, slots
        # load -> (job, per tier its fetch's result, None while running)
        self._fetching: dict[int, tuple[TransferJob, dict[str, OpResult | None]]] = {}
        self._doomed: list[TransferJob] = []  # loads that fail at the next poll
        self._waiting: list[tuple[bool, TransferJob]] = []  # (is store, job) behind writes
        self._partial: dict[int, tuple[int, ...]] = {}  # load job -> GPU blocks not fetched
        self.checks = None if mapping is None else PoolChecks(mapping.rank, gpu_rows[0].device)
        self._rows: torch.Tensor | None = None  # this worker's part of every slot
        self._copied: list[CopyResult] = []  # loads copied, their checks still running
        if mapping is None:
            self._bind(HostPool.create(num_slots, self.block_bytes, pinned=pinned))

    def attach(self, tier: TierWorker) -> None:
        """Use `tier` below the pool: its I/O moves blocks between this worker's part of the
        pool's slots (bound here, again for each new mapping) and the tier."""
        if tier.name in self.tiers:
            raise ValueError(f"tier {tier.name!r} is attached already")
        self.tiers[tier.name] = tier
        self.failures[tier.name] = 0
        if self._rows is not None:
            tier.bind(self._rows, self._room())

    def _room(self) -> int | None:
        """Bytes of each slot from this worker's part on that a fetch may fill (None: the
        whole slot, a private pool's)."""
        return None if self.mapping is None else self.mapping.room or self.block_bytes

    def describe(self, advise: bool = True) -> str:
        """One line: how blocks move and why; without `advise`, no advice to ask for a
        block-outermost layout (for a caller that did, or knows the engine refuses them)."""
        copies = "1 copy" if self.copies_per_block == 1 else f"{self.copies_per_block} copies"
        if self.mapping is not None:
            where = (f"pool {self.mapping.name!r} mapped with other engines, bytes "
                     f"[{self.mapping.offset}, "
                     f"{self.mapping.offset + self.block_bytes}) of each slot")
        else:
            memory = "pinned" if self.pool.pinned else "pageable"
            where = f"{self.pool.num_slots} {memory} host slots of {self.block_bytes} B"
        how = f"{self.mode}: {copies} per block; {where}"
        if self.reason is None:
            return how
        reason = self.reason if advise else self.reason.removesuffix(f"; {BLOCK_MAJOR_HINT}")
        return f"{how} ({reason})"

    # ---- the pool's mapping ------------------------------------------------------------------

    def _bind(self, pool: HostPool, segment: str = "") -> None:
        offset = 0 if self.mapping is None else self.mapping.offset
        try:
            engine = TransferEngine(pool.segments(self._gpu_rows, offset, self.block_bytes),
                                    self._backend, max_store_bytes=self._max_store_bytes)
        except BaseException:
            pool.close()
            raise
        self.pool, self.engine, self._segment = pool, engine, segment
        self._rows = pool.rows(offset, self.block_bytes)
        if self.checks is not None:
            self.checks.bind(engine)
            # the scheduler reads the pool by row sums only if every rank checks loads so
            self._report.row_sum_reads[self.checks.rank] = self.checks.check_loads
        for tier in self.tiers.values():
            tier.bind(self._rows, self._room())

    def _mapped(self, segment: str) -> bool:
        """Whether the slots of pool `segment` are mapped here, mapping it if needed."""
        if self.mapping is None or (self.pool is not None and segment == self._segment):
            return True
        # Mapped at a job, inside vLLM's step (torch.inference_mode): tensors and views made
        # there would be inference tensors, which the copy lanes' threads may not write.
        with torch.inference_mode(False):
            return self._remap(segment)

    def _remap(self, segment: str) -> bool:
        try:
            pool = self.mapping.map(segment, self._pinned)
        except ValueError:
            return False  # the daemon that planned it is gone with its segment
        if self.engine is not None:  # finish everything on the old mapping, then let it go
            while self.jobs_in_flight:
                self.drain()
                self._stash.update(self.poll())
            if self.checks is not None:  # hashes after a commit read the old slots too
                self.checks.wait()
            self.engine.close()
            for tier in self.tiers.values():
                tier.release()
            self.pool.close()
        self._bind(pool, segment)
        return True

    # ---- the step ----------------------------------------------------------------------------

    def flush(self, step: StepJobs) -> None:
        """Before the forward: wait for the stores reading blocks a preemption freed (and for
        the writes such a store waits behind)."""
        if not step.flush or self.engine is None:
            return
        flush = set(step.flush)
        behind = {slot for is_store, job in self._waiting if is_store and job.job_id in flush
                  for slot in job.slots}
        if behind:  # only the writes those stores wait for (a remote put may take seconds)
            for name, tier in self.tiers.items():
                tier.wait([op_id for op_id, (op, slots) in self._writing.items()
                           if op.tier == name and not slots.isdisjoint(behind)])
            self._poll_tiers()
        self.engine.wait(step.flush)

    def start_loads(self, step: StepJobs) -> None:
        for name in step.erase:  # reset_cache: rare, and writes in flight must not outlive it
            if name in self.tiers:
                self.tiers[name].erase()
        for op in step.writes:
            tier = self.tiers.get(op.tier)
            if tier is None:
                raise RuntimeError(f"write {op.op_id} for tier {op.tier!r}, which is not "
                                   f"attached (attached: {sorted(self.tiers)})")
            if self._mapped(op.segment):
                # A refused write still reaches get_finished, as failed: registered first.
                self._writing[op.op_id] = (op, frozenset(op.slots))
                tier.submit(op)
            else:  # its shared segment is gone with its daemon: nothing to write
                self._report.written[op.op_id] = 1
                self._report.bad[op.op_id] = list(op.keys)
        for job in step.loads:
            if not self._mapped(job.pool):  # its shared segment is gone: a failed load
                self._doomed.append(job)
            elif self._behind_writes(job.fetch_slots):
                self._waiting.append((False, job))
            else:
                self._start_load(job)

    def _behind_writes(self, slots: Sequence[int]) -> bool:
        """Whether a write in flight still reads one of `slots`."""
        return any(not taken.isdisjoint(slots) for _, taken in self._writing.values())

    def _start_load(self, job: TransferJob) -> None:
        """Fetch the load's blocks from below first (copied once all are in, see poll), or
        copy it now."""
        if job.fail or any(op.tier not in self.tiers for op in job.fetches):
            self._doomed.append(job)
        elif job.fetches:
            for op in job.fetches:
                self.tiers[op.tier].submit(op)
            self._fetching[job.job_id] = (job, dict.fromkeys(op.tier for op in job.fetches))
        else:
            self._submit_load(job, len(job.slots))

    def _submit_load(self, job: TransferJob, head: int) -> None:
        """Copy the job's first `head` slots into its first `head` blocks; the shared pool's
        blocks among them only once checked."""
        # Submit (or check the ids) first: bad input raises before anything is registered here.
        expect = None if self.checks is None else self.checks.expected(job, head)
        if expect is not None:  # checked on the way, by row sums
            self.engine.submit_load(job.job_id, job.slots[:head], job.block_ids[:head],
                                    expect=expect)
        elif self.checks is None or \
                not self.checks.loads.start(job, head, self._rows, self.engine):
            self.engine.submit_load(job.job_id, job.slots[:head], job.block_ids[:head])
        self._loads[job.job_id] = (job.req_id, job.block_ids[:head])

    def submit_stores(self, step: StepJobs) -> None:
        """After the forward: each store copies after the work queued on the compute stream.
        A store the engine drops under pressure is reported failed, like a failed copy."""
        for job in step.stores:
            if not self._mapped(job.pool):  # its shared segment is gone: a failed store
                self._report.failed[job.job_id] = 1
                continue
            self._stores[job.job_id] = job.req_id
            if self._behind_writes(job.slots):
                self._waiting.append((True, job))
            else:
                self._submit_store(job)
        self._held.update(step.held)

    def _submit_store(self, job: TransferJob) -> None:
        # A dropped store (False) still reaches get_finished, as failed: it is registered.
        self.engine.submit_store(job.job_id, job.block_ids, job.slots,
                                 sums=self.checks is not None and self.checks.sums_store(job))
        if self.checks is not None:  # hashed once copied
            self.checks.store_submitted(job)

    def _poll_tiers(self) -> None:
        """Finished tier ops: writes reported (with their failed keys), fetches kept for their
        loads; then what waited behind the writes starts."""
        report = self._report
        for name, tier in self.tiers.items():
            for result in tier.get_finished():
                if not all(result.ok):
                    self.failures[name] += 1
                if result.op_id in self._writing:
                    op, _ = self._writing.pop(result.op_id)
                    report.written[op.op_id] = 1
                    bad = [k for k, ok in zip(op.keys, result.ok, strict=True) if not ok]
                    if bad:
                        report.bad[op.op_id] = bad
                elif result.op_id in self._fetching:
                    self._fetching[result.op_id][1][name] = result
        waiting, self._waiting = self._waiting, []
        for is_store, job in waiting:
            if self._behind_writes(job.slots if is_store else job.fetch_slots):
                self._waiting.append((is_store, job))
            elif is_store:
                self._submit_store(job)
            else:
                self._start_load(job)

    def poll(self) -> TransferEvents:
        """Collect finished jobs (never blocks)."""
        events, self._stash = self._stash, TransferEvents()
        report = self._report
        self._poll_tiers()
        self._collect_copies()
        copied, self._copied = self._copied, []
        for result in copied:
            if self.checks is not None and not self.checks.ready(result.job_id):
                self._copied.append(result)  # reported once its checks are done
                continue
            # A partly fetched load copied its good head; its tail failed in the store.
            tail = self._partial.pop(result.job_id, ())
            req_id, block_ids = self._loads.pop(result.job_id)
            if self.checks is not None:  # a check failed: from that block on (vLLM recomputes)
                tail = self.checks.failed_tail(result, block_ids, report) + tail
            (report.done if result.ok and not tail else report.failed)[result.job_id] = 1
            report.load_bytes += result.nbytes
            report.load_seconds += result.seconds
            if not result.ok or tail:  # vLLM recomputes from the first of them
                events.load_failed(req_id, block_ids if not result.ok else tail)
            else:
                events.finished_loads.add(req_id)
        self._poll_fetches(events)
        for job_id in [] if self.checks is None else self.checks.report_hashed(report):
            del self._stores[job_id]
        storing = set(self._stores.values())
        events.finished_sending = {r for r in self._held if r not in storing}
        self._held -= events.finished_sending
        return events

    def _collect_copies(self) -> None:
        """Copies that ended: stores go on (hashed, or reported), loads wait in `_copied` for
        poll (and for their checks); checked loads submit their next chunks."""
        for result in [] if self.engine is None else self.engine.get_finished():
            if result.is_store:
                self._store_copied(result)
            elif self.checks is None or not self.checks.loads.copied(result):
                self._copied.append(result)
        if self.checks is not None and self.engine is not None:
            self._copied += self.checks.loads.settled(self.engine)

    def _store_copied(self, result: CopyResult) -> None:
        """A store's copy ended: a shared pool's is reported done with its row sums where the
        copy took them (hashed after its commit), else hashed before it is reported done, so
        the scheduler commits it with its checksums (pool_checks.py)."""
        report, job_id = self._report, result.job_id
        if self.checks is None or not self.checks.store_copied(result, self._rows, report):
            (report.done if result.ok else report.failed)[job_id] = 1
            del self._stores[job_id]
        report.store_bytes += result.nbytes
        report.store_seconds += result.seconds

    def _poll_fetches(self, events: TransferEvents) -> None:
        """Loads whose fetches are all done copy the head that arrived (the pool's blocks, then
        the leading good fetched ones, tier by tier); the rest of their blocks are load errors
        (vLLM recomputes them; 0.32 may also look the head up again: it is in the pool, and
        loading it here costs one more copy); a load with none of them here fails."""
        doomed, self._doomed = self._doomed, []
        for job in doomed:
            for op in job.fetches:
                if op.tier in self.failures:
                    self.failures[op.tier] += 1
            self._report.failed[job.job_id] = 1
            events.load_failed(job.req_id, job.block_ids)
        for job_id, (job, results) in list(self._fetching.items()):
            if None in results.values():
                continue
            del self._fetching[job_id]
            head = len(job.slots) - len(job.fetch_keys)
            whole, sums = True, []
            for op in job.fetches:
                result = results[op.tier]
                if whole:
                    head += result.leading_ok
                    whole = result.leading_ok == len(op.keys)
                bad = [k for k, ok in zip(op.keys, result.ok, strict=True) if not ok]
                if bad:
                    self._report.bad.setdefault(job_id, []).extend(bad)
                sums += list(result.sums) or [None] * len(op.keys)
            if head == 0:
                self._report.failed[job_id] = 1
                events.load_failed(job.req_id, job.block_ids)
                continue
            if head < len(job.block_ids):
                self._partial[job_id] = job.block_ids[head:]
            elif self.checks is not None:  # all here: they stay in the pool, with checksums
                self.checks.fetched(job, self._rows, sums)
            self._submit_load(job, head)

    def take_report(self) -> JobReport:
        """Jobs finished here since the last call (for the scheduler, summed over workers)."""
        report, self._report = self._report, JobReport()
        for name, tier in self.tiers.items():
            report.count(name, tier.take_counters())
        return report

    # ---- lifetime ----------------------------------------------------------------------------

    def drain(self) -> None:
        """Block until every copy and tier op in flight is done (results still come from
        `poll`; a fetched load starts there)."""
        for tier in self.tiers.values():
            tier.wait()
        self._poll_tiers()  # what waited behind writes starts
        for tier in self.tiers.values():
            tier.wait()
        if self.engine is not None:
            if self.checks is not None:
                self.checks.loads.submit_all(self.engine)
            self.engine.wait()
            self._collect_copies()  # stores copied just now are hashed
        if self.checks is not None:
            self.checks.wait()

    @property
    def jobs_in_flight(self) -> int:  # a partly fetched load is in _loads until its copy ends
        return (len(self._loads) + len(self._stores) + len(self._fetching) + len(self._doomed)
                + len(self._writing) + sum(not is_store for is_store, _ in self._waiting))

    def close(self) -> None:
        """Finish the copies and tier ops in flight, then release the lanes, the tiers and the
        pool."""
        self.drain()
        if self.engine is not None:
            self.engine.close()
        for tier in self.tiers.values():
            tier.close()
        if self.checks is not None:
            self.checks.close()
        if self.pool is not None:
            self.pool.close()


def _rows(pages: torch.Tensor) -> list[torch.Tensor]:
    """A layer's pages as 2-D row tensors (one per contiguous run of a page), in byte order."""
    if pages.dim() == 2:
        return [pages]
    return [run for outer in pages.unbind(1) for run in _rows(outer)]

