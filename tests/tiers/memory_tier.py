"""A trivial tier for the tests: blocks in a Python dict, the example of a tier added from outside
the library (its TierSpec is registered by the tests, with no edit to the library).

`MemoryBlocks` is the whole tier's state: each block's bytes and checksum under the worker's own
key, and the index the planner answers from (readable keys in LRU order, keys being written,
fetch pins), at most `memory_blocks` blocks. The planner and the worker share that one object,
which only works where both live in one process (the tests); a real tier keeps its index on the
scheduler side and its bytes where every worker reaches them (a slab file, a server). The object
goes with its planner: a new planner (an engine restart) starts from an empty one, so nothing
survives a restart.

A write copies the rows out at submit and a fetch verifies each block's checksum (the one every
tier uses, transfer.checksums.block_checksum) before it writes the row, so a block whose
bytes changed (`MemoryBlocks.corrupt`) fails its fetch and never reaches a slot.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer.checksums import block_checksum
from transfer.keys import DIGEST_BYTES
from transfer.options import Option, check_choice
from transfer.tier import (
    OpResult,
    PlannerContext,
    TierOp,
    TierPlanner,
    TierSpec,
    TierWorker,
    WorkerContext,
)

NAME = "memory"
WRITE_POLICIES = ("through", "evict")  # every stored block, or those the pool evicts


def _check_blocks(key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value <= 0):
        raise ValueError(f"{key} must be a positive number of blocks, got {value!r}")


class MemoryBlocks:
    """The memory tier's blocks and index, shared by its planner and its worker (module doc).

    `digests`: the namespace digest of every rank (each rank keeps its own bytes under its own
    key; an engine key is held when every rank's block is)."""

    def __init__(self, capacity: int, digests: Sequence[bytes]) -> None:
        self.capacity = capacity
        self.digests = tuple(digests)
        self.lock = threading.Lock()  # the worker's thread and the scheduler's share it
        self.data: dict[bytes, tuple[bytes, int]] = {}  # rank key -> bytes, checksum
        self.readable: OrderedDict[bytes, None] = OrderedDict()  # engine keys, oldest first
        self.writing: set[bytes] = set()  # engine keys being written
        self.pins: Counter[bytes] = Counter()  # engine key -> fetches in flight

    def rank_keys(self, key: bytes) -> list[bytes]:
        return [digest + key[DIGEST_BYTES:] for digest in self.digests]

    def drop(self, key: bytes) -> None:
        """Forget `key` everywhere (its bytes of every rank and its index entry)."""
        self.readable.pop(key, None)
        for rank_key in self.rank_keys(key):
            self.data.pop(rank_key, None)

    def clear(self) -> None:
        """Forget every block (as a restart would)."""
        with self.lock:
            self.data.clear()
            self.readable.clear()
            self.writing.clear()
            self.pins.clear()

    def corrupt(self, key: bytes) -> None:
        """Flip one byte of every rank's copy of `key`, its checksum kept: what a bit flip in
        the tier's memory would do (the tests' corrupt hook)."""
        with self.lock:
            for rank_key in self.rank_keys(key):
                block, checksum = self.data[rank_key]
                flipped = bytearray(block)
                flipped[len(flipped) // 2] ^= 0x01
                self.data[rank_key] = (bytes(flipped), checksum)


@dataclass(frozen=True)
class MemorySettings:
    """memory_blocks: blocks the tier keeps (the oldest unpinned go first); memory_write_policy:
    "through" (every block stored in the pool) or "evict" (those the pool evicts). `room` holds
    the MemoryBlocks of the planner made last, for the worker to share."""

    blocks: int
    write_policy: str
    room: list[MemoryBlocks] = field(default_factory=list, compare=False, repr=False)

    @property
    def writes_stored(self) -> bool:
        return self.write_policy == "through"


def memory_settings(values: Mapping[str, Any]) -> MemorySettings:
    if values["memory_blocks"] is None:
        raise ValueError("the memory tier needs memory_blocks")
    return MemorySettings(values["memory_blocks"], values["memory_write_policy"])


class MemoryPlanner(TierPlanner):
    """The scheduler side: answers from the shared index, pins fetches, places writes (evicting
    the oldest unpinned blocks past the capacity)."""

    name = NAME
    answers_per_key = True

    def __init__(self, blocks: MemoryBlocks, write_policy: str) -> None:
        self.blocks = blocks
        self.writes_stored = write_policy == "through"
        self._writes: dict[int, list[bytes]] = {}  # write in flight -> its keys
        self._counts = {"evictions": 0, "failed_reads": 0, "failed_writes": 0}

    def lookup(self, req_id: str, keys: Sequence[bytes]) -> int:
        held = self.present(keys)
        return next((i for i, ok in enumerate(held) if not ok), len(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        with self.blocks.lock:
            return [key in self.blocks.readable for key in keys]

    def plan_fetch(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int],
                   segment: str = "") -> TierOp | None:
        blocks = self.blocks
        with blocks.lock:
            if not all(key in blocks.readable for key in keys):
                return None  # gone since the lookup
            for key in keys:
                blocks.pins[key] += 1
                blocks.readable.move_to_end(key)  # a hit is the newest use
        return TierOp(self.name, op_id, False, tuple(keys), tuple(slots), segment=segment)

    def complete_fetch(self, op_id: int, keys: Sequence[bytes], bad: Sequence[bytes]) -> None:
        blocks = self.blocks
        with blocks.lock:
            for key in keys:
                blocks.pins[key] -= 1
                if blocks.pins[key] <= 0:
                    del blocks.pins[key]
            for key in bad:
                blocks.drop(key)
        self._counts["failed_reads"] += len(bad)

    def plan_write(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int], *,
                   evicted: bool, segment: str = "",
                   sums: Sequence[Sequence[int]] | None = None) -> TierOp | None:
        blocks, taken = self.blocks, []
        with blocks.lock:
            for key, slot in zip(keys, slots, strict=True):
                if key in blocks.readable or key in blocks.writing:
                    continue
                if len(blocks.readable) + len(blocks.writing) >= blocks.capacity:
                    victim = next((k for k in blocks.readable if k not in blocks.pins), None)
                    if victim is None:
                        break  # every block pinned or on its way: no room for more
                    blocks.drop(victim)
                    self._counts["evictions"] += 1
                blocks.writing.add(key)
                taken.append((key, slot))
        if not taken:
            return None
        self._writes[op_id] = [key for key, _ in taken]
        return TierOp(self.name, op_id, True, tuple(k for k, _ in taken),
                      tuple(s for _, s in taken), segment=segment)

    def complete_write(self, op_id: int, bad: Sequence[bytes]) -> None:
        blocks = self.blocks
        with blocks.lock:
            for key in self._writes.pop(op_id):
                blocks.writing.discard(key)
                if key in bad:
                    blocks.drop(key)
                else:
                    blocks.readable[key] = None
        self._counts["failed_writes"] += len(bad)

    def reset(self) -> bool:
        self.blocks.clear()
        return False  # the workers hold nothing of their own

    def take_counters(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts


class MemoryWorker(TierWorker):
    """The worker side: copies rows into and out of the shared dict, at submit (so every op is
    done when submit returns; get_finished reports it)."""

    name = NAME

    def __init__(self, blocks: MemoryBlocks, digest: bytes) -> None:
        self.blocks = blocks
        self.digest = digest  # this rank's keys
        self._rows: torch.Tensor | None = None
        self._finished: list[OpResult] = []
        self._counts = {"read_bytes": 0, "write_bytes": 0}

    def bind(self, rows: torch.Tensor, room: int | None) -> None:
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.device.type != "cpu":
            raise ValueError(f"rows must be 2-D uint8 host rows, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
        self._rows = rows

    def release(self) -> None:
        self._rows = None

    def submit(self, op: TierOp) -> None:
        rows = self._rows
        if rows is None:
            raise RuntimeError(f"memory op {op.op_id} before the pool's rows are bound")
        if not all(0 <= slot < rows.shape[0] for slot in op.slots):
            raise ValueError(f"memory op {op.op_id}: a slot of {op.slots} is outside the pool's "
                             f"{rows.shape[0]}")
        keys = [self.digest + key[DIGEST_BYTES:] for key in op.keys]
        ok: list[bool] = []
        sums: list[int | None] = []
        with self.blocks.lock:
            for key, slot in zip(keys, op.slots, strict=True):
                if op.is_write:
                    block = rows[slot].numpy().tobytes()
                    self.blocks.data[key] = (block, block_checksum(block, key))
                    self._counts["write_bytes"] += len(block)
                    ok.append(True)
                    continue
                stored = self.blocks.data.get(key)
                if stored is None or block_checksum(stored[0], key) != stored[1]:
                    ok.append(False)  # missing or changed: the slot is left alone
                    sums.append(None)
                    continue
                rows[slot].copy_(torch.frombuffer(bytearray(stored[0]), dtype=torch.uint8))
                self._counts["read_bytes"] += len(stored[0])
                ok.append(True)
                sums.append(stored[1])
        self._finished.append(OpResult(self.name, op.op_id, tuple(ok), tuple(sums)))

    def get_finished(self) -> list[OpResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, op_ids: Sequence[int] | None = None) -> None:
        return  # every op finished in submit

    def take_counters(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts

    def close(self) -> None:
        self._rows = None


def memory_planner(settings: MemorySettings, context: PlannerContext) -> MemoryPlanner:
    """A planner over a fresh MemoryBlocks, which the workers made after it share."""
    digests = [ns.digest for ns in context.rank_namespaces] or [context.namespace.digest]
    blocks = MemoryBlocks(settings.blocks, digests)
    settings.room[:] = [blocks]
    return MemoryPlanner(blocks, settings.write_policy)


def memory_worker(settings: MemorySettings, context: WorkerContext) -> MemoryWorker:
    if not settings.room:
        raise RuntimeError("the memory tier's worker shares its planner's blocks: make the "
                           "planner first, in the same process")
    return MemoryWorker(settings.room[0], context.own_namespace.digest)


MEMORY_TIER = TierSpec(
    name=NAME,
    options={"memory_blocks": Option(None, _check_blocks),
             "memory_write_policy": Option("through", lambda key, value: check_choice(
                 key, value, WRITE_POLICIES))},
    enabled_by="memory_blocks",
    settings=memory_settings,
    make_planner=memory_planner,
    make_worker=memory_worker,
    counters=("hit_tokens", "evictions", "failed_reads", "failed_writes", "read_bytes",
              "write_bytes"),
    order=50,
    per_key_lookups=True,
    stored_writes=("memory_write_policy", "through"),
)
