"""The disk tier's worker side: its DiskIO over this worker's part of the pool's slots.

Every rank writes its own slab file (named by its own namespace, which its header names too) and
its part of a block under the block's key in the pool, so the footer's checksum (block_checksum,
seeded by the key) is the one a shared pool commits for that rank's part: a write that carries
the per-rank checksums the block was committed with (`TierOp.sums`) writes this rank's, unhashed,
and a read hands back the checksums it verified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.disk.io import DiskIO
from transfer.tier import OpResult, TierOp, TierWorker


class DiskWorker(TierWorker):
    """The disk tier of the worker of rank `rank` (see module doc)."""

    name = "disk"

    def __init__(self, io: DiskIO, rank: int = 0) -> None:
        self.io = io
        self.rank = rank

    def bind(self, rows: torch.Tensor, room: int | None) -> None:
        self.io.rebind(rows, room)

    def submit(self, op: TierOp) -> None:
        if op.is_write:
            sums = [block[self.rank] for block in op.sums] if op.sums else None
            self.io.submit_write(op.op_id, op.keys, op.slots, op.places, sums)
        else:
            self.io.submit_read(op.op_id, op.keys, op.places, op.slots)

    def get_finished(self) -> list[OpResult]:
        return [OpResult(self.name, result.job_id, tuple(result.ok),
                         () if result.is_write else tuple(result.sums))
                for result in self.io.get_finished()]

    def wait(self, op_ids: Sequence[int] | None = None) -> None:
        self.io.wait(op_ids)

    def erase(self) -> None:
        self.io.wait()  # writes in flight must not outlive the erase
        self.io.slab.erase()

    def take_counters(self) -> dict[str, float]:
        counts = self.io.take_counters()
        return {"read_bytes": counts.read_bytes, "read_seconds": counts.read_seconds,
                "write_bytes": counts.write_bytes, "write_seconds": counts.write_seconds}

    def close(self) -> None:
        self.io.close()
