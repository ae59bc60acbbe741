"""Host block pool: worker side, one per TP rank.

Block-major whatever the GPU cache's order: slot s is one aligned chunk holding one block of every
layer, so a block-major GPU cache moves a block in one copy and a layer-major one in one copy per
layer, each landing in its place inside the slot. The pool knows only the slots' byte size (a
block's bytes: the GPU cache's layout gives them meaning); the allocator gives it that many
page-aligned slots, zeroed (touched in parallel), pinned with cudaHostRegister where CUDA is
present, and in named shared memory when several worker processes use one pool (each attaches
and registers it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.layout.allocator import SlotBuffer, allocate_slots, attach_slots
from transfer.copy.base import Segment


class HostPool:
    """Host slots of `block_bytes` each; `slots` is their (num_slots, block_bytes) row view."""

    def __init__(self, buffer: SlotBuffer) -> None:
        self.buffer = buffer
        self.slots = buffer.rows()

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, *, pinned: bool | None = None,
               shared_name: str | None = None) -> HostPool:
        """`num_slots` zeroed, page-aligned slots of `slot_bytes` each (a cache block's bytes).

        `pinned` defaults to whether CUDA is available; `shared_name` puts it in /dev/shm.
        """
        if pinned is None:
            pinned = torch.cuda.is_available()
        return cls(allocate_slots(num_slots, slot_bytes, pinned=pinned, shared_name=shared_name))

    @classmethod
    def attach(cls, shared_name: str, *, pinned: bool | None = None) -> HostPool:
        """The pool another process created under `shared_name`, registered here if `pinned`;
        its slot count and size come from the creator's header."""
        if pinned is None:
            pinned = torch.cuda.is_available()
        return cls(attach_slots(shared_name, pinned=pinned))

    @property
    def num_slots(self) -> int:
        return self.buffer.num_slots

    @property
    def block_bytes(self) -> int:
        return self.buffer.slot_bytes

    @property
    def pinned(self) -> bool:
        return self.buffer.pinned

    @property
    def shared_name(self) -> str | None:
        return self.buffer.shared_name

    def segments(self, gpu_chunks: Sequence[torch.Tensor], offset: int = 0,
                 width: int | None = None) -> list[Segment]:
        """Pair GPU row tensors with the pool: chunk i fills the bytes after chunk i-1 in a slot.

        The chunks fill bytes [offset, offset + width) of each slot (default: the whole slot); a
        shared pool's slot holds one block of every rank of an engine, each rank its own part.

        Block-major cache: one chunk, (num_gpu_blocks, block_bytes). Fallback: one chunk per layer,
        (num_gpu_blocks, page_bytes), in layer order. Raises ValueError unless the chunks are 2-D
        8-bit row tensors with dense rows, of one device and block count, whose row bytes add up
        to this pool's block bytes.
        """
        if not gpu_chunks:
            raise ValueError("no GPU chunks given")
        chunks = [_as_rows(c, f"GPU chunk {i}") for i, c in enumerate(gpu_chunks)]
        first = chunks[0]
        for i, c in enumerate(chunks):
            if c.shape[0] != first.shape[0] or c.device != first.device:
                raise ValueError(f"GPU chunk {i} has {c.shape[0]} rows on {c.device}; chunk 0 has "
                                 f"{first.shape[0]} on {first.device}")
        total = sum(int(c.shape[1]) for c in chunks)
        width = self.block_bytes - offset if width is None else width
        if offset < 0 or offset + width > self.block_bytes:
            raise ValueError(f"bytes [{offset}, {offset + width}) of a slot: this pool's slots "
                             f"hold {self.block_bytes} B")
        if total != width:
            raise ValueError(f"the GPU chunks hold {total} B per block but this pool's slots hold "
                             f"{width} B (of {self.block_bytes} B slots): a pool of the "
                             f"wrong block size")
        out = []
        for c in chunks:
            out.append(Segment(c, self.rows(offset, int(c.shape[1]))))
            offset += int(c.shape[1])
        return out

    def rows(self, offset: int = 0, width: int | None = None) -> torch.Tensor:
        """(num_slots, width) uint8 view of bytes [offset, offset + width) of every slot."""
        width = self.block_bytes - offset if width is None else width
        raw = self.buffer.raw
        return torch.as_strided(raw, (self.num_slots, width), (self.slots.stride(0), 1),
                                raw.storage_offset() + offset)

    def close(self, unlink: bool = False) -> None:
        """Unpin and unmap; `unlink` also removes the shared-memory name (the creator does it)."""
        self.buffer.close(unlink=unlink)


def _as_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() != 2 or t.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"{what} must be a 2-D uint8/int8 row tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.shape[1] == 0 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{what}: rows must be dense and non-empty, got shape {tuple(t.shape)} "
                         f"stride {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{what}: row stride {t.stride(0)} < row bytes {t.shape[1]}: rows overlap")
    return t.view(torch.uint8)
