"""Checksums of blocks, torch-free (the store's process imports them): a block's xxh3-64 bound
to its key (`block_checksum`: what the remote store, the disk's footers and a checked pool keep),
and a checked pool's per-block lists of every rank's checksums (`block_sums`, `split_sums`)."""

from __future__ import annotations

from typing import Any

import xxhash


def block_checksum(block: Any, key: bytes) -> int:
    """xxh3-64 of a block's bytes (any buffer), seeded by its key so bytes and key are bound."""
    return xxhash.xxh3_64_intdigest(block, seed=xxhash.xxh3_64_intdigest(key))


def block_sums(by_rank: list[list[int]], blocks: int) -> list[list[int]]:
    """A commit's checksums, per block, from each rank's list: the xxh3-64 of every rank's part
    (its first `blocks` entries), then every rank's row sum (transfer/copy/row_sums.py) where
    every rank took them (its next `blocks`). The daemon keeps the lists as they are."""
    host = [list(s) for s in zip(*(sums[:blocks] for sums in by_rank), strict=True)]
    if all(len(sums) == 2 * blocks for sums in by_rank):
        rows = zip(*(sums[blocks:] for sums in by_rank), strict=True)
        return [h + list(r) for h, r in zip(host, rows, strict=True)]
    return host


def split_sums(sums: list[int], ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A block's committed checksums (`block_sums`) of an engine of `ranks` ranks -> (per-rank
    xxh3-64s, per-rank row sums or ())."""
    return tuple(sums[:ranks]), tuple(sums[ranks:2 * ranks]) if len(sums) == 2 * ranks else ()
