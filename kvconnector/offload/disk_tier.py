"""The disk tier (transfer.disk) as the connector's tier below the host pool. No vLLM imports.

Scheduler side, `DiskPlanner`: a second block index over the disk slots (the same keys as the
pool's), which blocks go to disk and when:
- policy "evict" (write-back): a block the pool evicts is written out of its old slot before the
  store that reuses the slot copies into it (the worker orders the two);
- policy "through": every block stored in the pool is also written to disk once its copy is done;
  its pool slot stays pinned until the write ends.
A block on disk is a hit after the pool's: its load reads it into a pool slot reserved like a
store (it stays in the pool after), then copies it to the GPU as usual. After a restart,
`restored_blocks` rebuilds the index from the slabs' footers.

Worker side: the worker (kvconnector/offload/worker.py) runs DiskWrite jobs and the disk reads of
loads on a transfer.disk.io.DiskIO over its pool, and reports per-block failures (`disk_bad`): a
block that failed a read (EIO, bad checksum) leaves the index; a failed write never enters it.

Keys: as for the remote tier, rank r's slab holds its blocks under rank r's namespace (its own
file), the scheduler's index under TP rank 0's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvconnector.offload.jobs import DiskWrite
from transfer.block_index import BlockIndex
from transfer.disk.slab import scan, slot_bytes
from transfer.keys import DIGEST_BYTES, Namespace

WRITE_POLICIES = ("evict", "through")


@dataclass(frozen=True)
class DiskSettings:
    """The disk part of `kv_connector_extra_config` (see ConnectorOptions)."""

    path: str
    num_bytes: int
    write_policy: str

    def num_slots(self, block_bytes: int) -> int:
        """Disk slots of `block_bytes` blocks (each rounded to 4 KiB, plus its footer)."""
        return self.num_bytes // slot_bytes(block_bytes)


@dataclass
class _Spill:
    keys: list[bytes]
    pinned: list[bytes]  # pool keys pinned until the write ends (write-through)
    pending: int
    bad: set[bytes] = field(default_factory=set)


@dataclass
class DiskCounters:
    hit_tokens: int = 0
    failed_reads: int = 0  # blocks
    failed_writes: int = 0  # blocks
    evictions: int = 0


class DiskPlanner:
    """The scheduler's view of every worker's disk tier (see module doc); `stored` restores the
    blocks a previous run left (key -> disk slot)."""

    def __init__(self, namespace: Namespace, num_slots: int, policy: str, write_policy: str,
                 num_workers: int, stored: Mapping[bytes, int] | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"disk_write_policy must be one of {WRITE_POLICIES}, got "
                             f"{write_policy!r}")
        self.index = BlockIndex(namespace, num_slots, policy)
        if stored:
            self.index.restore(stored)
        self.write_through = write_policy == "through"
        self.num_workers = num_workers
        self._spills: dict[int, _Spill] = {}
        self.counters = DiskCounters()

    def leading_hits(self, keys: Sequence[bytes], room: int) -> tuple[int, bool]:
        """(leading `keys` on disk, at most `room`; whether `room` cut the run short)."""
        run = next((i for i, key in enumerate(keys) if not self.index.contains(key)), len(keys))
        return min(run, room), run > room

    def spill(self, job_id: int, keys: Sequence[bytes], slots: Sequence[int],
              pinned: bool) -> DiskWrite | None:
        """A write of the pool `slots` holding `keys` to disk slots, for the keys not on disk yet
        (None when none is, or no disk slot is free). `pinned`: the keys are pinned in the
        pool; `report_spill` returns those written, to unpin, when the write ends."""
        slot_of = dict(zip(keys, slots, strict=True))
        plan = self.index.prepare_store(list(keys))
        self.counters.evictions += len(plan.evicted)
        if not plan.keys:
            return None
        self._spills[job_id] = _Spill(list(plan.keys), list(plan.keys) if pinned else [],
                                      self.num_workers)
        return DiskWrite(job_id, tuple(plan.keys), tuple(slot_of[k] for k in plan.keys),
                         tuple(plan.slots))

    def is_spill(self, job_id: int) -> bool:
        return job_id in self._spills

    def report_spill(self, job_id: int, count: int, bad: Sequence[bytes]) -> list[bytes] | None:
        """`count` workers finished the write `job_id`, failing `bad`; once all have, the good
        keys become readable and the pool keys to unpin are returned (else None)."""
        spill = self._spills.get(job_id)
        if spill is None or not 0 < count <= spill.pending:
            raise ValueError(f"spill report of {count} worker(s) for job {job_id!r}, which "
                             f"{'waits for ' + str(spill.pending) if spill else 'is unknown'}")
        spill.pending -= count
        spill.bad.update(bad)
        if spill.pending:
            return None
        del self._spills[job_id]
        flags = [key not in spill.bad for key in spill.keys]
        self.counters.failed_writes += flags.count(False)
        self.index.complete_store(spill.keys, flags)
        return spill.pinned

    def forget_bad(self, keys: Sequence[bytes]) -> None:
        """Blocks a disk read failed: they leave the index (recomputed and written again)."""
        self.counters.failed_reads += len(keys)
        self.index.remove([k for k in keys if self.index.contains(k)])

    @property
    def spills_in_flight(self) -> int:
        return len(self._spills)

    def take_counters(self) -> DiskCounters:
        counters, self.counters = self.counters, DiskCounters()
        return counters


def restored_blocks(path: str | os.PathLike[str], engine_digest: bytes,
                    rank_digests: Sequence[bytes], num_slots: int) -> dict[bytes, int]:
    """Engine key -> disk slot of every block each rank's slab holds in the same slot under its
    own key for the same hash (a block some rank lacks is no hit). The bytes are checked when
    read."""
    common: dict[int, bytes] | None = None
    for digest in rank_digests:
        found = {slot: key[DIGEST_BYTES:] for slot, key in scan(path, digest, num_slots).items()
                 if key[:DIGEST_BYTES] == digest}
        common = found if common is None else {
            slot: h for slot, h in common.items() if found.get(slot) == h}
    out: dict[bytes, int] = {}
    for slot, block_hash in sorted((common or {}).items()):
        out.setdefault(engine_digest + block_hash, slot)  # a stale duplicate stays free
    return out
