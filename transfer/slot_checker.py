"""Checksums of a shared pool's slots, taken and checked by the engines on threads of their own.

Another process can write a shared slot after its commit (a stray write through the segment, a
bad page), so every block carries the xxh3-64 its writer took, bound to its key
(`block_checksum`), one per rank's part of the slot; a reader checks its part before it copies
it (`SlotChecker.verify`; kvconnector/offload/checked_loads.py). Writers hash their parts once
the store copy is done (`SlotChecker.hash`), so the daemon's loop never hashes. A GPU writer
commits by the row sums its copy took and hashes after the commit (`SlotChecker.hash_checked`):
each slot is copied aside a piece at a time, its row sum taken again there (by numpy on the
checker's thread: transfer/copy/row_sums.py host_piece_sum) and compared with the committed
one, and only a copy that matches is hashed, so an xxh3 is never taken of bytes other than
those committed (a slot written since, or reused after an eviction, gets none).

A reader checks a block by its xxh3 where it has one, else by the row sum it was committed
with (`verify`'s `row_sums`: on the host, a piece at a time, as above), so a worker whose copy
engine cannot check row sums on the way still loads a block no lease needed hashed.

Checks run on `threads` threads (xxhash releases the GIL for blocks over 64 KiB, so they hash
in parallel); a reader checks a load in chunks, copying one while the next ones are checked, so
the check adds little to a copy it keeps up with.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

from transfer.checksums import block_checksum, block_hasher
from transfer.copy.row_sums import check_row_bytes, coefficient_array, host_piece_sum

MAX_THREADS = 8
# A slot is checked and hashed after its commit this much at a time (transfer/copy/row_sums.py
# host_piece_sum), each piece hashed right after it is summed. Each piece costs a few GIL
# hand-overs among the checker's threads, and those, not the bytes, bound smaller pieces: 8
# threads hashed 640 KiB slots at 3.3-3.5 GB/s in 256 KiB pieces (which, with the sum's terms and
# coefficients, stay in a core's L2), 6.2-6.7 in whole slots (5 MiB with those: past L2); beside
# a GPU writer's 2 GiB store the xxh3s came about twice as soon, the store's rate unchanged
# (H200 machine, docs/benchmarks.md). Slots over 1 MiB were not measured against 256 KiB pieces.
HASH_PIECE_BYTES = 1 << 20
_MASK = (1 << 64) - 1
T = TypeVar("T")


def default_threads() -> int:
    """Half the cores, at most MAX_THREADS (the other half copy and compute)."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 2) // 2))


