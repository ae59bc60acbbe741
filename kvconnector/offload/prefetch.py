"""Prefetch: when a request arrives, its blocks that sit only below the pool (on disk, in a
store) start moving into the pool while it waits in vLLM's queue, so that when it is scheduled
they are pool hits and its fetch time is no longer part of its time to first token (the
`PrefetchPlanner` half of the scheduler core, scheduler.py's `OffloadScheduler`).

Built on the tier contract (transfer/tier.py): a prefetch is a tier's `plan_fetch` into pool
slots reserved as a store, sent to the workers among the step's tier ops (`StepJobs.writes`:
each worker's tier part fills its part of the slots, and reports the op with its bad keys as it
reports a write), and completed when every worker has: the good blocks become readable in the
pool, checked as any fetch (a tier verifies each block against its key; a bad one is dropped
from the pool and the tier, and is a miss).

With several KV cache groups (vLLM's hybrid manager) a prefetch wishes for exactly what a load
of the request's prefix would read now (loads.py's `_group_hits` and `_group_load`): the longest
prefix every group can serve from the pool or a tier, and of it, per group, the blocks a reload
needs (full attention: every block; sliding window: those inside the window before its end;
state group: the one at its last position, the state there) that the pool lacks, each from the
first tier holding it. A lookup waits for any of them in flight as for one group's.

Bounded and harmless:
- at most `max_blocks` blocks in flight, all requests together; a prefetch takes free slots or
  evicts idle blocks as a store does, never a pinned one (a block a running request is loading);
  a slot whose evicted block a tier writes out is filled only once that write is done;
- a lookup that reaches a block being prefetched waits for it ("ask again later") until the
  prefetch's deadline (`deadline_s` after it started), then goes on without it (those blocks
  are recomputed; the prefetch still completes into the pool);
- a request that finishes or is aborted before its prefetch is sent cancels it; one already
  sent completes (bounded by `max_blocks`);
- off with a checked (shared) pool, whose blocks are committed with checksums the workers take
  on a load, and with a pool that only stages a tier's blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvconnector.offload.admission import Admission
from kvconnector.offload.groups import CacheGroup
from kvconnector.offload.jobs import StepJobs
from kvconnector.offload.loads import POOL
from kvconnector.offload.records import OffloadCounters, Write
from transfer.block_index import PoolIndex, StorePlan
from transfer.keys import Namespace
from transfer.tier import TierOp, TierPlanner


@dataclass(frozen=True)
class PrefetchRules:
    """`max_blocks`: blocks in flight at once (0: no prefetch); `deadline_s`: how long a
    lookup waits for a block being prefetched."""

    max_blocks: int = 0
    deadline_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_blocks, bool) or not isinstance(self.max_blocks, int) or \
                self.max_blocks < 0:
            raise ValueError(f"max_blocks must be an int >= 0, got {self.max_blocks!r}")
        if isinstance(self.deadline_s, bool) or not isinstance(self.deadline_s, int | float) \
                or not math.isfinite(self.deadline_s) or self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be a positive number, got {self.deadline_s!r}")


@dataclass
class Prefetch:
    """One tier's fetch of a request's blocks into the pool, in flight."""

    req_id: str
    tier: str
    keys: list[bytes]
    deadline: float  # a lookup waits for these keys until then (the clock's seconds)
    op: TierOp  # the tier's fetch
    after: set[int]  # tier writes of the blocks its slots held, which it waits for
    queued: bool = False  # in the step being built
    sent: bool = False  # handed to the workers (it can no longer be cancelled)


class PrefetchPlanner:
    """Prefetch planning over the scheduler core's state (see module doc)."""

    namespace: Namespace
    block_size: int
    num_workers: int
    groups: tuple[CacheGroup, ...]
    index: PoolIndex
    tiers: tuple[TierPlanner, ...]
    checked: bool
    staging: bool
    admission: Admission
    _by_name: dict[str, TierPlanner]
    _writes: dict[int, Write]
    _next_job_id: int
    _step: StepJobs
    _counters: OffloadCounters
    _keys: Callable[[CacheGroup, Sequence[bytes]], list[bytes]]
    _needed: Callable[[CacheGroup, int, int], range]  # loads.py's
    _group_hits: Callable[[int, Sequence[bytes]], int | None]
    _below: Callable[[Sequence[bytes]], list[int | None]]
    _on_its_way: Callable[[bytes], bool]
    _write_evicted: Callable[[StorePlan], None]  # loads.py's

    def _init_prefetch(self, rules: PrefetchRules | None,
                       clock: Callable[[], float] = time.monotonic) -> None:
        self.prefetch_rules = rules or PrefetchRules()
        self._clock = clock
        self._prefetch_wanted: dict[str, list[bytes]] = {}  # request -> block hashes it may load
        self._prefetches: dict[int, Prefetch] = {}  # op id -> the prefetch in flight
        self._prefetching: dict[bytes, int] = {}  # key in flight -> its op id

    @property
    def prefetching(self) -> bool:
        """Whether prefetch is on for this engine (see module doc for when it is off)."""
        return (self.prefetch_rules.max_blocks > 0 and bool(self.tiers) and not self.checked
                and not self.staging)

    def prefetch(self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: its blocks below the pool are fetched ahead, from the next step
        on (a request scheduled before then loads them as usual)."""
        if not self.prefetching:
            return
        end = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        end = self.admission.load_end(req_id, 0, end)
        if end > 0:
            self._prefetch_wanted[req_id] = list(block_hashes[:end])

    def _plan_prefetches(self) -> None:
        """Queue the prefetches whose slots are written out, then plan the wanted ones that
        fit (build_step, once a step); a request whose tiers have not answered yet is asked
        again next step."""
        for prefetch in self._prefetches.values():
            if not prefetch.queued and not prefetch.after & self._writes.keys():
                self._step.writes.append(prefetch.op)
                prefetch.queued = True
        for req_id, hashes in list(self._prefetch_wanted.items()):
            room = min(self.prefetch_rules.max_blocks - len(self._prefetching),
                       self.index.num_reclaimable)
            if room <= 0:
                return
            if self._plan_prefetch(req_id, hashes, room):
                del self._prefetch_wanted[req_id]

    def _plan_prefetch(self, req_id: str, hashes: list[bytes], room: int) -> bool:
        """Fetch ops for the blocks past the pool's hits that the tiers hold, at most `room`;
        False when a tier has not answered yet."""
        if len(self.groups) > 1:
            return self._plan_group_prefetch(req_id, hashes, room)
        keys = self._keys(self.groups[0], hashes)
        hits = self.index.lookup_prefix(keys)
        head, rest = keys[:hits], keys[hits:]
        if not rest:
            return True
        # its pool hits pinned while slots are taken for the rest: never evicted for them
        pinned = bool(head) and self.index.prepare_load(head) is not None
        try:
            return self._plan_fetches_ahead(req_id, rest,
                                            min(room, self.index.num_reclaimable))
        finally:
            if pinned:
                self.index.complete_load(head)

    def _plan_group_prefetch(self, req_id: str, hashes: list[bytes], room: int) -> bool:
        """Several groups: the blocks a load of the prefix every group can serve now would
        fetch (`_group_hits`, `_group_load`: per group its needed positions, those the pool
        lacks, from the first tier holding each), at most `room`; False while a block it needs
        is being fetched ahead for another request (asked again next step)."""
        end = self._group_hits(0, hashes)
        if end is None:
            return False
        needed = [key for group in self.groups
                  for key in self._keys(group, [hashes[i] for i in self._needed(group, 0, end)])]
        needed = list(dict.fromkeys(needed))
        pooled = self.index.present(needed)
        head = [key for key, ok in zip(needed, pooled, strict=True) if ok]
        rest = [key for key, ok in zip(needed, pooled, strict=True)
                if not ok and not self._on_its_way(key)]  # on its way: not ours
        if not rest:
            return True
        # its pool blocks pinned while slots are taken for the rest: never evicted for them
        pinned = bool(head) and self.index.prepare_load(head) is not None
        try:
            room = min(room, self.index.num_reclaimable)
            below = self._below(rest)
            for i, tier in enumerate(self.tiers):
                mine = [key for key, where in zip(rest, below, strict=True) if where == i]
                taken = mine[:max(0, room)]
                if taken and not self._start_prefetch(req_id, tier, taken):
                    break
                room -= len(taken)
        finally:
            if pinned:
                self.index.complete_load(head)
        return True

    def _plan_fetches_ahead(self, req_id: str, rest: list[bytes], room: int) -> bool:
        held = self.index.present(rest)
        rest = rest[:held.index(True)] if True in held else rest
        rest = next((rest[:i] for i, k in enumerate(rest) if k in self._prefetching), rest)
        asking = _asking(req_id)  # a lookup of its own: the request's may run meanwhile
        for tier in self.tiers:
            if not rest or room <= 0:
                break
            found = tier.lookup(asking, rest)
            if found is None:
                return False
            taken = min(found, room)
            if taken and not self._start_prefetch(req_id, tier, rest[:taken]):
                break
            room, rest = room - taken, rest[taken:]
            if found > taken:
                break
        for tier in self.tiers:
            tier.forget(asking)
        return True

    def _start_prefetch(self, req_id: str, tier: TierPlanner, keys: list[bytes]) -> bool:
        plan = self.index.prepare_store(keys)
        writing = set(self._writes)
        self._write_evicted(plan)  # the blocks it evicted go below first, as for a store
        after = set(self._writes) - writing
        op_id = self._next_job_id
        op = None if plan.keys != keys else \
            tier.plan_fetch(op_id, keys, plan.slots, self.index.segment)
        if op is None:  # no room, a key on its way, or the tier lost one: give up
            self.index.complete_store(plan.keys, False)
            return False
        self._next_job_id += 1
        self._writes[op_id] = Write(tier.name, [], self.num_workers, self.index.epoch)
        prefetch = self._prefetches[op_id] = Prefetch(
            req_id, tier.name, list(keys), self._clock() + self.prefetch_rules.deadline_s, op,
            after)
        self._prefetching.update(dict.fromkeys(keys, op_id))
        events = getattr(self, "events", None)  # KV events on: describe them while we can
        if events is not None:
            events.planned(req_id, list(keys))
        if not after:
            self._step.writes.append(op)
            prefetch.queued = True
        return True

    def _sent_prefetches(self, step: StepJobs) -> None:
        """The step's prefetch ops go to the workers now: no longer cancellable."""
        for op in step.writes:
            prefetch = self._prefetches.get(op.op_id)
            if prefetch is not None:
                prefetch.sent = True

    def _not_wanted(self, req_id: str) -> None:
        """The request needs no prefetch now (scheduled, or gone)."""
        if self._prefetch_wanted.pop(req_id, None) is not None:
            for tier in self.tiers:
                tier.forget(_asking(req_id))

    def _cancel_prefetches(self, req_id: str) -> None:
        """The request is gone: drop its wanted prefetch, and those planned but not sent."""
        self._not_wanted(req_id)
        cancelled = {op_id for op_id, p in self._prefetches.items()
                     if p.req_id == req_id and not p.sent}
        if not cancelled:
            return
        self._step.writes = [op for op in self._step.writes if op.op_id not in cancelled]
        for op_id in cancelled:
            self._writes.pop(op_id)
            self._end_prefetch(op_id, ok=False, bad=[])

    def _finish_prefetch(self, op_id: int, bad: Sequence[bytes]) -> None:
        """Every worker has reported the prefetch: its good blocks are readable in the pool."""
        self._end_prefetch(op_id, ok=True, bad=bad)

    def _end_prefetch(self, op_id: int, *, ok: bool, bad: Sequence[bytes]) -> None:
        prefetch = self._prefetches.pop(op_id)
        for key in prefetch.keys:
            self._prefetching.pop(key, None)
        good = [ok and key not in bad for key in prefetch.keys]
        self.index.complete_store(prefetch.keys, good)
        events = getattr(self, "events", None)  # KV events on: the pool can load them now
        if events is not None:
            kept = [key for key, ok in zip(prefetch.keys, good, strict=True) if ok]
            events.stored(POOL, kept)
            events.removed(prefetch.tier, bad)  # failed their checksum: gone from the tier
            events.settled([key for key in prefetch.keys if key not in kept])
        self._by_name[prefetch.tier].complete_fetch(op_id, prefetch.keys, list(bad))
        self._counters.prefetched_blocks += sum(good)

    def _prefetch_flying(self, keys: Sequence[bytes]) -> dict[bytes, bool]:
        """Those of `keys` being fetched ahead: whether a lookup still waits for each (before
        its prefetch's deadline)."""
        if not self._prefetching:
            return {}
        now = self._clock()
        return {key: now < self._prefetches[op_id].deadline for key in keys
                if (op_id := self._prefetching.get(key)) is not None}

    def _prefetch_wait(self, keys: Sequence[bytes]) -> tuple[bool, int]:
        """A lookup's keys past the pool's hits: (whether to wait for a prefetch in flight
        among them, before its deadline; how many leading ones a tier may be asked about)."""
        for i, key in enumerate(keys):
            op_id = self._prefetching.get(key)
            if op_id is not None:
                return self._clock() < self._prefetches[op_id].deadline, i
        return False, len(keys)


def _asking(req_id: str) -> str:
    """The id a prefetch's tier lookups go by (not the request's: both may be in flight)."""
    return f"{req_id}\0prefetch"
