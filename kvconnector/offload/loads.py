"""The lookup and load half of the scheduler core (`LoadPlanner`, the base of
scheduler.py's `OffloadScheduler`): which prefix the tiers can serve a request now, and the load
job that brings it back; with `_add_job` and the eviction spill, which store planning shares.

Every GPU block holds `block_size` tokens of every layer; its key is the namespace digest + the
engine's chained block hash, so a key names a whole prefix. With several KV cache groups (vLLM's
hybrid manager: full attention, sliding window and state groups sharing one block pool) a block
id belongs to one group at a time and a slot holds one physical block; a group's keys carry its
`CacheGroup.prefix` before the hash. A reload of a prefix of P blocks needs, per group, every
block before P (full attention), the blocks inside the window before P (sliding window: the
others are vLLM's null block in the group's table) or the block at P - 1 (a state group: the
state there), so `lookup` answers the longest prefix every group can serve.

With a remote store, `lookup` keeps the keys past the CPU tier's hits (`remote_candidates`); the
adapter asks the store and sets `set_remote_hits`; the load then also fetches those blocks into
slots reserved like stores (a good fetch leaves them in the CPU tier). With a disk tier, `lookup`
counts the blocks on disk after the CPU tier's hits (at most as many as the pool has slots to take
now), the remote store's after those; a load reads them into slots reserved like fetches.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconnector.offload.disk_tier import DiskPlanner
from kvconnector.offload.groups import CacheGroup, window_blocks
from kvconnector.offload.jobs import DiskWrite, StepJobs, TransferJob
from kvconnector.offload.records import Job, Lookup, OffloadCounters, RequestState
from transfer.block_index import BlockIndex, StorePlan
from transfer.keys import Namespace, block_hash_bytes
from transfer.shared.client import SharedIndex
from transfer.shared.protocol import split_sums


class LoadPlanner:
    """Lookups and load planning over the scheduler core's state, which `OffloadScheduler`
    (scheduler.py) sets up and completes."""

    namespace: Namespace
    block_size: int
    num_workers: int
    groups: tuple[CacheGroup, ...]
    index: BlockIndex | SharedIndex
    checked: bool  # a shared pool: blocks carry checksums
    disk: DiskPlanner | None
    _requests: dict[str, RequestState]
    _lookups: dict[str, Lookup]  # request -> its last lookup
    _jobs: dict[int, Job]
    _next_job_id: int
    _step: StepJobs
    _counters: OffloadCounters

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
            lookup = self._lookups[req_id] = Lookup(start, len(hashes), hits, keys[hits:])
            if self.disk is not None:  # room: slots to read into, past the hits the load pins
                lookup.disk_hits, lookup.disk_capped = self.disk.leading_hits(
                    lookup.rest, max(0, self.index.num_reclaimable - hits))
            return (hits + lookup.disk_hits) * self.block_size
        hits = self._group_hits(start, hashes)
        self._lookups[req_id] = Lookup(start, len(hashes), hits, [])
        return hits * self.block_size

    def _group_hits(self, start: int, hashes: Sequence[bytes]) -> int:
        """Several groups: the longest prefix of `hashes` (blocks from `start`) whose blocks
        every group needs are in the pool or on disk, the disk's no more than the pool has
        slots to read them into now."""
        keys = [self._keys(group, hashes) for group in self.groups]
        pooled = self.index.present([key for group_keys in keys for key in group_keys])
        runs, disk_sums = [], []  # per group: blocks held ending at each position; read counts
        for i, group_keys in enumerate(keys):
            run, counts, read, reads = 0, [], 0, [0]
            for j, key in enumerate(group_keys):
                in_pool = pooled[i * len(hashes) + j]
                on_disk = not in_pool and self.disk is not None and self.disk.index.contains(key)
                run = run + 1 if in_pool or on_disk else 0
                read += on_disk
                counts.append(run)
                reads.append(read)
            runs.append(counts)
            disk_sums.append(reads)
        for p in range(len(hashes), 0, -1):
            needed = [self._needed(group, start, start + p) for group in self.groups]
            if any(counts[p - 1] < len(positions)
                   for positions, counts in zip(needed, runs, strict=True)):
                continue
            from_disk = sum(sums[r.stop - start] - sums[r.start - start]
                            for r, sums in zip(needed, disk_sums, strict=True))
            pinned = sum(map(len, needed)) - from_disk
            if not from_disk or from_disk <= self.index.num_reclaimable - pinned:
                return p
        return 0

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
        lookup = self._lookups.pop(req_id, None) or Lookup(0, 0, 0, [])
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
        state = self._requests.setdefault(req_id, RequestState())
        for table in tables:
            if len(table) < start + hit_blocks:
                raise ValueError(f"request {req_id!r}: {len(table)} blocks allocated, the load "
                                 f"needs {start + hit_blocks}")
        if len(self.groups) == 1:
            cpu_blocks = min(hit_blocks, lookup.cpu_hits)
            disk_blocks = min(hit_blocks - cpu_blocks, lookup.disk_hits)
            remote_blocks = hit_blocks - cpu_blocks - disk_blocks
            disk_keys = lookup.rest[:disk_blocks]
            fetch_keys = lookup.rest[disk_blocks:hit_blocks - cpu_blocks]
            # Blocks read or fetched are past the CPU tier's.
            group = self.groups[0]
            keys = self._keys(group, [block_hashes[i]
                                      for i in self._needed(group, start, start + cpu_blocks)])
            destination = [tables[0][i] for i in self._needed(group, start, start + hit_blocks)]
        else:
            keys, disk_keys, destination, disk_blocks = self._group_load(
                block_hashes, tables, start, hit_blocks)
            cpu_blocks, remote_blocks, fetch_keys = hit_blocks - disk_blocks, 0, []
        self._counters.disk_hit_tokens += disk_blocks * self.block_size
        self._counters.remote_hit_tokens += remote_blocks * self.block_size
        plan = self.index.prepare_load(keys)
        if plan is None:  # a shared pool lost a key since the lookup: fail, pinning nothing
            keys, disk_keys, fetch_keys = [], [], []
        slots, fail = ([], True) if plan is None else (list(plan.slots), False)
        split = [] if plan is None or not self.checked else \
            [split_sums(s, self.num_workers) for s in plan.sums]
        sums, row_sums = tuple(h for h, _ in split), tuple(r for _, r in split)
        if not all(row_sums):
            row_sums = ()  # checked by xxh3 unless every block carries row sums
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
                                            tuple(keys) if sums else (), sums, row_sums))
        return cpu_blocks, disk_blocks, remote_blocks

    def _group_load(self, block_hashes: Sequence[bytes], tables: Sequence[Sequence[int]],
                    start: int, hit_blocks: int) -> tuple[list[bytes], list[bytes], list[int],
                                                          int]:
        """Several groups: (keys loaded from the pool, keys read from disk, their destination
        blocks in that order, positions with a block read from disk) for a prefix of
        `hit_blocks` blocks from `start`. A key gone from the pool since the lookup (a shared
        pool's, evicted by another engine) stays among the pool's: its load fails."""
        pairs = []  # (key, destination, position) of every block a group needs
        for group, table in zip(self.groups, tables, strict=True):
            positions = self._needed(group, start, start + hit_blocks)
            pairs += zip(self._keys(group, [block_hashes[i] for i in positions]),
                         [table[i] for i in positions], positions, strict=True)
        pooled = self.index.present([key for key, _, _ in pairs])
        on_disk = [not ok and self.disk is not None and self.disk.index.contains(pair[0])
                   for pair, ok in zip(pairs, pooled, strict=True)]
        kept = [pair for pair, disk in zip(pairs, on_disk, strict=True) if not disk]
        read = [pair for pair, disk in zip(pairs, on_disk, strict=True) if disk]
        return ([key for key, _, _ in kept], [key for key, _, _ in read],
                [block for _, block, _ in kept + read], len({i for _, _, i in read}))

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


    def _add_job(self, state: RequestState, req_id: str, is_store: bool, keys: list[bytes],
                 start_block: int) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = Job(req_id, is_store, keys, start_block, self.num_workers,
                                  self.index.epoch)
        state.jobs.add(job_id)
        return job_id
