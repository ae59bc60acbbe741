"""Scheduler-side core of the CPU-tier connector: which blocks to load and store, and when.

No vLLM imports: the vLLM adapter (kvconnector.vllm) feeds it plain values (request ids, block
hashes, GPU block ids, token counts) and ships what `build_step` returns to the workers. Lookups
and loads: loads.py (`LoadPlanner`, this class's base); what it tracks: records.py.

The block index (transfer/block_index.py) maps keys to host pool slots; every worker owns a pool
with the same slot count, so one slot id names one block of every rank.

Life of a job: `plan_load` / `plan_stores` / `request_finished` create jobs; `build_step` hands them
out once; every worker reports each job done or failed (`JobReport`, summed over ranks by vLLM's
aggregation); when all `num_workers` have reported, `complete` finishes it in the index.

With a remote store (remote_tier.py), every store job is also put to the store by every worker
once copied (write-through; a worker whose bytes another rank puts only reports); its keys are
readable at once and pinned until every worker reports the put (`JobReport.put`), so no new
store reuses a slot zmq still reads.

With a disk tier (kvconnector/offload/disk_tier.py), blocks go to disk as the pool evicts them
or, write-through, once stored (`StepJobs.spills`).

With a shared pool (transfer/shared/: `index` a SharedIndex), the daemon's index answers: a
lookup's hits may be evicted by another engine before the load pins them (the load then fails
and vLLM recomputes), jobs carry the segment their slots live in, and a job planned on a
connection that is gone (a restarted daemon) completes nothing in the new one (its lease went
with the connection). Its blocks carry checksums: every worker hashes its part of a stored
block (`JobReport.sums`), the store commits with them, and a load hands them to the workers,
which check their parts (transfer/shared/checks.py).

Block safety (a GPU block must not be reused while a store still reads it):
- a finished request with stores in flight or still to make keeps its blocks (`request_finished`
  returns True) until every worker has reported its stores done (`StepJobs.held`);
- a preempted request's blocks are freed at once, so the next step lists its stores in flight in
  `StepJobs.flush` and workers wait for them before that step's forward writes the blocks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict

from kvconnector.offload.disk_tier import DiskPlanner
from kvconnector.offload.groups import CacheGroup
from kvconnector.offload.jobs import JobReport, StepJobs, TransferJob
from kvconnector.offload.loads import LoadPlanner
from kvconnector.offload.records import Job, OffloadCounters, Put, RequestState
from transfer.block_index import BlockIndex
from transfer.keys import Namespace
from transfer.shared.client import SharedIndex
from transfer.shared.protocol import block_sums

__all__ = ["OffloadCounters", "OffloadScheduler"]


class OffloadScheduler(LoadPlanner):
    """Plans the CPU tier's loads and stores for one engine (see module doc).

    `num_slots`: blocks in each worker's host pool; `num_workers`: workers that must report each
    job (every rank of every parallel group); `policy`: the index eviction policy ("lru", "arc");
    `index`: a shared pool's index in place of a private BlockIndex (num_slots, policy unused).
    """

    def __init__(self, namespace: Namespace, num_slots: int, block_size: int, num_workers: int,
                 policy: str = "lru", *, remote: bool = False, remote_only: bool = False,
                 disk: DiskPlanner | None = None, index: SharedIndex | None = None,
                 groups: Sequence[CacheGroup] = (CacheGroup(),), null_block: int = 0) -> None:
        for name, value in (("block_size", block_size), ("num_workers", num_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not groups or len({g.prefix for g in groups}) != len(groups):
            raise ValueError(f"groups need distinct key prefixes, got {list(groups)!r}")
        for group in groups:
            if group.window is not None and (isinstance(group.window, bool) or
                                             not isinstance(group.window, int) or
                                             group.window <= 0):
                raise ValueError(f"a sliding window is a positive int, got {group.window!r}")
            if group.state and group.window is not None:
                raise ValueError(f"a state group has no window, got {group!r}")
        if len(groups) > 1 and (remote or remote_only):
            # The store answers a lookup with a count of leading keys; a state group keeps
            # states only where steps ended, so several groups need an answer per key.
            raise ValueError("a remote store with several KV cache groups is not supported")
        self.groups = tuple(groups)
        self.null_block = null_block  # the engine's placeholder for a freed block (vLLM: 0)
        self._windowed: set[int] = set()  # store jobs with a `leaves_at`
        self.namespace = namespace
        self.block_size = block_size
        self.num_workers = num_workers
        self.index = index or BlockIndex(namespace, num_slots, policy)
        self.checked = index is not None  # a shared pool: blocks carry checksums
        # remote: jobs carry keys (write-through puts, fetches); remote_only: the pool is only
        # staging, every key leaves the index once its job is done.
        self.remote = remote or remote_only
        self.remote_only = remote_only
        self.disk = disk
        self._requests: dict[str, RequestState] = {}
        self._lookups = {}  # request -> its last lookup
        self._jobs = {}
        # Write-through: store job -> its put (every worker reports one per remote store job,
        # a failed copy included); the keys stay pinned like a load meanwhile, so no new store
        # reuses their slots while zmq reads them.
        self._puts: dict[int, Put] = {}
        self._next_job_id = 0
        self._step = StepJobs()
        self._counters = OffloadCounters()
        self._evictions_seen = 0

    # ---- store planning (lookups and loads: loads.py) --------------------------------------

    def plan_stores(self, req_id: str, block_hashes: Sequence[bytes],
                    block_ids: Sequence[Sequence[int]] | Sequence[int],
                    num_ready_tokens: int) -> None:
        """Store the request's full blocks whose KV is complete once `num_ready_tokens` are
        computed and that the tier lacks; each block is considered once per request life. A
        sliding window group's blocks the engine already freed (its null block) are skipped."""
        self.plan_step_stores([(req_id, block_hashes, block_ids, num_ready_tokens)])

    def plan_step_stores(self, requests: Sequence[tuple[str, Sequence[bytes],
                                                        Sequence[Sequence[int]] | Sequence[int],
                                                        int]]) -> None:
        """`plan_stores` for each (request, hashes, block ids, ready tokens) of a step, with one
        call to the index for all of them (one round trip to a shared pool's daemon)."""
        wanted = []
        for req_id, block_hashes, block_ids, num_ready_tokens in requests:
            tables = self._tables(block_ids)
            state = self._requests.setdefault(req_id, RequestState())
            ready = min([num_ready_tokens // self.block_size, len(block_hashes)]
                        + [len(table) for table in tables])
            if ready <= state.stored_upto:
                continue
            start, state.stored_upto = state.stored_upto, ready
            position: dict[bytes, tuple[int, int]] = {}  # key -> (its block id, position)
            leaves_at: int | None = None
            for group, table in zip(self.groups, tables, strict=True):
                kept = [i for i in range(start, ready)
                        if (group.window is None and not group.state)
                        or table[i] != self.null_block]
                for i, key in zip(kept, self._keys(group, [block_hashes[i] for i in kept]),
                                  strict=True):
                    position[key] = (table[i], i)
                if (group.window is not None or group.state) and kept:
                    # vLLM frees the first block once the tokens it skips, n - window + 1 (a
                    # state group: n - 1, as a window of 2), reach (kept[0] + 1) * block_size
                    reach = 2 if group.state else group.window
                    first = (kept[0] + 1) * self.block_size + reach - 1
                    leaves_at = first if leaves_at is None else min(leaves_at, first)
            wanted.append((req_id, state, position, leaves_at))
        if not wanted:
            return
        # Skips keys stored or being stored (by an earlier request of the batch too).
        plans = self.index.prepare_stores([list(position) for _, _, position, _ in wanted])
        for (req_id, state, position, leaves_at), plan in zip(wanted, plans, strict=True):
            self._counters.unplaced_blocks += len(plan.not_placed)
            self._spill_evicted(plan)
            if not plan.keys:
                continue
            first_block = min(position[k][1] for k in plan.keys)
            job_id = self._add_job(state, req_id, True, plan.keys, first_block)
            if leaves_at is not None:
                self._jobs[job_id].leaves_at = leaves_at
                self._windowed.add(job_id)
            if self.remote:
                self._puts[job_id] = Put(list(plan.keys), self.num_workers, self.index.epoch)
            self._step.stores.append(TransferJob(job_id, req_id,
                                                 tuple(position[k][0] for k in plan.keys),
                                                 tuple(plan.slots),
                                                 tuple(plan.keys) if self.remote else (),
                                                 pool=self.index.segment,
                                                 checked=tuple(plan.keys) if self.checked
                                                 else ()))

    def flush_windows(self, num_computed_tokens: Mapping[str, int]) -> None:
        """vLLM frees a sliding window group's blocks that fell out of the window once a request
        has computed that far, and may hand them out in the same step: the store jobs still
        reading such blocks are finished before this step's forward. `num_computed_tokens`:
        each live request's computed tokens (a request missing from it counts as past every
        window)."""
        for job_id in list(self._windowed):
            job = self._jobs[job_id]
            done = num_computed_tokens.get(job.req_id)
            if done is None or job.leaves_at is None or done >= job.leaves_at:
                self._step.flush.append(job_id)
                self._windowed.discard(job_id)

    def request_preempted(self, req_id: str) -> None:
        """The request's blocks were freed: its stores in flight must finish before the next
        forward, and after resuming it starts from a fresh block table."""
        state = self._requests.get(req_id)
        if state is None:
            return
        flush = [j for j in state.jobs if self._jobs[j].is_store]
        self._step.flush.extend(flush)
        self._windowed.difference_update(flush)
        state.stored_upto = 0

    def request_finished(self, req_id: str, block_hashes: Sequence[bytes],
                         block_ids: Sequence[Sequence[int]] | Sequence[int],
                         num_ready_tokens: int) -> bool:
        """Plan the request's last stores; True when its blocks must stay allocated until every
        worker reports it finished sending (stores in flight or planned). A request waiting for
        a load is never held: vLLM frees it when the load finishes. `block_ids`: what the engine
        keeps (its stores in flight that read other blocks are flushed by `flush_windows`)."""
        self._lookups.pop(req_id, None)
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = RequestState()  # its stores all come now
        state.finished = True
        held = False
        if all(self._jobs[j].is_store for j in state.jobs):
            before = set(state.jobs)
            self.plan_stores(req_id, block_hashes, block_ids, num_ready_tokens)
            self._windowed -= state.jobs - before  # they read blocks the engine now holds
            held = bool(state.jobs)
            if held:
                self._step.held.append(req_id)
        self._forget_if_idle(req_id)
        return held


    def build_step(self) -> StepJobs:
        """The jobs planned since the last call, for every worker."""
        step, self._step = self._step, StepJobs()
        return step

    # ---- completion ------------------------------------------------------------------------

    def complete(self, report: JobReport) -> None:
        """Apply the workers' reports; a job finishes when every worker has reported it."""
        self._counters.load_bytes += report.load_bytes
        self._counters.load_seconds += report.load_seconds
        self._counters.store_bytes += report.store_bytes
        self._counters.store_seconds += report.store_seconds
        self._counters.checksum_failures += report.checksum_failures
        for job_id, ranks in report.sums.items():
            if job_id in self._jobs:
                self._jobs[job_id].sums.update(ranks)
        if self.disk is not None and (unpin := self.disk.apply(report, self.index.epoch)):
            self.index.complete_load(unpin)  # written through: the pool may evict them now
        for counts, failed in ((report.done, False), (report.failed, True)):
            for job_id, count in counts.items():
                job = self._jobs.get(job_id)
                if job is None or count <= 0 or count > job.pending:
                    raise ValueError(f"report of {count} worker(s) for job {job_id!r}, which "
                                     f"{'waits for ' + str(job.pending) if job else 'is unknown'}")
                job.pending -= count
                job.failed |= failed
        for job_id in {**report.done, **report.failed}:
            if self._jobs[job_id].pending == 0:
                self._finish(job_id)
        for job_id, count in report.put.items():
            put = self._puts.get(job_id)
            if put is None or count > put.pending:
                raise ValueError(f"put report of {count} worker(s) for job {job_id!r}, which "
                                 f"{'waits for ' + str(put.pending) if put else 'is unknown'}")
            put.pending -= count
            self._settle_put(job_id)

    def _settle_put(self, job_id: int) -> None:
        put = self._puts[job_id]
        if not put.finished or put.pending:
            return
        del self._puts[job_id]
        if put.pinned and put.epoch == self.index.epoch:
            self.index.complete_load(put.keys)
            if self.remote_only:  # the store has them; the pool was staging
                self.index.discard(put.keys)

    def _finish(self, job_id: int) -> None:
        job = self._jobs.pop(job_id)
        self._windowed.discard(job_id)
        state = self._requests[job.req_id]
        state.jobs.discard(job_id)
        live = job.epoch == self.index.epoch  # else its lease went with an old connection
        if job.is_store:
            if self.checked and not job.failed:
                job.failed = self._commit(job.keys, job.sums, live)
            elif live:
                self.index.complete_store(job.keys, not job.failed)
            self._counters.failed_stores += job.failed
            if not job.failed and live and self.disk is not None and self.disk.write_through:
                self._write_through(job)
            put = self._puts.get(job_id)
            if put is not None:
                if not job.failed and live:  # readable at once, pinned until every put is done
                    put.pinned = self.index.prepare_load(job.keys) is not None
                put.finished = True
                self._settle_put(job_id)
        else:
            if live:
                self.index.complete_load(job.keys)
                if job.fetch_keys and self.checked and not job.failed:
                    self._commit(job.fetch_keys, job.sums, live)
                elif job.fetch_keys:
                    self.index.complete_store(job.fetch_keys,
                                              not job.failed and not self.remote_only)
            if job.disk_keys:
                self.disk.finish_load(job_id, job.disk_keys)
            if job.failed:
                # The slots may hold bad bytes: drop the keys so the recomputed blocks are
                # stored again, and store this request's blocks again from the failed load on.
                self._counters.failed_loads += 1
                if live:
                    self.index.discard(job.keys)
                state.stored_upto = min(state.stored_upto, job.start_block)
        self._forget_if_idle(job.req_id)

    def _write_through(self, job: Job) -> None:
        """A stored block goes to disk too, pinned in the pool while written (a shared pool's
        with the checksums it was committed with; one another engine evicted since is not)."""
        plan = self.index.prepare_load(job.keys)
        if plan is None:
            return
        sums = None
        if self.checked:  # the xxh3s: what disk footers carry
            sums = [list(s) for s in zip(*(job.sums[r][:len(job.keys)]
                                           for r in range(self.num_workers)), strict=True)]
        written = self._spill(job.keys, plan.slots, pinned=True, sums=sums)
        if len(written) < len(job.keys):
            self.index.complete_load([k for k in job.keys if k not in written])

    def _commit(self, keys: list[bytes], by_rank: dict[int, list[int]], live: bool) -> bool:
        """Commit blocks stored (or fetched) into a shared pool with every rank's checksums;
        True when it failed (a rank's are missing: such a block could never be checked)."""
        ranks = [by_rank.get(rank) for rank in range(self.num_workers)]
        failed = any(sums is None or len(sums) not in (len(keys), 2 * len(keys))
                     for sums in ranks)
        if live:
            sums = None if failed else block_sums(ranks, len(keys))
            self.index.complete_store(keys, not failed, sums)
        return failed

    def _forget_if_idle(self, req_id: str) -> None:
        state = self._requests[req_id]
        if state.finished and not state.jobs:
            del self._requests[req_id]

    # ---- whole tier ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every stored block (jobs in flight finish; their slots drain)."""
        self.index.clear()
        if self.disk is not None:  # and on disk, or a restart would find them again
            self.disk.index.clear()
            self._step.erase_disk = True
        for state in self._requests.values():
            state.stored_upto = 0

    def has_jobs(self) -> bool:
        """Jobs planned or in flight: the engine must keep stepping to complete them."""
        return bool(self._jobs or self._puts or (self.disk and self.disk.spills_in_flight))

    def count_lookup_failures(self, count: int) -> None:
        self._counters.remote_lookup_failures += count

    def take_counters(self) -> OffloadCounters:
        """Counters since the last call (jobs_in_flight is the current value)."""
        evictions = self.index.stats.evictions
        counters, self._counters = self._counters, OffloadCounters()
        counters.evictions = evictions - self._evictions_seen
        counters.jobs_in_flight = len(self._jobs) + len(self._puts)
        if self.disk is not None:
            for name, value in asdict(self.disk.take_counters()).items():
                setattr(counters, f"disk_{name}", value)
            counters.jobs_in_flight += self.disk.spills_in_flight
        self._evictions_seen = evictions
        return counters
