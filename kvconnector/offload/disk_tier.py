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

Keys: every rank writes its own slab file (named by rank r's namespace, which its header names
too) and its part of a block under the block's key in the pool (the scheduler's), so the footer's
checksum (block_checksum, seeded by the key) is the one a shared pool commits for that rank's
part: a block written through from a shared pool carries it (`DiskWrite.sums`).

Below a shared pool (transfer/shared/) the tier stays per engine and per rank: each engine
writes the blocks it stored itself (write-through: all of them; "evict": those its own stores
evict, since a block another engine's store evicts leaves the pool unseen), keeps its own index
and slabs, and reads its hits into slots it reserves in the shared pool, which then commits them
with their checksums for every engine on the host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvconnector.offload.jobs import DiskWrite, JobReport
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
    epoch: int  # the pool index's connection the pins belong to
    bad: set[bytes] = field(default_factory=set)


@dataclass
class DiskCounters:
    """OffloadCounters' disk_* fields (the names without the prefix)."""

    read_bytes: int = 0
    read_seconds: float = 0.0  # time with reads in flight (GB/s = bytes / seconds)
    write_bytes: int = 0
    write_seconds: float = 0.0
    failed_reads: int = 0  # blocks: EIO, bad checksum (recomputed)
    failed_writes: int = 0  # blocks: disk full, EIO, writes past the bound
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
        self._bad: dict[int, list[bytes]] = {}  # load job -> keys its reads failed
        self.counters = DiskCounters()

    def leading_hits(self, keys: Sequence[bytes], room: int) -> tuple[int, bool]:
        """(leading `keys` on disk, at most `room`; whether `room` cut the run short)."""
        run = next((i for i, key in enumerate(keys) if not self.index.contains(key)), len(keys))
        return min(run, room), run > room

    def spill(self, job_id: int, keys: Sequence[bytes], slots: Sequence[int], pinned: bool,
              segment: str = "", epoch: int = 0,
              sums: Sequence[Sequence[int]] | None = None) -> DiskWrite | None:
        """A write of the pool `slots` (of shared `segment`) holding `keys` to disk slots, for
        the keys not on disk yet (None when none is, or no disk slot is free). `pinned`: the
        keys are pinned in the pool (on connection `epoch`); `apply` returns those written, to
        unpin, when the write ends. `sums`: each key's per-rank checksums, where known."""
        slot_of = dict(zip(keys, slots, strict=True))
        sum_of = {} if sums is None else dict(zip(keys, sums, strict=True))
        plan = self.index.prepare_store(list(keys))
        self.counters.evictions += len(plan.evicted)
        if not plan.keys:
            return None
        self._spills[job_id] = _Spill(list(plan.keys), list(plan.keys) if pinned else [],
                                      self.num_workers, epoch)
        return DiskWrite(job_id, tuple(plan.keys), tuple(slot_of[k] for k in plan.keys),
                         tuple(plan.slots), segment,
                         tuple(tuple(sum_of[k]) for k in plan.keys) if sum_of else ())

    def apply(self, report: JobReport, epoch: int = 0) -> list[bytes]:
        """The disk part of the workers' report: bytes, finished writes (their good keys become
        readable; failed ones never enter), failed reads (kept for `finish_load`). Returns the
        pool keys whose writes are done, to unpin (those pinned on connection `epoch`: pins of
        an older one went with it)."""
        for name in ("read_bytes", "read_seconds", "write_bytes", "write_seconds"):
            setattr(self.counters, name, getattr(self.counters, name)
                    + getattr(report, f"disk_{name}"))
        for job_id, keys in report.disk_bad.items():
            if job_id not in self._spills:
                self._bad.setdefault(job_id, []).extend(keys)
        unpin: list[bytes] = []
        for job_id, count in report.spilled.items():
            spill = self._spills.get(job_id)
            if spill is None or not 0 < count <= spill.pending:
                raise ValueError(f"spill report of {count} worker(s) for job {job_id!r}, which "
                                 f"{'waits for ' + str(spill.pending) if spill else 'is unknown'}")
            spill.pending -= count
            spill.bad.update(report.disk_bad.get(job_id, ()))
            if spill.pending == 0:
                del self._spills[job_id]
                flags = [key not in spill.bad for key in spill.keys]
                self.counters.failed_writes += flags.count(False)
                self.index.complete_store(spill.keys, flags)
                if spill.epoch == epoch:
                    unpin += spill.pinned
        return unpin

    def finish_load(self, job_id: int, keys: Sequence[bytes]) -> None:
        """A load that read `keys` ended: they are unpinned; those a read failed leave the index
        (recomputed, then written again)."""
        self.index.complete_load(list(keys))
        bad = self._bad.pop(job_id, [])
        self.counters.failed_reads += len(bad)
        self.index.remove([k for k in bad if self.index.contains(k)])

    @property
    def spills_in_flight(self) -> int:
        return len(self._spills)

    def take_counters(self) -> DiskCounters:
        counters, self.counters = self.counters, DiskCounters()
        return counters


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
