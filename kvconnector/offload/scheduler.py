"""Scheduler-side core of the CPU-tier connector: which blocks to load and store, and when.

No vLLM imports: the vLLM adapter (kvconnector.vllm) feeds it plain values (request ids, block
hashes, GPU block ids, token counts) and ships what `build_step` returns to the workers. Lookups
and loads: loads.py (`LoadPlanner`, this class's base); what it tracks: records.py.

The block index (transfer/block_index.py) maps keys to host pool slots; every worker owns a pool
with the same slot count, so one slot id names one block of every rank.

Life of a job: `plan_load` / `plan_stores` / `request_finished` create jobs; `build_step` hands them
out once; every worker reports each job done or failed (`JobReport`, summed over ranks by vLLM's
aggregation); when all `num_workers` have reported, `complete` finishes it in the index.

Below the pool, the tiers (transfer.tier) are driven through their planners: a stored block goes
to each tier that writes stored blocks once its store is done (pinned in the pool until every
worker wrote it), and to those that keep evicted blocks as the pool evicts it (before a store
reuses its slot: the worker orders them); a tier the pool only stages blocks for drops them from
the pool once written there.

With a checked pool (transfer/shared/: `index` a SharedIndex), the daemon's index answers: a
lookup's hits may be evicted by another engine before the load pins them (the load then fails
and vLLM recomputes), jobs carry the segment their slots live in, and a job planned on a
connection that is gone (a restarted daemon) completes nothing in the new one (its lease went
with the connection). Its blocks carry checksums: every worker hashes its part of a stored
block (`JobReport.sums`), the store commits with them, and a load hands them to the workers,
which check their parts (transfer/slot_checker.py). GPU workers report the row sums their copy
took instead, and the store commits by them at once; where some reader or tier needs them (the
index's `StorePlan.hash_later`), their xxh3s follow (`JobReport.hashed`, taken from slots that
still match the commit) and are attached to the committed blocks (`index.add_sums`), a block
whose slot no longer matched is dropped, and only then does it go to the tiers that keep xxh3s
(one evicted before is not written below: it could not be checked). Once every worker said it
checks loads by row sums (`JobReport.row_sum_reads`), the index is told (`reads`): blocks not
hashed yet are hits to this engine, and with no tier below it needs no xxh3s at all (an engine
may say so from its start, as a GPU engine's adapter does; a worker that turns out to take no
row sums checks such blocks on its host, and the engine then reads by xxh3).

Block safety (a GPU block must not be reused while a store still reads it):
- a finished request with stores in flight or still to make keeps its blocks (`request_finished`
  returns True) until every worker has reported its stores done (`StepJobs.held`);
- a preempted request's blocks are freed at once, so the next step lists its stores in flight in
  `StepJobs.flush` and workers wait for them before that step's forward writes the blocks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvconnector.offload.admission import Admission, AdmissionRules, RequestLimits, shed
from kvconnector.offload.events import BlockChange, BlockLog, Describe
from kvconnector.offload.groups import CacheGroup
from kvconnector.offload.jobs import JobReport, StepJobs, TransferJob
from kvconnector.offload.loads import POOL, LoadPlanner
from kvconnector.offload.prefetch import PrefetchPlanner, PrefetchRules
from kvconnector.offload.records import Job, LateHash, OffloadCounters, RequestState
from transfer.block_index import BlockIndex, PoolIndex
from transfer.checksums import block_sums, hashed
from transfer.keys import Namespace
from transfer.tier import TierPlanner

__all__ = ["POOL", "OffloadCounters", "OffloadScheduler"]


class OffloadScheduler(LoadPlanner, PrefetchPlanner):
    """Plans the pool's and the tiers' loads and stores for one engine (see module doc).

    `num_slots`: blocks in each worker's host pool; `num_workers`: workers that must report each
    job (every rank of every parallel group); `policy`: the index eviction policy ("lru", "arc");
    `index`: a shared pool's index in place of a private BlockIndex (num_slots, policy unused);
    `tiers`: the tiers below the pool, asked in this order; `admission`: which blocks are
    stored and loaded (admission.py; the defaults store every block); `prefetch`: fetching a
    waiting request's blocks into the pool ahead (prefetch.py; off by default).
    """

    def __init__(self, namespace: Namespace, num_slots: int, block_size: int, num_workers: int,
                 policy: str = "lru", *, tiers: Sequence[TierPlanner] = (),
                 index: PoolIndex | None = None,
                 groups: Sequence[CacheGroup] = (CacheGroup(),), null_block: int = 0,
                 admission: AdmissionRules | None = None,
                 prefetch: PrefetchRules | None = None) -> None:
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
        if len({tier.name for tier in tiers}) != len(tiers):
            raise ValueError(f"tiers need distinct names, got {[t.name for t in tiers]}")
        for tier in tiers:
            if len(groups) > 1 and not tier.answers_per_key:
                # A tier answering a count of leading keys cannot serve several groups: a state
                # group keeps states only where steps ended, so they need an answer per key.
                raise ValueError(f"tier {tier.name!r} with {len(groups)} KV cache groups is not "
                                 f"supported (it answers leading counts only)")
        self.groups = tuple(groups)
        self.null_block = null_block  # the engine's placeholder for a freed block (vLLM: 0)
        self._windowed: set[int] = set()  # store jobs with a `leaves_at`
        self.namespace = namespace
        self.block_size = block_size
        self.num_workers = num_workers
        self.index = index or BlockIndex(namespace, num_slots, policy)
        self.checked = self.index.checked  # blocks carry checksums
        self.tiers = tuple(tiers)
        # the pool only stages a tier's blocks: a block leaves it once written there
        self.staging = any(tier.pool_stages for tier in self.tiers)
        self._by_name = {tier.name: tier for tier in self.tiers}
        self._requests: dict[str, RequestState] = {}
        self._lookups = {}  # request -> its last lookup
        self._jobs = {}
        self._writes = {}  # tier write id -> its Write (pool keys pinned until it is done)
        self._bad: dict[int, list[bytes]] = {}  # tier op -> keys that failed there so far
        self._late: dict[int, LateHash] = {}  # store committed by row sums -> its xxh3s so far
        self._row_sum_reads: dict[int, bool] = {}  # rank -> whether it checks loads by row sums
        self._next_job_id = 0
        self._step = StepJobs()
        self._counters = OffloadCounters()
        self._evictions_seen = 0
        self._closing = False
        self._resets = 0  # reset() calls: a store planned before one writes nothing through
        self.events: BlockLog | None = None  # KV events on: enable_events
        self.admission = Admission(admission or AdmissionRules(), block_size)
        self._init_prefetch(prefetch)

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
            ready = self.admission.store_upto(req_id, ready)  # its cap, the minimum prefix
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
            if self.admission.counts is not None:  # the store threshold
                admitted = self.admission.admitted(list(position))
                self._counters.threshold_skipped_blocks += admitted.count(False)
                position = {k: p for (k, p), ok in zip(position.items(), admitted, strict=True)
                            if ok}
            wanted.append((req_id, state, position, leaves_at))
        room = self.admission.store_room(
            lambda: sum(len(job.keys) for job in self._jobs.values() if job.is_store))
        if room == 0 and wanted:  # backpressure: shed the step's stores, never wait
            keys = [key for _, _, position, _ in wanted for key in position]
            self._counters.shed_blocks += self.index.present(keys).count(False)
            wanted = []
        if not wanted:
            return
        # Skips keys stored or being stored (by an earlier request of the batch too).
        plans = self.index.prepare_stores([list(position) for _, _, position, _ in wanted])
        for (req_id, state, position, leaves_at), plan in zip(wanted, plans, strict=True):
            self._counters.unplaced_blocks += len(plan.not_placed)
            plan, dropped = shed(self.index, plan, room)
            self._counters.shed_blocks += dropped
            room = None if room is None else room - len(plan.keys)
            self._write_evicted(plan)
            if not plan.keys:
                continue
            if self.events is not None:
                self.events.planned(req_id, plan.keys)
            first_block = min(position[k][1] for k in plan.keys)
            job_id = self._add_job(state, req_id, True, plan.keys, first_block)
            self._jobs[job_id].slots = list(plan.slots)
            self._jobs[job_id].hash_later = plan.hash_later
            if leaves_at is not None:
                self._jobs[job_id].leaves_at = leaves_at
                self._windowed.add(job_id)
            self._step.stores.append(TransferJob(job_id, req_id,
                                                 tuple(position[k][0] for k in plan.keys),
                                                 tuple(plan.slots),
                                                 pool=self.index.segment,
                                                 checked=tuple(plan.keys) if self.checked
                                                 else (), hash_later=plan.hash_later))

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
        for tier in self.tiers:
            tier.forget(req_id)
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
        self.admission.forget(req_id)
        self._cancel_prefetches(req_id)
        self._forget_if_idle(req_id)
        return held

    def set_request_limits(self, req_id: str, limits: RequestLimits) -> None:
        """The request's own limits (its `kv_transfer_params`), until it finishes."""
        self.admission.set_limits(req_id, limits)


    def build_step(self) -> StepJobs:
        """The jobs planned since the last call, for every worker."""
        self._plan_prefetches()
        step, self._step = self._step, StepJobs()
        self._sent_prefetches(step)
        return step

    # ---- completion ------------------------------------------------------------------------

    def complete(self, report: JobReport) -> None:
        """Apply the workers' reports; a job finishes when every worker has reported it."""
        self._counters.load_bytes += report.load_bytes
        self._counters.load_seconds += report.load_seconds
        self._counters.store_bytes += report.store_bytes
        self._counters.store_seconds += report.store_seconds
        self._counters.checksum_failures += report.checksum_failures
        for tier, counts in report.tiers.items():
            self._counters.add(tier, counts)
        for job_id, ranks in report.sums.items():
            if job_id in self._jobs:
                self._jobs[job_id].sums.update(ranks)
        for job_id, ranks in report.hashed.items():  # may come before the job's last report
            if job_id in self._jobs:
                self._jobs[job_id].hashed.update(ranks)
            elif job_id in self._late:
                self._late[job_id].hashed.update(ranks)
        if report.row_sum_reads:
            self._row_sum_reads.update(report.row_sum_reads)
            self._declare_reads()
        for op_id, keys in report.bad.items():
            if op_id in self._jobs or op_id in self._writes:
                known = self._bad.setdefault(op_id, [])  # ranks report the same key apart
                known += [key for key in keys if key not in known]
        for write_id, count in report.written.items():
            write = self._writes.get(write_id)
            if write is None or not 0 < count <= write.pending:
                raise ValueError(f"write report of {count} worker(s) for op {write_id!r}, which "
                                 f"{'waits for ' + str(write.pending) if write else 'is unknown'}")
            write.pending -= count
            if write.pending == 0:
                self._finish_write(write_id)
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
        self._attach_hashes()

    def read_by_row_sums(self) -> None:
        """Read a shared pool by row sums before the workers said so (they are expected to:
        GPU workers); `_declare_reads` corrects it by their reports."""
        self._row_sum_reads.clear()
        self._declare_reads(expected=True)

    def _declare_reads(self, expected: bool = False) -> None:
        """Tell a shared pool's index how this engine reads: by row sums once every worker
        checks loads so (then it needs xxh3s only for its tiers below), by xxh3 as soon as one
        does not (its loads of blocks not hashed were checked on its host: pool_checks.py)."""
        reads = getattr(self.index, "reads", None)
        if reads is None:
            return
        if not all(self._row_sum_reads.values()):
            reads(False, True)
        elif expected or len(self._row_sum_reads) == self.num_workers:
            reads(True, bool(self.tiers))

    def _finish_write(self, write_id: int) -> None:
        write = self._writes.pop(write_id)
        if write_id in self._prefetches:  # a fetch ahead into the pool (prefetch.py)
            self._finish_prefetch(write_id, self._bad.pop(write_id, []))
            return
        tier = self._by_name[write.tier]
        bad = self._bad.pop(write_id, [])
        tier.complete_write(write_id, bad)
        if self.events is not None:
            self.events.write_done(write_id, bad)
        if write.pinned and write.epoch == self.index.epoch:  # else they went with the lease
            self.index.complete_load(write.pinned)  # the pool may evict them now
            if tier.pool_stages:  # the tier has them; the pool was staging
                self.index.discard(write.pinned)
                if self.events is not None:
                    self.events.removed(POOL, write.pinned)

    def _finish(self, job_id: int) -> None:
        job = self._jobs.pop(job_id)
        self._windowed.discard(job_id)
        state = self._requests[job.req_id]
        state.jobs.discard(job_id)
        live = job.epoch == self.index.epoch  # else its lease went with an old connection
        late = False  # committed by row sums: its xxh3s still to come
        committed: list[list[int | None]] | None = None
        if job.is_store:
            if self.checked and not job.failed:
                committed = self._commit(job.keys, job.sums, live)
                job.failed = committed is None
                late = committed is not None and job.hash_later and \
                    not all(hashed(s) for s in committed)
                if late:  # a rank that hashed before its report needs no later hash
                    n = len(job.keys)
                    ranks = {r: s[:n] for r, s in job.sums.items() if None not in s[:n]}
                    self._late[job_id] = LateHash(job.keys, committed, {**ranks, **job.hashed},
                                                  job.epoch, job.resets, job.slots)
            elif live:
                self.index.complete_store(job.keys, not job.failed)
            if self.events is not None and not (late and live):  # else once hashed (below)
                if not job.failed and live and job.resets == self._resets:
                    self.events.stored(POOL, job.keys)  # every worker stored it: loadable
                else:
                    self.events.settled(job.keys)
            self._counters.failed_stores += job.failed
            # A tier below checks by xxh3: a block committed by row sums that no lease wanted
            # hashed is not written there.
            if not job.failed and live and job.resets == self._resets and not late \
                    and (committed is None or all(hashed(s) for s in committed)):
                self._write_stored(job.keys, self._xxh3s(job.keys, job.sums))
        else:
            fetched = [key for _, keys in job.fetches for key in keys]
            kept = False  # the fetched blocks stay in the pool
            if live:
                self.index.complete_load(job.keys)
                if fetched and self.checked and not job.failed:
                    kept = self._commit(fetched, job.sums, live) is not None
                elif fetched:
                    kept = not job.failed and not self.staging
                    self.index.complete_store(fetched, kept)
            bad = self._bad.pop(job_id, [])
            for name, keys in job.fetches:
                self._by_name[name].complete_fetch(job_id, keys, [k for k in bad if k in keys])
            if job.failed:
                # The slots may hold bad bytes: drop the keys so the recomputed blocks are
                # stored again, and store this request's blocks again from the failed load on.
                self._counters.failed_loads += 1
                if live:
                    self.index.discard(job.keys)
                state.stored_upto = min(state.stored_upto, job.start_block)
            if self.events is not None:
                self._load_events(job, fetched, bad, kept and job.resets == self._resets,
                                  job.failed and live)
        self._forget_if_idle(job.req_id)

    def _xxh3s(self, keys: list[bytes], by_rank: dict[int, list[int | None]]
               ) -> list[list[int]] | None:
        """Per block its ranks' xxh3s (a checked pool's; None for a private pool's)."""
        if not self.checked:
            return None
        return [list(s) for s in zip(*(by_rank[r][:len(keys)] for r in range(self.num_workers)),
                                     strict=True)]

    def _write_stored(self, keys: list[bytes], sums: list[list[int]] | None) -> None:
        """Stored blocks go to every tier that writes stored blocks, pinned in the pool while
        written (a checked pool's with their xxh3s, `sums`: what a tier may keep to check the
        bytes it returns; one another engine evicted since is not, the rest are)."""
        for tier in self.tiers:
            if not tier.writes_stored:
                continue
            plan = self.index.prepare_load(keys)
            if plan is None:  # one is gone (evicted since): write those still there
                there = [i for i, ok in enumerate(self.index.present(keys)) if ok]
                keys = [keys[i] for i in there]
                sums = None if sums is None else [sums[i] for i in there]
                plan = self.index.prepare_load(keys) if keys else None
            if plan is None:
                return
            written = self._write(tier, keys, plan.slots, evicted=False, pinned=True, sums=sums)
            if len(written) < len(keys):
                self.index.complete_load([k for k in keys if k not in written])

    def _commit(self, keys: list[bytes], by_rank: dict[int, list[int | None]],
                live: bool) -> list[list[int | None]] | None:
        """Commit blocks stored (or fetched) into a shared pool with every rank's checksums
        (transfer.checksums.block_sums: a block some rank did not hash is committed by its row
        sums); returns what each was committed with, None when it failed (a rank's are missing:
        such a block could never be checked)."""
        ranks = [by_rank.get(rank) for rank in range(self.num_workers)]
        sums = None
        if not any(s is None or len(s) not in (len(keys), 2 * len(keys)) for s in ranks):
            sums = block_sums(ranks, len(keys))  # type: ignore[arg-type]
        if live:
            self.index.complete_store(keys, sums is not None, sums)
        return sums

    def _attach_hashes(self) -> None:
        """Stores committed by row sums whose xxh3s every rank has reported: attach them to the
        blocks that still match (`add_sums`, one round trip; a block whose slot changed since
        its commit is dropped, counted where the daemon dropped it), publish the blocks
        attached as stored (loadable by every reader only now), then write them, job by job,
        to the tiers that write stored blocks."""
        done = [(job_id, late) for job_id, late in self._late.items()
                if len(late.hashed) == self.num_workers]
        if not done:
            return
        keys, lists, slots = [], [], []
        for job_id, late in done:
            del self._late[job_id]
            if late.epoch != self.index.epoch:  # its lease went with an old connection
                if self.events is not None:
                    self.events.settled(late.keys)
                continue
            for i, (key, committed) in enumerate(zip(late.keys, late.committed, strict=True)):
                if hashed(committed):  # a rank hashed it before its report: committed whole
                    continue
                xxh3s = [late.hashed[rank][i] for rank in range(self.num_workers)]
                if None in xxh3s:  # its slot no longer holds what was committed: drop it
                    xxh3s = [None] * self.num_workers
                keys.append(key)
                lists.append(xxh3s + committed[self.num_workers:])
                slots.append(late.slots[i])
        applied = dict(zip(keys, self.index.add_sums(keys, lists, slots),  # type: ignore
                           strict=True)) if keys else {}  # no round trip for nothing
        xxh3s = dict(zip(keys, lists, strict=True))
        for _, late in done:
            if late.epoch != self.index.epoch:
                continue
            self._counters.late_hash_mismatches += sum(
                1 for key in late.keys if applied.get(key) and xxh3s[key][0] is None)
            good = [(key, xxh3s[key][:self.num_workers] if key in xxh3s else committed)
                    for key, committed in zip(late.keys, late.committed, strict=True)
                    if hashed(committed) or (applied[key] and xxh3s[key][0] is not None)]
            fresh = late.resets == self._resets  # else a reset since: not published nor written
            if self.events is not None:
                if fresh:
                    self.events.stored(POOL, [key for key, _ in good])
                self.events.settled(late.keys)  # the rest: never loadable here
            if good and fresh and any(tier.writes_stored for tier in self.tiers):
                self._write_stored([key for key, _ in good],
                                   [list(s[:self.num_workers]) for _, s in good])

    def _forget_if_idle(self, req_id: str) -> None:
        state = self._requests[req_id]
        if state.finished and not state.jobs:
            del self._requests[req_id]

    # ---- whole tier ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every stored block (jobs in flight finish; their slots drain)."""
        self.index.clear()
        self._resets += 1
        if self.events is not None:
            self.events.cleared(POOL)
        for tier in self.tiers:  # and below, or a restart would find them again
            if tier.reset():
                self._step.erase.append(tier.name)
                if self.events is not None:
                    self.events.cleared(tier.name)
        for state in self._requests.values():
            state.stored_upto = 0

    # ---- KV events (events.py) ----------------------------------------------------------------

    def enable_events(self, sources: Sequence[str], describe: Describe | None = None) -> None:
        """Log what becomes loadable from each of `sources` (POOL, tier names) and what stops
        being loadable (`take_block_changes`); `describe`: see events.py. Without this call the
        core does no event work."""
        # A pool other engines change too (a shared pool's daemon) tells its own changes.
        fed = [POOL] if callable(getattr(self.index, "take_changes", None)) else []
        self.events = BlockLog(sources, describe, fed)
        for tier in self.tiers:
            tier.track_drops = tier.name in sources

    def take_block_changes(self) -> list[BlockChange]:
        """What became loadable and what stopped since the last call (empty without events):
        with the tiers' own evictions and, from a shared pool, every engine's commits and
        evictions (its daemon's change log, read once a call)."""
        if self.events is None:
            return []
        for tier in self.tiers:
            if tier.track_drops:
                self.events.removed(tier.name, tier.take_dropped())
        if POOL in self.events.fed:  # one round trip a step
            self.events.feed(POOL, *self.index.take_changes())  # type: ignore[attr-defined]
        return self.events.take()

    def _load_events(self, job: Job, fetched: list[bytes], bad: list[bytes], kept: bool,
                     dropped: bool) -> None:
        """A load ended: its fetches' bad keys left their tiers, its good fetched blocks are in
        the pool (`kept`), a failed load's pool blocks left it (`dropped`)."""
        assert self.events is not None
        for name, keys in job.fetches:
            self.events.removed(name, [key for key in bad if key in keys])
        if kept:
            self.events.stored(POOL, fetched)
        else:
            self.events.settled(fetched)
        if dropped:
            self.events.removed(POOL, job.keys)

    def tier(self, name: str) -> TierPlanner:
        """The planner of tier `name`."""
        return self._by_name[name]

    def has_jobs(self) -> bool:
        """Jobs planned or in flight: the engine must keep stepping to complete them."""
        return bool(self._jobs or self._writes or self._late)

    def take_counters(self) -> OffloadCounters:
        """Counters since the last call (jobs_in_flight is the current value)."""
        evictions = self.index.stats.evictions
        counters, self._counters = self._counters, OffloadCounters()
        counters.evictions = evictions - self._evictions_seen
        counters.jobs_in_flight = len(self._jobs) + len(self._writes)
        for tier in self.tiers:
            counters.add(tier.name, tier.take_counters())
        self._evictions_seen = evictions
        return counters

    def close(self) -> None:
        """Close the tiers' planners (their connections and threads), once."""
        tiers, self._closing = ([] if self._closing else self.tiers), True
        for tier in tiers:
            tier.close()
