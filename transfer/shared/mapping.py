"""An engine worker's view of the shared pool: its part of every slot, mapped and registered.

A slot holds one block of every rank of an engine: rank r's bytes at r x (the engine's per-rank
slot bytes). A worker maps the daemon's segment (named in each job: a restarted daemon makes a
new one), registers it with CUDA where there is a GPU (HostPool.attach: cudaHostRegister in
block-aligned chunks, as for a private pool) and copies by DMA between its cache and its part.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.pool import HostPool
from transfer.shared.protocol import check_name, segment_prefix


@dataclass(frozen=True)
class SharedPart:
    """This worker's bytes [offset, offset + the block's bytes) of every slot of pool `name`;
    `rank`: its place in each block's per-rank checksums; `room`: the bytes from `offset` that
    are this worker's (its region of a slot, the block rounded up; 0: the block's only), which
    a disk read of whole pages may fill."""

    name: str
    offset: int
    rank: int = 0
    room: int = 0

    def __post_init__(self) -> None:
        check_name(self.name)
        for field in ("offset", "rank", "room"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be a non-negative int, got {value!r}")

    def map(self, segment: str, pinned: bool | None) -> HostPool:
        """Map `segment`, which must be one of this pool's (ValueError otherwise or if gone)."""
        if not segment.startswith(segment_prefix(self.name)):
            raise ValueError(f"segment {segment!r} is not one of pool {self.name!r}'s")
        return HostPool.attach(segment, pinned=pinned)
