"""The disk tier's scheduler side: a block index over the disk slots (the same keys as the
pool's), which blocks go to disk and when, and the blocks a previous run left.

Policy "evict" (write-back): a block the pool evicts is written out of its old slot before the
store that reuses the slot copies into it (the worker orders the two). Policy "through": every
block stored in the pool is also written to disk once its store is done; its pool slot stays
pinned until the write ends. A block on disk is a hit after the pool's: its load reads it into a
pool slot reserved like a store (it stays in the pool after), then copies it to the GPU as usual.
A block that failed a read (EIO, bad checksum) leaves the index; a failed write never enters it.

Below a shared pool the tier stays per engine and per rank: each engine writes the blocks it
stored itself (write-through: all of them; "evict": those its own stores evict, since a block
another engine's store evicts leaves the pool unseen), keeps its own index and slabs, and reads
its hits into slots it reserves in the shared pool, which then commits them with their
checksums for every engine on the host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from transfer.block_index import BlockIndex
from transfer.disk.slab import scan
from transfer.keys import DIGEST_BYTES, Namespace
from transfer.tier import TierOp, TierPlanner

WRITE_POLICIES = ("evict", "through")


class DiskPlanner(TierPlanner):
    """The scheduler's view of every worker's disk tier (see module doc); `stored` restores the
    blocks a previous run left (key -> disk slot)."""

    name = "disk"
    answers_per_key = True

    def __init__(self, namespace: Namespace, num_slots: int, policy: str, write_policy: str,
                 stored: Mapping[bytes, int] | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"disk_write_policy must be one of {WRITE_POLICIES}, got "
                             f"{write_policy!r}")
        self.index = BlockIndex(namespace, num_slots, policy)
        if stored:
            self.index.restore(stored)
        self.writes_stored = write_policy == "through"
        self._writes: dict[int, list[bytes]] = {}  # write in flight -> the keys it writes
        self._counts = {"failed_reads": 0, "failed_writes": 0, "evictions": 0}
        self._dropped: list[bytes] = []  # evicted since take_dropped, with track_drops

    def lookup(self, req_id: str, keys: Sequence[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if not self.index.contains(key)), len(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return self.index.present(keys)

    def plan_fetch(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int],
                   segment: str = "") -> TierOp | None:
        if not all(self.index.present(keys)):
            return None  # a write-back since the lookup evicted one
        plan = self.index.prepare_load(list(keys))
        return TierOp(self.name, op_id, False, tuple(keys), tuple(slots), tuple(plan.slots),
                      segment)

    def complete_fetch(self, op_id: int, keys: Sequence[bytes], bad: Sequence[bytes]) -> None:
        self.index.complete_load(list(keys))
        self._counts["failed_reads"] += len(bad)
        self.index.remove([k for k in bad if self.index.contains(k)])

    def plan_write(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int], *,
                   evicted: bool, segment: str = "",
                   sums: Sequence[Sequence[int]] | None = None) -> TierOp | None:
        slot_of = dict(zip(keys, slots, strict=True))
        sum_of = {} if sums is None else dict(zip(keys, sums, strict=True))
        plan = self.index.prepare_store(list(keys))  # the keys not on disk yet, if room
        self._counts["evictions"] += len(plan.evicted)
        if self.track_drops:
            self._dropped += plan.evicted
        if not plan.keys:
            return None
        self._writes[op_id] = list(plan.keys)
        return TierOp(self.name, op_id, True, tuple(plan.keys),
                      tuple(slot_of[k] for k in plan.keys), tuple(plan.slots), segment,
                      tuple(tuple(sum_of[k]) for k in plan.keys) if sum_of else ())

    def complete_write(self, op_id: int, bad: Sequence[bytes]) -> None:
        keys = self._writes.pop(op_id)
        flags = [key not in bad for key in keys]
        self._counts["failed_writes"] += flags.count(False)
        self.index.complete_store(keys, flags)

    def reset(self) -> bool:
        self.index.clear()
        return True  # and on the workers' slabs, or a restart would find them again

    def take_dropped(self) -> list[bytes]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def take_counters(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts


def restored_blocks(path: str | os.PathLike[str], engine_digest: bytes,
                    rank_digests: Sequence[bytes], num_slots: int) -> dict[bytes, int]:
    """Engine key -> disk slot of every block of the engine's namespace that each rank's slab
    (named by its digest) holds in the same slot (a block some rank lacks is no hit). The
    bytes are checked when read. DiskError (transfer.disk.slab) naming the slab when a
    directory or slab cannot be read."""
    common: dict[int, bytes] | None = None
    for digest in rank_digests:
        found = {slot: key for slot, key in scan(path, digest, num_slots).items()
                 if key[:DIGEST_BYTES] == engine_digest}
        common = found if common is None else {
            slot: key for slot, key in common.items() if found.get(slot) == key}
    out: dict[bytes, int] = {}
    for slot, key in sorted((common or {}).items()):
        out.setdefault(key, slot)  # a stale duplicate stays free
    return out
