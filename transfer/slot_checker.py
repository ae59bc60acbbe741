"""Checksums of a shared pool's slots, taken and checked by the engines on threads of their own.

Another process can write a shared slot after its commit (a stray write through the segment, a
bad page), so every block carries the xxh3-64 its writer took, bound to its key
(`block_checksum`), one per rank's part of the slot; a reader checks its part before it copies
it (`SlotChecker.verify`; kvconnector/offload/checked_loads.py). Writers hash their parts once
the store copy is done (`SlotChecker.hash`), so the daemon's loop never hashes.

Checks run on `threads` threads (xxhash releases the GIL for blocks over 64 KiB, so they hash
in parallel); a reader checks a load in chunks, copying one while the next ones are checked, so
the check adds little to a copy it keeps up with.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from transfer.checksums import block_checksum

MAX_THREADS = 8


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
        result: Future[list[int]] = Future()

        def gather(_: Future[list[int]]) -> None:
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

    def verify(self, rows: torch.Tensor, slots: Sequence[int], keys: Sequence[bytes],
               sums: Sequence[int | None]) -> Future[int]:
        """How many leading slots hold what their checksum says (a missing checksum fails)."""
        if len(sums) != len(keys):
            raise ValueError(f"{len(sums)} checksums for {len(keys)} keys")
        hashed = self.hash(rows, slots, keys)
        result: Future[int] = Future()

        def compare(done: Future[list[int]]) -> None:
            try:
                got = done.result()
            except Exception as exc:
                result.set_exception(exc)
                return
            bad = [i for i, (a, b) in enumerate(zip(got, sums, strict=True)) if a != b]
            result.set_result(bad[0] if bad else len(got))

        hashed.add_done_callback(compare)
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
