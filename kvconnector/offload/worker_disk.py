"""A worker's side of the disk tier (kvconnector/offload/disk_tier.py): its DiskIO over this
worker's part of the pool's slots, the spills in flight and the disk reads of loads.

The worker (worker.py) starts spills and reads here and asks `behind` whether a store or a load's
read must wait for a spill that still reads its slots out; `collect` moves finished spills into
the worker's report (with the keys that failed) and keeps finished reads for the loads that wait
for them. Below a shared pool each rank writes and reads its own part of every slot, under the
block's key, with its own checksum: a spill that carries the per-rank checksums the block was
committed with (`DiskWrite.sums`) writes this rank's, unhashed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.offload.jobs import DiskWrite, JobReport, TransferJob
from transfer.disk.io import DiskIO, DiskResult


class WorkerDisk:
    """The disk tier of the worker of rank `rank` (see module doc)."""

    def __init__(self, io: DiskIO, rank: int = 0) -> None:
        self.io = io
        self.rank = rank
        self.spilling: dict[int, tuple[tuple[bytes, ...], frozenset[int]]] = {}  # keys, slots
        self._reads: dict[int, DiskResult | None] = {}  # load job -> its reads' result

    def rebind(self, rows: torch.Tensor, room: int | None = None) -> None:
        """Move blocks from and to `rows` (this worker's part of every slot, `room` bytes of
        each its own) from now on."""
        self.io.rebind(rows, room)

    def spill(self, write: DiskWrite) -> None:
        """Write the spill's blocks out of their pool slots (reported by `collect`)."""
        # A refused write (False) still reaches get_finished, as failed: register it first.
        self.spilling[write.job_id] = (write.keys, frozenset(write.slots))
        sums = [block[self.rank] for block in write.sums] if write.sums else None
        self.io.submit_write(write.job_id, write.keys, write.slots, write.disk_slots, sums)

    @staticmethod
    def fail_spill(write: DiskWrite, report: JobReport) -> None:
        """A spill that cannot run (its shared segment is gone): every block failed."""
        report.spilled[write.job_id] = 1
        report.disk_bad[write.job_id] = list(write.keys)

    def behind(self, slots: Sequence[int]) -> bool:
        """Whether a spill in flight still reads one of `slots`."""
        return any(not taken.isdisjoint(slots) for _, taken in self.spilling.values())

    def read(self, job: TransferJob, slots: Sequence[int]) -> None:
        """Read the load's disk blocks into `slots` (the first of its fetch slots)."""
        self.io.submit_read(job.job_id, job.disk_keys, job.disk_slots, slots)
        self._reads[job.job_id] = None

    def reading(self, job_id: int) -> bool:
        """Whether the load's reads are still in flight."""
        return job_id in self._reads and self._reads[job_id] is None

    def take_read(self, job_id: int) -> DiskResult | None:
        """The load's reads' result, once (None: it read nothing)."""
        return self._reads.pop(job_id, None)

    def collect(self, report: JobReport) -> None:
        """Finished spills -> `report` (with their failed keys); finished reads are kept."""
        for result in self.io.get_finished():
            if result.job_id not in self.spilling:
                self._reads[result.job_id] = result
                continue
            keys, _ = self.spilling.pop(result.job_id)
            report.spilled[result.job_id] = 1
            bad = [key for key, ok in zip(keys, result.ok, strict=True) if not ok]
            if bad:
                report.disk_bad[result.job_id] = bad

    def wait(self, spills_only: bool = False) -> None:
        """Block until the spills in flight (`spills_only`), or every disk job, are done."""
        self.io.wait(list(self.spilling) if spills_only else None)

    def erase(self) -> None:
        """Forget every block on disk (reset_cache), after the writes in flight."""
        self.wait()
        self.io.slab.erase()

    def count(self, report: JobReport) -> None:
        """Bytes and busy seconds since the last call, into `report`."""
        counters = self.io.take_counters()
        report.disk_read_bytes, report.disk_read_seconds = (counters.read_bytes,
                                                            counters.read_seconds)
        report.disk_write_bytes, report.disk_write_seconds = (counters.write_bytes,
                                                              counters.write_seconds)

    def close(self) -> None:
        self.io.close()