class SlotChecker:
    """Hashes and checks blocks in rows of a pool (one row per slot, each dense)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-slot-check")

    def hash(self, rows: torch.Tensor, slots: Sequence[int],
             keys: Sequence[bytes]) -> Future[list[int]]:
        """The checksum of each slot's row, bound to its key, in order."""
        parts = self._split(rows, slots, keys)
        futures = [self._pool.submit(_hash_part, *part) for part in parts]
        return _joined(futures)

    def hash_checked(self, rows: torch.Tensor, slots: Sequence[int], keys: Sequence[bytes],
                     sums: Sequence[int]) -> Future[list[int | None]]:
        """The checksum of each slot's row, bound to its key, in order, where the row's sum
        (row_sums) still equals `sums` (what it was committed with); None where it does not."""
        if len(sums) != len(keys):
            raise ValueError(f"{len(sums)} row sums for {len(keys)} keys")
        parts = self._split(rows, slots, keys)
        futures, at = [], 0
        for array, part_slots, part_keys in parts:
            part_sums = list(sums[at:at + len(part_slots)])
            at += len(part_slots)
            futures.append(self._pool.submit(_hash_checked_part, array, part_slots, part_keys,
                                             part_sums))
        return _joined(futures)

    def verify(self, rows: torch.Tensor, slots: Sequence[int], keys: Sequence[bytes],
               sums: Sequence[int | None],
               row_sums: Sequence[int | None] = ()) -> Future[int]:
        """How many leading slots hold what their checksum says: each slot's xxh3 against
        `sums`, or where that is None its row sum against `row_sums` (a block committed by row
        sums, not hashed); a slot with neither fails."""
        if len(sums) != len(keys) or len(row_sums) not in (0, len(keys)):
            raise ValueError(f"{len(sums)} checksums and {len(row_sums)} row sums for "
                             f"{len(keys)} keys")
        by_row_sums = list(row_sums) or [None] * len(keys)
        parts = self._split(rows, slots, keys)
        futures, at = [], 0
        for array, part_slots, part_keys in parts:
            end = at + len(part_slots)
            futures.append(self._pool.submit(_verify_part, array, part_slots, part_keys,
                                             list(sums[at:end]), by_row_sums[at:end]))
            at = end
        checked = _joined(futures)
        result: Future[int] = Future()

        def leading(done: Future[list[bool]]) -> None:
            try:
                good = done.result()
            except Exception as exc:
                result.set_exception(exc)
                return
            result.set_result(good.index(False) if False in good else len(good))

        checked.add_done_callback(leading)
        return result

    def _split(self, rows: torch.Tensor, slots: Sequence[int],
               keys: Sequence[bytes]) -> list[tuple[np.ndarray, list[int], list[bytes]]]:
        """Contiguous runs of the job, one per thread: a few submits per job, not one a block."""
        if len(slots) != len(keys):
            raise ValueError(f"{len(slots)} slots for {len(keys)} keys")
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.device.type != "cpu" or \
                (rows.shape[1] > 1 and rows.stride(1) != 1):
            raise ValueError(f"rows must be dense 2-D uint8 host rows, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
        array = rows.numpy()
        n = len(slots)
        step = -(-n // self.threads) if n else 1
        return [(array, list(slots[i:i + step]), list(keys[i:i + step]))
                for i in range(0, n, step)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _hash_part(array: np.ndarray, slots: list[int], keys: list[bytes]) -> list[int]:
    return [block_checksum(array[slot], key) for slot, key in zip(slots, keys, strict=True)]


class _SlotReader:
    """Reads slots of rows `width` bytes wide a piece at a time into a buffer of the calling
    thread's, summing each piece (transfer/copy/row_sums.py host_piece_sum) and handing it to a
    hasher: both checksums of the same bytes, whatever the slot does meanwhile. The piece is
    hashed right after it is summed, from the caches, not read from memory again: this runs
    beside the DMAs of the stores, which share the host's memory."""

    def __init__(self, width: int) -> None:
        check_row_bytes(width)
        self.width = width
        self.coef = coefficient_array(width // 4)
        self.piece = np.empty(min(width, max(4, HASH_PIECE_BYTES // 4 * 4)),
                              dtype=np.uint8)  # whole words
        self.terms = np.empty(len(self.piece) // 4, dtype=np.uint64)

    def row_sum(self, row: np.ndarray, hasher: xxhash.xxh3_64 | None = None) -> int:
        """The row's sum (and its bytes into `hasher`)."""
        total, piece = 0, self.piece
        for start in range(0, self.width, len(piece)):
            part = piece[:min(len(piece), self.width - start)]
            np.copyto(part, row[start:start + len(part)])
            total += host_piece_sum(part, self.coef[start // 4:], self.terms)
            if hasher is not None:
                hasher.update(part)
        return total & _MASK


def _hash_checked_part(array: np.ndarray, slots: list[int], keys: list[bytes],
                       sums: list[int]) -> list[int | None]:
    """Each slot's xxh3 where its row sum, of the same bytes (`_SlotReader`), is the committed
    one."""
    reader = _SlotReader(array.shape[1])
    out: list[int | None] = []
    for slot, key, expected in zip(slots, keys, sums, strict=True):
        hasher = block_hasher(key)
        out.append(hasher.intdigest() if reader.row_sum(array[slot], hasher) == expected
                   else None)
    return out


def _verify_part(array: np.ndarray, slots: list[int], keys: list[bytes],
                 sums: list[int | None], row_sums: list[int | None]) -> list[bool]:
    """Whether each slot holds what its xxh3 says, or, without one, its row sum."""
    reader: _SlotReader | None = None
    out = []
    for slot, key, xxh3, row_sum in zip(slots, keys, sums, row_sums, strict=True):
        if xxh3 is not None:
            out.append(block_checksum(array[slot], key) == xxh3)
        elif row_sum is not None:
            reader = reader or _SlotReader(array.shape[1])
            out.append(reader.row_sum(array[slot]) == row_sum)
        else:
            out.append(False)
    return out


def _joined(futures: Sequence[Future[list[T]]]) -> Future[list[T]]:
    """One future of the parts' lists joined in order (the first part's error, if any)."""
    result: Future[list[T]] = Future()

    def gather(_: Future[list[T]]) -> None:
        if all(f.done() for f in futures) and not result.done():
            try:
                result.set_result([s for f in futures for s in f.result()])
            except Exception as exc:
                result.set_exception(exc)

    for future in futures:
        future.add_done_callback(gather)
    if not futures:
        result.set_result([])
    return result
