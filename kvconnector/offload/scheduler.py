"""Scheduler-side core of the CPU-tier connector: which blocks to load and store, and when.

No vLLM imports: the vLLM adapter (kvconnector.vllm) feeds it plain values (request ids, block
hashes, GPU block ids, token counts) and ships what `build_step` returns to the workers.

Every GPU block holds `block_size` tokens of every layer; its key is the namespace digest + the
engine's chained block hash, so a key names a whole prefix. With several KV cache groups (vLLM's
hybrid manager: full attention, sliding window and state groups sharing one block pool) a block
id belongs to one group at a time and a slot holds one physical block; a group's keys carry its
`CacheGroup.prefix` before the hash. A reload of a prefix of P blocks needs, per group, every
block before P (full attention), the blocks inside the window before P (sliding window: the
others are vLLM's null block in the group's table) or the block at P - 1 (a state group: the
state there), so `lookup` answers the longest prefix every group can serve. The block index
(transfer/block_index.py) maps keys to host pool slots; every worker owns a pool with the same
slot count, so one slot id names one block of every rank.

Life of a job: `plan_load` / `plan_stores` / `request_finished` create jobs; `build_step` hands them
out once; every worker reports each job done or failed (`JobReport`, summed over ranks by vLLM's
aggregation); when all `num_workers` have reported, `complete` finishes it in the index.

With a remote store (remote_tier.py): `lookup` keeps the keys past the CPU tier's
hits (`remote_candidates`); the adapter asks the store and sets `set_remote_hits`; a load job
then also fetches those blocks from the store into slots reserved like stores (a good fetch
leaves them in the CPU tier). Every store job is also put to the store by every worker once
copied (write-through; a worker whose bytes another rank puts only reports); its keys are
readable at once and pinned until every worker reports the put (`JobReport.put`), so no new
store reuses a slot zmq still reads.

With a disk tier (kvconnector/offload/disk_tier.py): `lookup` counts the blocks on disk after the
CPU tier's hits (at most as many as the pool has slots to take now), the remote store's after
those; a load reads them into slots reserved like fetches; blocks go to disk as the pool evicts
them or, write-through, once stored (`StepJobs.spills`).

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
from dataclasses import asdict, dataclass, field

from kvconnector.offload.disk_tier import DiskPlanner
from kvconnector.offload.groups import CacheGroup, window_blocks
from kvconnector.offload.jobs import DiskWrite, JobReport, StepJobs, TransferJob
from transfer.block_index import BlockIndex, StorePlan
from transfer.keys import Namespace, block_hash_bytes
from transfer.shared.client import SharedIndex


@dataclass
class OffloadCounters:
    """What happened since the last `take_counters` (tokens, bytes, seconds, jobs)."""

    hit_tokens: int = 0
    miss_tokens: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    failed_loads: int = 0
    failed_stores: int = 0
    evictions: int = 0
    unplaced_blocks: int = 0  # blocks not stored: every slot busy
    remote_hit_tokens: int = 0  # of hit_tokens, fetched from the remote store
    disk_hit_tokens: int = 0  # of hit_tokens, read from the disk tier
    disk_read_bytes: int = 0  # disk_*: see DiskCounters
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    checksum_failures: int = 0  # loads refused: a shared pool block's checksum differed
    disk_failed_reads: int = 0
    disk_failed_writes: int = 0
    disk_evictions: int = 0
    remote_lookup_failures: int = 0  # store lookups late or failed (answered from the CPU tier)
    jobs_in_flight: int = 0  # a gauge: planned or running, not yet reported by every worker


@dataclass
class _Job:
    req_id: str
    is_store: bool
    keys: list[bytes]
    start_block: int  # index in the request's block table of the first block
    pending: int  # workers yet to report
    epoch: int  # the index's epoch when planned
    failed: bool = False
    fetch_keys: list[bytes] = field(default_factory=list)  # load: reserved for a read or get
    disk_keys: list[bytes] = field(default_factory=list)  # load: read from disk (pinned there)
    # a shared pool's store (or fetch): rank -> checksums of the blocks it wrote
    sums: dict[int, list[int]] = field(default_factory=dict)
    # store of sliding window blocks: vLLM frees one of them once the request's computed
    # tokens reach this; the job must be flushed before a forward may write the block again
    leaves_at: int | None = None


@dataclass
class _Put:
    keys: list[bytes]
    pending: int  # workers yet to report the put
    epoch: int
    finished: bool = False  # the store job is done
    pinned: bool = False  # the keys are pinned (the store succeeded)


@dataclass
class _Lookup:
    start: int  # first block asked about
    asked: int  # blocks asked about
    cpu_hits: int  # leading blocks the CPU tier holds
    rest: list[bytes]  # keys of the blocks after those
    disk_hits: int = 0  # leading `rest` on disk
    remote_hits: int = 0  # `rest` after the disk hits in the remote store
    disk_capped: bool = False  # more were on disk than the pool could take: no remote hits


@dataclass
class _Request:
    stored_upto: int = 0  # blocks [0, stored_upto) are stored, being stored or not to be stored
    jobs: set[int] = field(default_factory=set)
    finished: bool = False


class OffloadScheduler:
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
        if len(groups) > 1 and (remote or remote_only or disk is not None or index is not None):
            raise ValueError("a remote, disk or shared pool tier with several KV cache groups "
                             "is not supported")
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
        self._requests: dict[str, _Request] = {}
        self._lookups: dict[str, _Lookup] = {}  # request -> its last lookup
        self._jobs: dict[int, _Job] = {}
        # Write-through: store job -> its put (every worker reports one per remote store job,
        # a failed copy included); the keys stay pinned like a load meanwhile, so no new store
        # reuses their slots while zmq reads them.
        self._puts: dict[int, _Put] = {}
        self._next_job_id = 0
        self._step = StepJobs()
        self._counters = OffloadCounters()
        self._evictions_seen = 0

    # ---- lookups (no side effects on the tier) -------------------------------------------

    def _keys(self, group: CacheGroup, block_hashes: Sequence[bytes]) -> list[bytes]:
        if not group.prefix:
            return self.namespace.keys(list(block_hashes))
        return [self.namespace.key(group.prefix + block_hash_bytes(h)) for h in block_hashes]

    def _needed(self, group: CacheGroup, start: int, end: int) -> range:
        """Positions of `group` a reload of blocks [start, end) writes."""
        if group.state:
            return range(max(start, end - 1), end)
        if group.window is None:
            return range(start, end)
        return range(max(start, end - window_blocks(group.window, self.block_size)), end)

    def lookup(self, req_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
               num_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (block aligned) that the tier can load now: the
        longest prefix every group can serve (see module doc), never the block holding the last
        token. Remembers the range asked about for the hit/miss counts."""
        if num_computed_tokens % self.block_size:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is not a multiple of "
                             f"the block size {self.block_size}")
        start = num_computed_tokens // self.block_size
        # As vLLM's prefix cache: the block with the last token is recomputed. A full hit would
        # leave vLLM one token to compute (decode-shaped), whose logprobs differ from the
        # prefill that produced the stored blocks.
        end = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hashes = list(block_hashes[start:end])
        if len(self.groups) == 1:
            keys = self._keys(self.groups[0], hashes)
            hits = self.index.lookup_prefix(keys)
            rest = keys[hits:]
        else:
            # runs[g][i]: stored blocks of group g ending at position start + i
            runs = []
            for group in self.groups:
                run, counts = 0, []
                for key in self._keys(group, hashes):
                    run = run + 1 if self.index.contains(key) else 0
                    counts.append(run)
                runs.append(counts)
            hits = next((p for p in range(len(hashes), 0, -1)
                         if all(counts[p - 1] >= len(self._needed(group, start, start + p))
                                for group, counts in zip(self.groups, runs, strict=True))), 0)
            rest = []
        lookup = self._lookups[req_id] = _Lookup(start, len(hashes), hits, rest)
        if self.disk is not None:  # room: slots to read into, past the hits the load pins
            lookup.disk_hits, lookup.disk_capped = self.disk.leading_hits(
                lookup.rest, max(0, self.index.num_reclaimable - hits))
        return (hits + lookup.disk_hits) * self.block_size

    def remote_candidates(self, req_id: str) -> list[bytes]:
        """Keys of the last lookup after the CPU and disk tiers' hits (what to ask the store
        for)."""
        lookup = self._lookups.get(req_id)
        if lookup is None or lookup.disk_capped:
            return []
        return list(lookup.rest[lookup.disk_hits:])

    def set_remote_hits(self, req_id: str, blocks: int) -> None:
        """The store holds the first `blocks` remote candidates of the last lookup."""
        lookup = self._lookups[req_id]
        candidates = len(self.remote_candidates(req_id))
        if not 0 <= blocks <= candidates:
            raise ValueError(f"request {req_id!r}: {blocks} remote hits of {candidates}")
        lookup.remote_hits = blocks

    # ---- planning --------------------------------------------------------------------------

    def _tables(self, block_ids: Sequence[Sequence[int]] | Sequence[int]) -> list[Sequence[int]]:
        """The request's block table per group (a flat list: the only group's)."""
        if len(block_ids) and not isinstance(block_ids[0], int):
            tables = list(block_ids)
        else:
            tables = [block_ids]
        if len(tables) != len(self.groups):
            raise ValueError(f"{len(tables)} block tables for {len(self.groups)} KV cache groups")
        return tables

    def plan_load(self, req_id: str, block_hashes: Sequence[bytes],
                  block_ids: Sequence[Sequence[int]] | Sequence[int],
                  num_external_tokens: int) -> tuple[int, int, int]:
        """Load `num_external_tokens` after the last lookup's start into the request's blocks
        (`block_ids`: its whole block table, one per group). Also counts the admission's hits
        and misses. Returns blocks from (the CPU tier, the disk tier, the remote store)."""
        tables = self._tables(block_ids)
        lookup = self._lookups.pop(req_id, None) or _Lookup(0, 0, 0, [])
        start, asked = lookup.start, lookup.asked
        hit_blocks, rest = divmod(num_external_tokens, self.block_size)
        offered = lookup.cpu_hits + lookup.disk_hits + lookup.remote_hits
        if rest or hit_blocks > offered:
            raise ValueError(f"request {req_id!r}: cannot load {num_external_tokens} tokens; the "
                             f"last lookup offered {offered} blocks of {self.block_size}")
        self._counters.hit_tokens += hit_blocks * self.block_size
        self._counters.miss_tokens += (asked - hit_blocks) * self.block_size
        if hit_blocks == 0:
            return 0, 0, 0
        cpu_blocks = min(hit_blocks, lookup.cpu_hits)
        disk_blocks = min(hit_blocks - cpu_blocks, lookup.disk_hits)
        remote_blocks = hit_blocks - cpu_blocks - disk_blocks
        self._counters.disk_hit_tokens += disk_blocks * self.block_size
        self._counters.remote_hit_tokens += remote_blocks * self.block_size
        disk_keys, fetch_keys = lookup.rest[:disk_blocks], lookup.rest[disk_blocks:hit_blocks
                                                                           - cpu_blocks]
        state = self._requests.setdefault(req_id, _Request())
        keys: list[bytes] = []
        destination: list[int] = []
        for group, table in zip(self.groups, tables, strict=True):
            if len(table) < start + hit_blocks:
                raise ValueError(f"request {req_id!r}: {len(table)} blocks allocated, the load "
                                 f"needs {start + hit_blocks}")
            # Blocks read or fetched are past the CPU tier's (one group only).
            needed = self._needed(group, start, start + cpu_blocks)
            keys += self._keys(group, [block_hashes[i] for i in needed])
            destination += [table[i] for i in self._needed(group, start, start + hit_blocks)]
        plan = self.index.prepare_load(keys)
        if plan is None:  # a shared pool lost a key since the lookup: fail, pinning nothing
            keys, disk_keys, fetch_keys = [], [], []
        slots, fail = ([], True) if plan is None else (list(plan.slots), False)
        sums = () if plan is None or not self.checked else tuple(map(tuple, plan.sums))
        disk_slots = []
        if disk_keys or fetch_keys:
            # Read and fetched blocks land in slots reserved as stores: nothing else reads or
            # evicts them until the job ends, and a good one stays in the CPU tier.
            fetch = self.index.prepare_store(disk_keys + fetch_keys)
            self._spill_evicted(fetch)
            if fetch.keys != disk_keys + fetch_keys:  # no room, or a key on its way: give up
                self.index.complete_store(fetch.keys, False)
                disk_keys, fetch_keys, fail = [], [], True
            if disk_keys:
                disk_slots = self.disk.index.prepare_load(disk_keys).slots
            slots += fetch.slots
        state.stored_upto = max(state.stored_upto, start + hit_blocks)
        job_id = self._add_job(state, req_id, False, keys, start)
        self._jobs[job_id].fetch_keys = disk_keys + fetch_keys
        self._jobs[job_id].disk_keys = disk_keys
        self._step.loads.append(TransferJob(job_id, req_id, tuple(destination), tuple(slots),
                                            tuple(fetch_keys), fail, tuple(disk_keys),
                                            tuple(disk_slots), self.index.segment,
                                            tuple(keys) if sums else (), sums))
        return cpu_blocks, disk_blocks, remote_blocks

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
            state = self._requests.setdefault(req_id, _Request())
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
                self._puts[job_id] = _Put(list(plan.keys), self.num_workers, self.index.epoch)
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
            state = self._requests[req_id] = _Request()  # its stores all come now
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

    def _spill_evicted(self, plan: StorePlan) -> None:
        """Write-back: blocks the pool evicts go to disk before their slots are written again
        (a shared pool's plan may evict other engines' blocks: those are theirs)."""
        if plan.evicted and self.disk is not None and not self.disk.write_through:
            own = [(k, s) for k, s in zip(plan.evicted, plan.evicted_slots, strict=True)
                   if self.namespace.owns(k)]
            if own:
                self._spill([k for k, _ in own], [s for _, s in own])

    def _spill(self, keys: list[bytes], slots: list[int], pinned: bool = False,
               sums: list[list[int]] | None = None) -> set[bytes]:
        """Write pool blocks to disk; `pinned`: the keys are pinned in the pool, and those
        written stay so until done; `sums`: their per-rank checksums, where committed with them.
        Returns the keys written."""
        write: DiskWrite | None = self.disk.spill(self._next_job_id, keys, slots, pinned,
                                                  self.index.segment, self.index.epoch, sums)
        if write is None:
            return set()
        self._next_job_id += 1
        self._step.spills.append(write)
        return set(write.keys)

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

    def _write_through(self, job: _Job) -> None:
        """A stored block goes to disk too, pinned in the pool while written (a shared pool's
        with the checksums it was committed with; one another engine evicted since is not)."""
        plan = self.index.prepare_load(job.keys)
        if plan is None:
            return
        sums = None
        if self.checked:
            sums = [list(s) for s in zip(*(job.sums[r] for r in range(self.num_workers)),
                                         strict=True)]
        written = self._spill(job.keys, plan.slots, pinned=True, sums=sums)
        if len(written) < len(job.keys):
            self.index.complete_load([k for k in job.keys if k not in written])

    def _commit(self, keys: list[bytes], by_rank: dict[int, list[int]], live: bool) -> bool:
        """Commit blocks stored (or fetched) into a shared pool with every rank's checksums;
        True when it failed (a rank's are missing: such a block could never be checked)."""
        ranks = [by_rank.get(rank) for rank in range(self.num_workers)]
        failed = any(sums is None or len(sums) != len(keys) for sums in ranks)
        if live:
            sums = None if failed else [list(s) for s in zip(*ranks, strict=True)]
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

    def _add_job(self, state: _Request, req_id: str, is_store: bool, keys: list[bytes],
                 start_block: int) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = _Job(req_id, is_store, keys, start_block, self.num_workers,
                                  self.index.epoch)
        state.jobs.add(job_id)
        return job_id
