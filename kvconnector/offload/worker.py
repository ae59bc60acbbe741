"""Worker-side core of the CPU-tier connector: one host pool and one copy engine per worker.

No vLLM imports, so the same code runs under vLLM and on a GPU machine where vLLM cannot be
installed (a stand-in step drives it there). It takes the per-layer KV cache tensors an engine
hands over, finds what lies behind them (kvconnector.layout.recognize) and moves whole blocks:
- block-major buffer: one copy per block (block b of every layer is one chunk);
- anything else (a layer-major layout, an engine override, a backend that refused): the per-layer
  fallback, one copy per layer (per run of a page) per block, into the same slot format.
`mode` and `reason` say which and why.

With a shared pool (`shared`, transfer/shared/): no private pool; the worker maps the segment
its jobs name (at the first job, and again when a restarted daemon names a new one, after
finishing every job on the old mapping) and copies into its part of each slot. Its blocks carry
checksums (pool_checks.py): a store hashes this worker's part once copied and reports it; a load
copies a block only once checked (checked_loads.py) and fails from the first block that differs.

Per step (see StepJobs): `flush` before the forward (stores whose blocks a preemption freed),
`start_loads` after the forward launch, `submit_stores` after the forward (a store is ordered after
the work the compute stream had queued), then `poll` and `take_report`.

With a disk tier (`attach_disk`, worker_disk.py): the step's spills start first, on the disk
threads; a store or a load's read whose pool slots a spill still reads out waits for it here,
never on a lane. Below a shared pool the disk I/O moves this worker's part of each slot, on the
mapping of the spill's segment.

With a remote store (`attach_remote`, worker_remote.py): a load's blocks fetched from the store
(or read from disk) land in its reserved slots before its copy, which then loads the head that
arrived; a store's blocks are put to the store once copied (write-through). Every load waits
there first, in `start_loads`, so a load that cannot run fails at the next `poll`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvconnector.layout.descriptor import KVLayout
from kvconnector.layout.recognize import BLOCK_MAJOR_HINT, recognize
from kvconnector.offload.jobs import DiskWrite, JobReport, StepJobs, TransferEvents, TransferJob
from kvconnector.offload.pool_checks import PoolChecks
from kvconnector.offload.remote_tier import RemoteFetcher
from kvconnector.offload.worker_disk import WorkerDisk
from kvconnector.offload.worker_remote import WorkerRemote
from transfer.copy.base import CopyBackend
from transfer.disk.io import DiskIO
from transfer.engine import DEFAULT_MAX_STORE_BYTES, TransferEngine
from transfer.engine import TransferResult as CopyResult
from transfer.pool import HostPool
from transfer.shared.mapping import SharedPart

BLOCK_MAJOR = "block-major"
PER_LAYER = "per-layer"


class OffloadWorker:
    """Executes StepJobs against this worker's KV cache (see module doc).

    `kv_caches`: layer name -> tensor, all views of one buffer (vLLM: what `register_kv_caches`
    gets); `num_slots`: host pool blocks, the scheduler's index size; `cache_groups` and
    `num_blocks` as for `recognize`; `backend`: the copy backend (default: make_backend("auto"):
    on CUDA batched DMA with small-page loads on 12 SMs, threads on CPU); `pinned`: pin the
    pool (default: when CUDA is available); `shared`: this worker's part of a shared pool's slots
    (then `num_slots` is unused: the daemon's segment says).
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_slots: int, *,
                 cache_groups: Sequence[Sequence[str]] | None = None,
                 num_blocks: int | None = None, backend: CopyBackend | None = None,
                 max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
                 pinned: bool | None = None, shared: SharedPart | None = None) -> None:
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
        self.shared = shared
        self._gpu_rows, self._backend, self._pinned = gpu_rows, backend, pinned
        self._max_store_bytes = max_store_bytes
        self.pool: HostPool | None = None
        self.engine: TransferEngine | None = None
        self._stash = TransferEvents()  # events of a mapping let go, for the next poll
        self._loads: dict[int, tuple[str, tuple[int, ...]]] = {}  # job -> request, GPU blocks
        self._stores: dict[int, str] = {}  # job -> request
        self._held: set[str] = set()
        self._report = JobReport()
        self.remote = WorkerRemote()  # loads' reads and gets; a store by attach_remote
        self.disk: WorkerDisk | None = None  # set by attach_disk
        self._waiting: list[tuple[bool, TransferJob]] = []  # (is store, job) behind spills
        self._partial: dict[int, tuple[int, ...]] = {}  # load job -> GPU blocks not fetched
        self.checks = None if shared is None else PoolChecks(shared.rank, gpu_rows[0].device)
        self._rows: torch.Tensor | None = None  # this worker's part of every slot
        self._copied: list[CopyResult] = []  # loads copied, their checks still running
        if shared is None:
            self._bind(HostPool.create(KVLayout.opaque(self.block_bytes), num_slots=num_slots,
                                       pinned=pinned))

    def attach_remote(self, make_fetcher: Callable[[torch.Tensor], RemoteFetcher]) -> None:
        """Use a remote store as the second tier; `make_fetcher(rows)` makes its client over
        this worker's (num_slots, block_bytes) slot rows (again for each shared mapping)."""
        self.remote.attach(make_fetcher, self._rows)

    def attach_disk(self, io: DiskIO) -> None:
        """Use a disk tier below the pool: `io` moves blocks between this worker's part of the
        pool's slots (bound here, again for each shared mapping) and this rank's slab."""
        self.disk = WorkerDisk(io, 0 if self.shared is None else self.shared.rank)
        if self._rows is not None:
            self.disk.rebind(self._rows, self._disk_room())

    def _disk_room(self) -> int | None:
        """Bytes of each slot from this worker's part on that a disk read may fill (None: the
        whole slot, a private pool's)."""
        return None if self.shared is None else self.shared.room or self.block_bytes

    def describe(self, advise: bool = True) -> str:
        """One line: how blocks move and why; without `advise`, no advice to ask for a
        block-outermost layout (for a caller that did, or knows the engine refuses them)."""
        copies = "1 copy" if self.copies_per_block == 1 else f"{self.copies_per_block} copies"
        if self.shared is not None:
            where = (f"shared pool {self.shared.name!r}, bytes [{self.shared.offset}, "
                     f"{self.shared.offset + self.block_bytes}) of each slot")
        else:
            memory = "pinned" if self.pool.pinned else "pageable"
            where = f"{self.pool.num_slots} {memory} host slots of {self.block_bytes} B"
        how = f"{self.mode}: {copies} per block; {where}"
        if self.reason is None:
            return how
        reason = self.reason if advise else self.reason.removesuffix(f"; {BLOCK_MAJOR_HINT}")
        return f"{how} ({reason})"

    # ---- the pool's mapping ------------------------------------------------------------------

    def _bind(self, pool: HostPool) -> None:
        offset = 0 if self.shared is None else self.shared.offset
        try:
            engine = TransferEngine(pool.segments(self._gpu_rows, offset, self.block_bytes),
                                    self._backend, max_store_bytes=self._max_store_bytes)
        except BaseException:
            pool.close()
            raise
        self.pool, self.engine = pool, engine
        self._rows = pool.rows(offset, self.block_bytes)
        if self.checks is not None:
            self.checks.bind(engine)
        if self.disk is not None:
            self.disk.rebind(self._rows, self._disk_room())
        self.remote.bind(self._rows)

    def _mapped(self, job: TransferJob | DiskWrite) -> bool:
        """Whether the slots of `job` are mapped here, mapping its shared segment if needed."""
        if self.shared is None or (self.pool is not None and job.pool == self.pool.shared_name):
            return True
        # Mapped at a job, inside vLLM's step (torch.inference_mode): tensors and views made
        # there would be inference tensors, which the copy lanes' threads may not write.
        with torch.inference_mode(False):
            return self._remap(job)

    def _remap(self, job: TransferJob | DiskWrite) -> bool:
        try:
            pool = self.shared.map(job.pool, self._pinned)
        except ValueError:
            return False  # the daemon that planned it is gone with its segment
        if self.engine is not None:  # finish everything on the old mapping, then let it go
            while self.jobs_in_flight:
                self.drain()
                self._stash.update(self.poll())
            self.engine.close()
            self.remote.close()
            self.pool.close()
        self._bind(pool)
        return True

    # ---- the step ----------------------------------------------------------------------------

    def flush(self, step: StepJobs) -> None:
        """Before the forward: wait for the stores reading blocks a preemption freed (and for
        the spills such a store waits behind)."""
        if not step.flush or self.engine is None:
            return
        flush = set(step.flush)
        if any(is_store and job.job_id in flush for is_store, job in self._waiting):
            self.disk.wait(spills_only=True)
            self._poll_disk()
        self.engine.wait(step.flush)

    def start_loads(self, step: StepJobs) -> None:
        if step.erase_disk and self.disk is not None:
            self.disk.erase()  # reset_cache: rare, and writes in flight must not outlive it
        for write in step.spills:
            if self.disk is None:
                raise RuntimeError(f"spill job {write.job_id} without a disk tier attached")
            if self._mapped(write):
                self.disk.spill(write)
            else:  # its shared segment is gone with its daemon: nothing to write
                self.disk.fail_spill(write, self._report)
        for job in step.loads:
            if not self._mapped(job):  # its shared segment is gone: a failed load
                self.remote.fail_load(job)
            elif self._behind_spills(job.fetch_slots):
                self._waiting.append((False, job))
            else:
                self._start_load(job)

    def _behind_spills(self, slots: Sequence[int]) -> bool:
        return self.disk is not None and self.disk.behind(slots)

    def _start_load(self, job: TransferJob) -> None:
        if not self.remote.start_load(job, self.disk):  # else read / fetched first (see poll)
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
            if not self._mapped(job):  # its shared segment is gone: a failed store
                self._report.failed[job.job_id] = 1
                continue
            self._stores[job.job_id] = job.req_id
            if self._behind_spills(job.slots):
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
        self.remote.store_submitted(job)

    def _poll_disk(self) -> None:
        """Finished spills -> reported (with their failed keys); then what waited behind them."""
        if self.disk is None:
            return
        self.disk.collect(self._report)
        waiting, self._waiting = self._waiting, []
        for is_store, job in waiting:
            if self._behind_spills(job.slots if is_store else job.fetch_slots):
                self._waiting.append((is_store, job))
            elif is_store:
                self._submit_store(job)
            else:
                self._start_load(job)

    def poll(self) -> TransferEvents:
        """Collect finished jobs (never blocks)."""
        events, self._stash = self._stash, TransferEvents()
        report = self._report
        self._poll_disk()
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
        self.remote.collect(report)  # puts done
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
        """A store's copy ended: a shared pool's is hashed before it is reported done
        (`_poll_hashes`), so the scheduler commits it with its checksums."""
        report, job_id = self._report, result.job_id
        if self.checks is None or not self.checks.store_copied(result, self._rows):
            (report.done if result.ok else report.failed)[job_id] = 1
            del self._stores[job_id]
        self.remote.store_copied(job_id, result.ok, report)  # write-through
        report.store_bytes += result.nbytes
        report.store_seconds += result.seconds

    def _poll_fetches(self, events: TransferEvents) -> None:
        """Loads whose reads and gets are done copy the head that arrived; the rest of their
        blocks are load errors (vLLM recomputes them); a load with none of them here fails."""
        for job, head, sums in self.remote.fetched(self.disk, self._report):
            if head == 0:
                self._report.failed[job.job_id] = 1
                events.load_failed(job.req_id, job.block_ids)
                continue
            if head < len(job.block_ids):
                self._partial[job.job_id] = job.block_ids[head:]
            elif self.checks is not None:  # all here: they stay in the pool, with checksums
                self.checks.fetched(job, self._rows, sums)
            self._submit_load(job, head)

    def take_report(self) -> JobReport:
        """Jobs finished here since the last call (for the scheduler, summed over workers)."""
        report, self._report = self._report, JobReport()
        if self.disk is not None:
            self.disk.count(report)
        return report

    # ---- lifetime ----------------------------------------------------------------------------

    def drain(self) -> None:
        """Block until every copy and store call in flight is done (results still come from
        `poll`; a fetched load starts there)."""
        if self.disk is not None:
            self.disk.wait()
            self._poll_disk()  # what waited behind spills starts
            self.disk.wait()
        self.remote.wait()
        if self.engine is not None:
            if self.checks is not None:
                self.checks.loads.submit_all(self.engine)
            self.engine.wait()
            self._collect_copies()  # stores copied just now are hashed
        if self.checks is not None:
            self.checks.wait()

    @property
    def jobs_in_flight(self) -> int:  # a partly fetched load is in _loads until its copy ends
        return (len(self._loads) + len(self._stores) + self.remote.in_flight
                + (len(self.disk.spilling) if self.disk else 0)
                + sum(not is_store for is_store, _ in self._waiting))

    @property
    def remote_failures(self) -> int:
        """Jobs whose get or put failed, or that could not run."""
        return self.remote.failures

    def close(self) -> None:
        """Finish the copies and store calls in flight, then release the lanes, the store
        connection and the pool."""
        self.drain()
        if self.engine is not None:
            self.engine.close()
        self.remote.close()
        if self.disk is not None:
            self.disk.close()
        if self.checks is not None:
            self.checks.close()
        if self.pool is not None:
            self.pool.close()


def _rows(pages: torch.Tensor) -> list[torch.Tensor]:
    """A layer's pages as 2-D row tensors (one per contiguous run of a page), in byte order."""
    if pages.dim() == 2:
        return [pages]
    return [run for outer in pages.unbind(1) for run in _rows(outer)]

