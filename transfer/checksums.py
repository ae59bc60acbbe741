"""Checksums of blocks, torch-free (the store's process imports them): a block's xxh3-64 bound
to its key (`block_checksum`: what the remote store, the disk's footers and a checked pool keep),
and a checked pool's per-block lists of every rank's checksums (`block_sums`, `split_sums`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash


def block_checksum(block: Any, key: bytes) -> int:
    """xxh3-64 of a block's bytes (any buffer), seeded by its key so bytes and key are bound."""
    return xxhash.xxh3_64_intdigest(block, seed=xxhash.xxh3_64_intdigest(key))


def block_hasher(key: bytes) -> Any:
    """A streaming xxh3-64 of a block bound to `key`: `update` it with the block's bytes in
    order, and its `intdigest()` is `block_checksum(block, key)`."""
    return xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(key))


def block_sums(by_rank: list[list[int | None]], blocks: int) -> list[list[int | None]] | None:
    """A commit's checksums, per block, from each rank's list: the xxh3-64 of every rank's part
    (its first `blocks` entries; None where the rank commits by row sums only and hashes later),
    then every rank's row sum (transfer/copy/row_sums.py) where every rank took them (its next
    `blocks`). A block some rank has not hashed is committed by its row sums alone (its xxh3s
    all None: attached later, together); None when such a block lacks a rank's row sum (it
    could not be checked). The daemon keeps the lists as they are."""
    host = [list(s) for s in zip(*(sums[:blocks] for sums in by_rank), strict=True)]
    rows: list[list[int | None]] = [[] for _ in host]
    if all(len(sums) == 2 * blocks for sums in by_rank):
        rows = [list(r) for r in zip(*(sums[blocks:] for sums in by_rank), strict=True)]
    out = []
    for xxh3s, row in zip(host, rows, strict=True):
        if None in xxh3s:
            if not row or None in row:
                return None
            xxh3s = [None] * len(xxh3s)
        out.append(xxh3s + row)
    return out


def split_sums(sums: list[int | None], ranks: int
               ) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """A block's committed checksums (`block_sums`) of an engine of `ranks` ranks -> (per-rank
    xxh3-64s, None until hashed; per-rank row sums or ())."""
    rows = tuple(sums[ranks:2 * ranks]) if len(sums) == 2 * ranks else ()
    return tuple(sums[:ranks]), rows  # type: ignore[return-value]


def hashed(sums: list[int | None] | tuple[int | None, ...]) -> bool:
    """Whether a block's committed checksums include its xxh3s (not a commit by row sums only
    whose xxh3s are still to come)."""
    return bool(sums) and sums[0] is not None


def all_uint64(values: Sequence[object]) -> bool:
    """Whether every value is an exact int (not a bool) in [0, 2^64): what numpy must not be
    trusted to check (it takes 2.5, "7" or True as ints). In C, ~0.1 us a value."""
    return set(map(type, values)) <= {int} and \
        (not values or (min(values) >= 0 and max(values) < 1 << 64))  # type: ignore[type-var]
