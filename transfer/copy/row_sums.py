"""Row sums: a checksum of block rows that a GPU takes at memory speed, where the rows are.

A shared pool's reader must check each block before it reaches its cache. xxh3 on host threads
does not keep up with a 55 GB/s DMA and starves the caller of the GIL (docs/benchmarks.md,
"Shared host pool"), so GPU engines also take this sum: the writer on its cache rows right after
the store copy, the reader on a GPU staging copy of the slot, before the block goes on into its
cache (transfer/copy/cuda_sums.py: kernels computing exactly what `row_sums` here does; CPU
lanes run this torch code, `checked_copy` included), with nothing on the host between the two.

The sum of a row is sum_k c_k * w_k mod 2^64 over its 32-bit words w_k (read as int64), with
fixed pseudo-random 64-bit coefficients c_k (splitmix64 of k): a multilinear hash. For random
coefficients, a given change of the row passes with probability at most 2^-33 (a 32-bit
difference times a uniform 64-bit coefficient is uniform over the multiples of the difference's
lowest set bit); the coefficients are fixed, so that holds for changes that do not depend on
them (a stray write, a bad page). Unlike 64-bit words times odd constants (where the top bit
flipped in any two words always cancels), no bit pattern cancels for every choice. It is not
keyed against an adversary: whoever can write the pool's slots can write its index too. The
same torch code runs on any device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SEED = 0x6B76636F6E6E6563  # b"kvconnec"
# Sums are taken in pieces of at most this many bytes of rows: the int64 words of a piece are
# a temporary twice its size.
PIECE_BYTES = 16 << 20


@functools.lru_cache(maxsize=8)
def coefficient_array(words: int) -> np.ndarray:
    """The `words` coefficients (int64): splitmix64 of SEED + k * golden gamma, k = 1..words."""
    x = np.uint64(SEED) + np.arange(1, words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    x.flags.writeable = False
    return x.view(np.int64)


@functools.lru_cache(maxsize=8)
def coefficients(words: int, device: str) -> torch.Tensor:
    """`coefficient_array(words)` on `device` (a host device here: GPU lanes keep their own,
    transfer/copy/cuda_sums.py)."""
    return torch.from_numpy(coefficient_array(words).copy()).to(device)


def check_row_bytes(nbytes: int) -> None:
    """Raise ValueError unless rows of `nbytes` can be summed (whole 32-bit words)."""
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"row sums need rows of whole 32-bit words, got rows of {nbytes} bytes")


def row_sums(rows: torch.Tensor, ids: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of each row of 2-D uint8 `rows` (of rows[ids] when given) as int64, on their
    device, queued on the current stream."""
    nbytes = int(rows.shape[1])
    check_row_bytes(nbytes)
    n = int(rows.shape[0] if ids is None else ids.shape[0])
    coef = coefficients(nbytes // 4, str(rows.device))
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=rows.device)
    step = max(1, PIECE_BYTES // nbytes)
    for start in range(0, n, step):
        piece = rows[start:start + step] if ids is None else \
            rows.index_select(0, ids[start:start + step])
        words = _words(piece).to(torch.int64).mul_(coef)
        torch.sum(words, dim=1, out=out[start:start + step])
    return out


def host_piece_sum(piece: np.ndarray, coef: np.ndarray, terms: np.ndarray) -> int:
    """The terms of a row's sum over one piece of it, added mod 2^64, by numpy on the calling
    thread: `piece` (uint8, whole words) is the row's bytes from some word k on, `coef` the
    row's coefficients from k on (`coefficient_array(...)[k:]`, at least as many as the piece's
    words), `terms` a uint64 scratch of at least as many. The pieces' sums of a row, added mod
    2^64, are its `row_sums` as an unsigned int. Host threads sum this way, not through torch:
    torch's CPU ops fork a thread team per calling thread (a checker's eight threads would start
    eight teams of every core), and a piece that stays in cache is read from memory once."""
    words = piece.view(np.int32)
    out = terms[:len(words)]
    np.copyto(out.view(np.int64), words)  # sign-extended, as `row_sums` reads a word
    np.multiply(out, coef[:len(words)].view(np.uint64), out=out)
    return int(np.add.reduce(out))


def checked_copy(stage: torch.Tensor, expect: torch.Tensor, dst: torch.Tensor,
                 ids: torch.Tensor, run: torch.Tensor, good: torch.Tensor) -> None:
    """Copy the leading rows of `stage` whose sums equal `expect` into dst[ids], on the current
    stream and without a host sync: a row goes on only while `run` (int64 [1], 1 until a row
    failed, carried from the chunks before) holds; `good` (int64 [1]) counts the rows copied.
    The other rows of dst[ids] keep their bytes (rewritten unchanged)."""
    keep = (row_sums(stage) == expect).to(torch.int64).cumprod_(0).mul_(run)
    current = dst.index_select(0, ids)
    torch.where(keep.bool()[:, None], stage, current, out=current)
    dst.index_copy_(0, ids, current)
    good.add_(keep.sum())
    run.copy_(keep[-1:])


def to_int64(values: np.ndarray | list[int]) -> np.ndarray:
    """Sums as unsigned 64-bit ints (what a commit carries) -> their int64 bit patterns."""
    return np.asarray(values, dtype=np.uint64).view(np.int64)


def to_unsigned(sums: np.ndarray) -> list[int]:
    """int64 sums -> unsigned 64-bit Python ints."""
    return np.asarray(sums, dtype=np.int64).view(np.uint64).tolist()


def _words(rows: torch.Tensor) -> torch.Tensor:
    """2-D uint8 rows as int32 words (a copy only where the rows cannot be viewed so)."""
    try:
        return rows.view(torch.int32)
    except RuntimeError:  # a row stride or offset that is not a whole word
        return rows.contiguous().view(torch.int32)
