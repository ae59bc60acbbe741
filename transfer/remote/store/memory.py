"""The store's memory: blocks by namespaced key up to a byte capacity, least recently used out.

A block keeps the zmq frame it arrived in (no copy on put) and is sent from it (no copy on get).
While zmq still reads a block for a reply it is pinned: eviction skips it and a delete only
detaches it from the index, its bytes counted against the capacity until the send completes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class StoredBlock:
    """One block's bytes (`payload` owns them, `view` reads them) and its checksum."""

    payload: Any
    view: memoryview
    checksum: int
    pins: int = 0
    detached: bool = False  # removed from the index while pinned

    @property
    def size(self) -> int:
        return self.view.nbytes


class BlockStore:
    """An LRU map key -> StoredBlock bounded by `capacity_bytes` of block payload."""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0  # indexed blocks plus detached blocks still being sent
        self.evictions = 0
        self.pinned_blocks = 0
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def insert(self, key: bytes, payload: Any, checksum: int) -> bool:
        """Store a block, evicting unpinned least recently used ones; False if it cannot fit.

        A key already present keeps its block (same key, same bytes) and becomes most recent.
        """
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return True
        view = memoryview(payload).cast("B")
        if not self._make_room(view.nbytes):
            return False
        self._blocks[key] = StoredBlock(payload, view, checksum)
        self.used_bytes += view.nbytes
        return True

    def get(self, key: bytes) -> StoredBlock | None:
        """The block for `key` (now most recently used), or None."""
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are stored; those become most recently used."""
        for count, key in enumerate(keys):
            if self.get(key) is None:
                return count
        return len(keys)

    def delete(self, key: bytes) -> bool:
        block = self._blocks.pop(key, None)
        if block is None:
            return False
        if block.pins:
            block.detached = True
        else:
            self.used_bytes -= block.size
        return True

    def pin(self, block: StoredBlock) -> None:
        if block.pins == 0:
            self.pinned_blocks += 1
        block.pins += 1

    def unpin(self, block: StoredBlock) -> None:
        block.pins -= 1
        if block.pins == 0:
            self.pinned_blocks -= 1
            if block.detached:
                self.used_bytes -= block.size

    def _make_room(self, nbytes: int) -> bool:
        need = self.used_bytes + nbytes - self.capacity_bytes
        if need <= 0:
            return True
        victims: list[bytes] = []
        for key, block in self._blocks.items():  # oldest first
            if block.pins == 0:
                victims.append(key)
                need -= block.size
                if need <= 0:
                    break
        if need > 0:
            return False
        for key in victims:
            self.used_bytes -= self._blocks.pop(key).size
        self.evictions += len(victims)
        return True
