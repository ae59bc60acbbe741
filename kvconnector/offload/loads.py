"""The lookup and load half of the scheduler core (`LoadPlanner`, the base of
scheduler.py's `OffloadScheduler`): which prefix the tiers can serve a request now, and the load
job that brings it back; with `_add_job` and the writes of evicted blocks, which store planning
shares.

Every GPU block holds `block_size` tokens of every layer; its key is the namespace digest + the
engine's chained block hash, so a key names a whole prefix. With several KV cache groups (vLLM's
hybrid manager: full attention, sliding window and state groups sharing one block pool) a block
id belongs to one group at a time and a slot holds one physical block; a group's keys carry its
`CacheGroup.prefix` before the hash. A reload of a prefix of P blocks needs, per group, every
block before P (full attention), the blocks inside the window before P (sliding window: the
others are vLLM's null block in the group's table) or the block at P - 1 (a state group: the
state there), so `lookup` answers the longest prefix every group can serve.

Below the pool, the tiers (transfer.tier: the disk, a remote store, ...) are asked in order
for the keys past the pool's hits: each its leading hits after the previous tier's, at most as
many as the pool has slots to take now (a tier may answer "not yet": the lookup then answers
None, and the engine asks again). A load fetches those blocks into pool slots reserved like
stores (a good fetch leaves them in the pool, unless the pool only stages a tier's blocks),
then copies them to the GPU with the pool's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvconnector.offload.admission import Admission
from kvconnector.offload.events import BlockLog
from kvconnector.offload.groups import CacheGroup, window_blocks
from kvconnector.offload.jobs import StepJobs, TransferJob, pack_row_sums
from kvconnector.offload.records import Job, Lookup, OffloadCounters, RequestState, Write
from transfer.block_index import PoolIndex, StorePlan
from transfer.checksums import hashed, split_sums
from transfer.keys import Namespace, block_hash_bytes
from transfer.tier import TierOp, TierPlanner

POOL = "pool"  # the source name of blocks the pool itself held, in plan_load's split


class LoadPlanner:
    """Lookups and load planning over the scheduler core's state, which `OffloadScheduler`
    (scheduler.py) sets up and completes."""

    namespace: Namespace
    block_size: int
    num_workers: int
    groups: tuple[CacheGroup, ...]
    index: PoolIndex
    tiers: tuple[TierPlanner, ...]
    checked: bool  # the pool's blocks carry checksums
    admission: Admission  # a request's max_load_tokens
    _not_wanted: Callable[[str], None]  # prefetch.py's
    _prefetch_wait: Callable[[Sequence[bytes]], tuple[bool, int]]
    _prefetch_flying: Callable[[Sequence[bytes]], dict[bytes, bool]]
    _requests: dict[str, RequestState]
    _lookups: dict[str, Lookup]  # request -> its last lookup
    _jobs: dict[int, Job]
    _writes: dict[int, Write]
    _next_job_id: int
    _resets: int
    _step: StepJobs
    _counters: OffloadCounters
    events: BlockLog | None  # KV events on: what becomes loadable and what stops

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
               num_tokens: int) -> int | None:
        """Tokens past `num_computed_tokens` (block aligned) that the tiers can load now: the
        longest prefix every group can serve (see module doc), never the block holding the last
        token; None while a tier's answer is not in. Remembers the range asked about for the
        hit/miss counts."""
        if num_computed_tokens % self.block_size:
            raise ValueError(f"num_computed_tokens {num_computed_tokens} is not a multiple of "
                             f"the block size {self.block_size}")
        start = num_computed_tokens // self.block_size
        # As vLLM's prefix cache: the block with the last token is recomputed. A full hit would
        # leave vLLM one token to compute (decode-shaped), whose logprobs differ from the
        # prefill that produced the stored blocks.
        end = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        end = self.admission.load_end(req_id, start, end)  # the request's max_load_tokens
        hashes = list(block_hashes[start:end])
        if len(self.groups) > 1:
            hits = self._group_hits(start, hashes)
            if hits is None:  # a block it needs is being fetched ahead (prefetch.py)
                return None
            self._lookups[req_id] = Lookup(start, len(hashes), hits, [])
            return hits * self.block_size
        keys = self._keys(self.groups[0], hashes)
        hits = self.index.lookup_prefix(keys)
        lookup = Lookup(start, len(hashes), hits, keys[hits:])
        room = max(0, self.index.num_reclaimable - hits)  # slots to fetch into, past the pins
        rest, total = lookup.rest, hits
        if self.tiers and rest:  # a fetch must not cover a key the pool holds past a hole:
            held = self.index.present(rest)  # it could not reserve a slot for it, and fail
            rest = rest[:held.index(True)] if True in held else rest
            wait, ask = self._prefetch_wait(rest)  # blocks being fetched ahead (prefetch.py)
            if wait:
                return None
            rest = self._not_on_their_way(rest[:ask])
        for tier in self.tiers:
            if not rest or not room:
                break
            found = tier.lookup(req_id, rest)
            if found is None:
                return None
            if not 0 <= found <= len(rest):
                raise ValueError(f"tier {tier.name!r} found {found!r} of {len(rest)} keys")
            taken = min(found, room)
            lookup.tier_hits.append(taken)
            total, room, rest = total + taken, room - taken, rest[taken:]
            if found > taken:  # the pool cannot take more now: nothing past them either
                break
        if total > hits and getattr(self.index, "row_sum_reader", False):
            hashed_upto = self._hashed_prefix(keys[:hits])
            if hashed_upto < hits:  # fetches would make it a load checked by xxh3: none
                lookup, total = Lookup(start, len(hashes), hashed_upto, keys[hashed_upto:]), \
                    hashed_upto
        self._lookups[req_id] = lookup
        return total * self.block_size

    def _hashed_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` carry their xxh3s. A row-sum reader's load with fetched
        blocks is checked by xxh3 (its fetched blocks carry no row sums): a pool block not
        hashed yet would fail that check, so such a load ends before the first of them."""
        committed = self.index.checksums(keys)  # type: ignore[attr-defined]
        return next((i for i, sums in enumerate(committed) if not hashed(sums or ())),
                    len(keys))

    def _not_on_their_way(self, keys: list[bytes]) -> list[bytes]:
        """The leading `keys` that no store or fetch is bringing into the pool now. A fetch
        cannot reserve a slot for a key on its way (another request's load fetching it, or a
        store of it), so a load offered it would fail and vLLM would recompute: a lookup offers
        none from there on. (A shared pool's index cannot tell: its lookups are unchanged.)"""
        return next((keys[:i] for i, key in enumerate(keys) if self._on_its_way(key)), keys)

    def _on_its_way(self, key: bytes) -> bool:
        """Whether a store or fetch is bringing `key` into the pool now (False where the index
        cannot tell: a shared pool's)."""
        storing = getattr(self.index, "is_being_stored", None)
        return storing is not None and storing(key)

    def _below(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key the pool lacks, the first tier (its index in `tiers`) that holds it."""
        found: list[int | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers):
            todo = [j for j, where in enumerate(found) if where is None]
            if not todo:
                break
            for j, held in zip(todo, tier.present([keys[j] for j in todo]), strict=True):
                if held:
                    found[j] = i
        return found

    def _group_hits(self, start: int, hashes: Sequence[bytes]) -> int | None:
        """Several groups: the longest prefix of `hashes` (blocks from `start`) whose blocks
        every group needs are in the pool or a tier below, those below no more than the pool
        has slots to fetch them into now, and none being fetched ahead; None while one it needs
        is being fetched ahead before that prefetch's deadline (ask again later)."""
        keys = [self._keys(group, hashes) for group in self.groups]
        flat = [key for group_keys in keys for key in group_keys]
        flying = self._prefetch_flying(flat)  # a fetch could not reserve their slots
        pooled = self.index.present(flat)
        below = iter(self._below([k for k, ok in zip(flat, pooled, strict=True) if not ok]))
        # per key: held in a tier below (a fetch); None where the pool holds it
        fetch = [None if ok else next(below) is not None for ok in pooled]
        runs, fetch_sums = [], []  # per group: blocks held ending at each position; fetch counts
        for i in range(len(keys)):
            run, counts, fetched, fetches = 0, [], 0, [0]
            for from_below in fetch[i * len(hashes):(i + 1) * len(hashes)]:
                run = run + 1 if from_below is not False else 0
                fetched += bool(from_below)
                counts.append(run)
                fetches.append(fetched)
            runs.append(counts)
            fetch_sums.append(fetches)
        for p in range(len(hashes), 0, -1):
            needed = [self._needed(group, start, start + p) for group in self.groups]
            if any(counts[p - 1] < len(positions)
                   for positions, counts in zip(needed, runs, strict=True)):
                continue
            if flying:
                late = [flying[key] for r, group_keys in zip(needed, keys, strict=True)
                        for key in group_keys[r.start - start:r.stop - start] if key in flying]
                if any(late):
                    return None
                if late:  # past their deadline: a shorter prefix, without them
                    continue
            from_below = sum(sums[r.stop - start] - sums[r.start - start]
                             for r, sums in zip(needed, fetch_sums, strict=True))
            pinned = sum(map(len, needed)) - from_below
            if not from_below or from_below <= self.index.num_reclaimable - pinned:
                return p
        return 0

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
                  num_external_tokens: int) -> dict[str, int]:
        """Load `num_external_tokens` after the last lookup's start into the request's blocks
        (`block_ids`: its whole block table, one per group). Also counts the admission's hits
        and misses. Returns the blocks each source serves: POOL, then each tier by name (those
        serving none left out)."""
        tables = self._tables(block_ids)
        self._not_wanted(req_id)  # scheduled: its own load takes over from a prefetch
        lookup = self._lookups.pop(req_id, None) or Lookup(0, 0, 0, [])
        start, asked = lookup.start, lookup.asked
        hit_blocks, rest = divmod(num_external_tokens, self.block_size)
        offered = lookup.pool_hits + sum(lookup.tier_hits)
        if len(self.groups) > 1:
            offered = lookup.pool_hits  # a group lookup's hits count every tier
        if rest or hit_blocks > offered:
            raise ValueError(f"request {req_id!r}: cannot load {num_external_tokens} tokens; the "
                             f"last lookup offered {offered} blocks of {self.block_size}")
        self._counters.hit_tokens += hit_blocks * self.block_size
        self._counters.miss_tokens += (asked - hit_blocks) * self.block_size
        if hit_blocks == 0:
            return {}
        state = self._requests.setdefault(req_id, RequestState())
        for table in tables:
            if len(table) < start + hit_blocks:
                raise ValueError(f"request {req_id!r}: {len(table)} blocks allocated, the load "
                                 f"needs {start + hit_blocks}")
        if len(self.groups) == 1:
            pool_blocks = min(hit_blocks, lookup.pool_hits)
            fetches, split, taken = [], {POOL: pool_blocks}, pool_blocks
            for tier, hits in zip(self.tiers, lookup.tier_hits, strict=False):
                count = min(hit_blocks - taken, hits)
                if count:
                    at = taken - lookup.pool_hits
                    fetches.append((tier, lookup.rest[at:at + count]))
                    split[tier.name] = count
                taken += count
            # Fetched blocks are past the pool's.
            group = self.groups[0]
            keys = self._keys(group, [block_hashes[i]
                                      for i in self._needed(group, start, start + pool_blocks)])
            destination = [tables[0][i] for i in self._needed(group, start, start + hit_blocks)]
        else:
            keys, fetches, destination, split = self._group_load(block_hashes, tables, start,
                                                                 hit_blocks)
        for name, blocks in split.items():
            if name != POOL:
                self._counters.add(name, {"hit_tokens": blocks * self.block_size})
        plan = self.index.prepare_load(keys)
        if plan is not None and self.checked and self._unhashed_for_xxh3(plan.sums, fetches):
            self.index.complete_load(keys)  # its check would fail a block that is fine: unpin,
            plan = None  # and the load fails with no key to drop (vLLM computes them)
        if plan is None:  # a shared pool lost a key since the lookup: fail, pinning nothing
            keys, fetches = [], []
        job_id = self._add_job(state, req_id, False, keys, start)
        slots, fail = ([], True) if plan is None else (list(plan.slots), False)
        split_by_rank = [] if plan is None or not self.checked else \
            [split_sums(s, self.num_workers) for s in plan.sums]
        sums = tuple(h for h, _ in split_by_rank)
        row_sums = pack_row_sums([r for _, r in split_by_rank], self.num_workers)
        ops = self._plan_fetches(job_id, fetches) if fetches else None
        if ops and self.events is not None:
            self.events.planned(req_id, [key for op in ops for key in op.keys])
        if ops is None and fetches:
            fail = True
        elif ops:
            slots += [slot for op in ops for slot in op.slots]
            self._jobs[job_id].fetches = [(op.tier, list(op.keys)) for op in ops]
        state.stored_upto = max(state.stored_upto, start + hit_blocks)
        self._step.loads.append(TransferJob(job_id, req_id, tuple(destination), tuple(slots),
                                            fail, self.index.segment,
                                            tuple(keys) if sums else (), sums, row_sums,
                                            tuple(ops or ())))
        return {name: blocks for name, blocks in split.items() if blocks}

    def _unhashed_for_xxh3(self, sums: Sequence[list[int | None]],
                           fetches: Sequence[object]) -> bool:
        """Whether a load would be checked by xxh3 (a block lacks row sums, or it fetches)
        while one of its pool blocks is not hashed yet (committed by row sums since the
        lookup, e.g. evicted and stored again): that check would fail a good block."""
        if all(hashed(s) for s in sums):
            return False
        return bool(fetches) or not all(split_sums(s, self.num_workers)[1] for s in sums)

    def _plan_fetches(self, job_id: int, fetches: list[tuple[TierPlanner, list[bytes]]]
                      ) -> list[TierOp] | None:
        """Fetch ops into pool slots reserved as stores (nothing else reads or evicts them
        until the job ends, and a good block stays in the pool); None when they cannot all be
        planned (no room, a key on its way, a tier lost a key), reserving nothing."""
        wanted = [key for _, keys in fetches for key in keys]
        reserved = self.index.prepare_store(wanted)
        ops: list[TierOp] = []
        if reserved.keys == wanted:  # else no room, or a key on its way: give up
            at = 0
            for tier, keys in fetches:  # pinned below before the evicted blocks go there
                op = tier.plan_fetch(job_id, keys, reserved.slots[at:at + len(keys)],
                                     self.index.segment)
                if op is None:
                    break
                ops.append(op)
                at += len(keys)
        self._write_evicted(reserved)  # the pool dropped them whatever happens to the fetch
        if len(ops) == len(fetches):
            return ops
        for op, (tier, _) in zip(ops, fetches, strict=False):
            tier.complete_fetch(job_id, op.keys, ())
        self.index.complete_store(reserved.keys, False)
        return None

    def _group_load(self, block_hashes: Sequence[bytes], tables: Sequence[Sequence[int]],
                    start: int, hit_blocks: int
                    ) -> tuple[list[bytes], list[tuple[TierPlanner, list[bytes]]], list[int],
                               dict[str, int]]:
        """Several groups: (keys loaded from the pool, per tier the keys fetched from it, their
        destination blocks in that order, blocks served per source: POOL, then positions with a
        block from each tier) for a prefix of `hit_blocks` blocks from `start`. A key gone from
        the pool since the lookup (a shared pool's, evicted by another engine) stays among the
        pool's: its load fails."""
        pairs = []  # (key, destination, position) of every block a group needs
        for group, table in zip(self.groups, tables, strict=True):
            positions = self._needed(group, start, start + hit_blocks)
            pairs += zip(self._keys(group, [block_hashes[i] for i in positions]),
                         [table[i] for i in positions], positions, strict=True)
        pooled = self.index.present([key for key, _, _ in pairs])
        missing = [pair for pair, ok in zip(pairs, pooled, strict=True) if not ok]
        below = dict(zip([key for key, _, _ in missing], self._below([k for k, _, _ in missing]),
                         strict=True))
        kept = [pair for pair in pairs if below.get(pair[0]) is None]
        fetches, fetched, split = [], [], {}
        for i, tier in enumerate(self.tiers):
            mine = [pair for pair in pairs if below.get(pair[0]) == i]
            if mine:
                fetches.append((tier, [key for key, _, _ in mine]))
                fetched += mine
                split[tier.name] = len({position for _, _, position in mine})
        split = {POOL: hit_blocks - len({position for _, _, position in fetched}), **split}
        return ([key for key, _, _ in kept], fetches,
                [block for _, block, _ in kept + fetched], split)

    def _write_evicted(self, plan: StorePlan) -> None:
        """Blocks the pool evicts go to the tiers that keep evicted blocks, before their slots
        are written again (a shared pool's plan may evict other engines' blocks: those are
        theirs). A checked pool's go with the xxh3s they were committed with (the tier keeps
        them, and checks the bytes it returns against them); one evicted before its xxh3s were
        attached (committed by row sums) is not written: it could not be checked."""
        if not plan.evicted:
            return
        if self.events is not None:  # a shared pool's other engines' keys: none announced
            self.events.removed(POOL, plan.evicted)
        own = [(k, s) for k, s in zip(plan.evicted, plan.evicted_slots, strict=True)
               if self.namespace.owns(k)]
        sums = None
        if self.checked and own and any(not t.writes_stored for t in self.tiers):
            known = getattr(self.index, "evicted_sums", {})
            kept = [(k, s) for k, s in own if hashed(known.get(k) or ())]
            self._counters.unhashed_spills_dropped += len(own) - len(kept)
            own = kept
            sums = [list(known[k][:self.num_workers]) for k, _ in own]
        for tier in self.tiers:
            if own and not tier.writes_stored:
                self._write(tier, [k for k, _ in own], [s for _, s in own], evicted=True,
                            sums=sums)

    def _write(self, tier: TierPlanner, keys: list[bytes], slots: list[int], *,
               evicted: bool, pinned: bool = False,
               sums: list[list[int]] | None = None) -> set[bytes]:
        """A tier's write of pool blocks; `pinned`: the keys are pinned in the pool, and those
        written stay so until done; `sums`: their per-rank checksums, where committed with them.
        Returns the keys written."""
        op = tier.plan_write(self._next_job_id, keys, slots, evicted=evicted,
                             segment=self.index.segment, sums=sums)
        if self.events is not None and tier.track_drops:
            self.events.removed(tier.name, tier.take_dropped())  # its room for these
        if op is None:
            return set()
        if self.events is not None:
            self.events.write_planned(op.op_id, tier.name, op.keys)
        self._next_job_id += 1
        self._writes[op.op_id] = Write(tier.name, list(op.keys) if pinned else [],
                                       self.num_workers, self.index.epoch)
        self._step.writes.append(op)
        return set(op.keys)

    def _add_job(self, state: RequestState, req_id: str, is_store: bool, keys: list[bytes],
                 start_block: int) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = Job(req_id, is_store, keys, start_block, self.num_workers,
                                  self.index.epoch, self._resets)
        state.jobs.add(job_id)
        return job_id
