"""Row sums (transfer/copy/row_sums.py) against an independent pure-Python reference: pinned
coefficients, gathered and strided rows, pieces, bit-flip sensitivity, checked copies."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from transfer.copy import row_sums as rs
from transfer.copy.row_sums import (
    check_row_bytes,
    checked_copy,
    coefficient_array,
    coefficients,
    host_piece_sum,
    row_sums,
    to_int64,
    to_unsigned,
)

MASK = (1 << 64) - 1
POISON = 0xC3
# The on-the-wire scheme: a store's sums are checked by a reader of another process, version
# or device, so these values must never change silently.
PINNED = [2026681046572178713, -4098901529234836063, -5263529712709962391]


def splitmix64(seed: int, n: int) -> list[int]:
    """The first n outputs of splitmix64 from `seed`, as unsigned Python ints."""
    out, state = [], seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def reference_sum(row: bytes) -> int:
    """sum_k c_k * w_k mod 2^64 over the row's little-endian int32 words, as an unsigned int."""
    words = struct.unpack(f"<{len(row) // 4}i", row)
    coef = splitmix64(0x6B76636F6E6E6563, len(words))
    return sum(c * w for c, w in zip(coef, words, strict=True)) & MASK


def reference(rows: torch.Tensor) -> list[int]:
    return [reference_sum(bytes(r.tolist())) for r in rows]


def random_rows(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def sums(rows: torch.Tensor, ids: torch.Tensor | None = None) -> list[int]:
    return to_unsigned(row_sums(rows, ids).numpy())


# -- coefficients --------------------------------------------------------------------------

def test_coefficients_are_pinned_and_splitmix64() -> None:
    coefficient_array.cache_clear()  # computed afresh, not a cached array
    coefficients.cache_clear()
    coef = coefficients(8, "cpu")
    assert coef.dtype == torch.int64 and coef.shape == (8,)
    assert coef[:3].tolist() == PINNED
    assert to_unsigned(coef.numpy()) == splitmix64(rs.SEED, 8)
    assert [c & MASK for c in PINNED] == splitmix64(0x6B76636F6E6E6563, 3)


def test_longer_coefficients_start_with_the_shorter() -> None:
    short, long = coefficients(5, "cpu"), coefficients(300, "cpu")
    assert torch.equal(long[:5], short)
    assert long[:3].tolist() == PINNED
    assert len(set(long.tolist())) == 300


# -- sums against the reference ------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [4, 12, 256, 1028])
@pytest.mark.parametrize("seed", [0, 1])
def test_sums_match_the_reference(nbytes: int, seed: int) -> None:
    rows = random_rows(5, nbytes, seed)
    out = row_sums(rows)
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert to_unsigned(out.numpy()) == reference(rows)


def test_extreme_words_match_the_reference() -> None:
    rows = torch.tensor([[0x00] * 16, [0xFF] * 16, [0x00, 0x00, 0x00, 0x80] * 4,
                         [0xFF, 0xFF, 0xFF, 0x7F] * 4], dtype=torch.uint8)
    got = sums(rows)
    assert got == reference(rows)
    assert got[0] == 0  # all-zero words
    # Every word -1: minus the sum of the coefficients.
    assert got[1] == -sum(splitmix64(rs.SEED, 4)) & MASK


def test_gathered_rows_match_the_reference() -> None:
    rows = random_rows(20, 64, 3)
    ids = torch.tensor([17, 0, 5, 5, 19, 2])
    assert sums(rows, ids) == reference(rows[ids])
    out = torch.full((6,), -1, dtype=torch.int64)
    assert row_sums(rows, ids, out=out) is out
    assert to_unsigned(out.numpy()) == reference(rows[ids])


@pytest.mark.parametrize("stride, offset", [(96, 0), (96, 8), (66, 0), (96, 2)],
                         ids=["word-stride", "word-offset", "odd-stride", "odd-offset"])
def test_strided_rows_match_the_reference(stride: int, offset: int) -> None:
    base = random_rows(1, 7 * stride + 64, 4).view(-1)
    rows = torch.as_strided(base, (7, 64), (stride, 1), offset)
    assert sums(rows) == reference(rows)
    ids = torch.tensor([6, 1, 3])
    assert sums(rows, ids) == reference(rows[ids])
    assert torch.equal(base, random_rows(1, 7 * stride + 64, 4).view(-1))  # read only


@pytest.mark.parametrize("piece_rows", [0, 1, 3])  # 0: a piece smaller than a row
def test_pieces_give_the_same_sums(monkeypatch: pytest.MonkeyPatch, piece_rows: int) -> None:
    rows = random_rows(10, 128, 5)
    ids = torch.tensor([9, 8, 0, 4, 4, 1, 7])
    want, want_ids = reference(rows), reference(rows[ids])
    monkeypatch.setattr(rs, "PIECE_BYTES", piece_rows * 128 + 64)
    assert sums(rows) == want
    assert sums(rows, ids) == want_ids


# -- sensitivity ---------------------------------------------------------------------------

@pytest.mark.parametrize("cuts", [(), (4,), (4, 8, 100), (252,)])
def test_host_pieces_add_up_to_the_reference(cuts: tuple[int, ...]) -> None:
    """host_piece_sum over any cut of a row into whole-word pieces, added mod 2^64, is the
    row's sum; extreme words included (sign extension)."""
    rows = torch.cat([random_rows(3, 256, 7), torch.tensor([[0xFF] * 256, [0x00, 0x00, 0x00,
                                                             0x80] * 64], dtype=torch.uint8)])
    coef = coefficient_array(64)
    terms = np.full(64, 0xDEAD, dtype=np.uint64)  # scratch left dirty: every term rewritten
    edges = [0, *cuts, 256]
    for row, want in zip(rows.numpy(), reference(rows), strict=True):
        got = sum(host_piece_sum(row[a:b], coef[a // 4:], terms)
                  for a, b in zip(edges, edges[1:], strict=False))
        assert got & MASK == want


def test_every_single_bit_flip_changes_the_sum() -> None:
    row = random_rows(1, 256, 6)
    flipped = row.repeat(2048, 1)
    bits = torch.arange(2048)
    masks = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)[bits % 8]
    flipped[bits, bits // 8] ^= masks
    assert int((flipped != row).sum()) == 2048  # one byte differs in each, by one bit
    base = row_sums(row)[0]
    changed = row_sums(flipped) != base
    assert int(changed.sum()) == 2048, torch.nonzero(~changed).flatten().tolist()


def test_top_bits_of_two_64_bit_words_do_not_cancel() -> None:
    row = random_rows(1, 256, 7)
    words64 = row.view(torch.int64)
    base = sums(row)[0]
    for a, b in [(0, 1), (0, 31), (5, 17)]:
        two = words64.clone()
        two[0, a] ^= torch.iinfo(torch.int64).min  # the top bit
        two[0, b] ^= torch.iinfo(torch.int64).min
        got = sums(two.view(torch.uint8))[0]
        assert got != base and got == reference(two.view(torch.uint8))[0]


def test_swapping_two_words_changes_the_sum() -> None:
    row = random_rows(1, 256, 8)
    words = row.view(torch.int32)
    base = sums(row)[0]
    for a, b in [(0, 1), (3, 60), (62, 63)]:
        assert int(words[0, a]) != int(words[0, b])
        swapped = words.clone()
        swapped[0, a], swapped[0, b] = words[0, b], words[0, a]
        assert sums(swapped.view(torch.uint8))[0] != base


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [0, 1, 6, 258])
def test_rows_of_partial_words_are_refused(nbytes: int) -> None:
    with pytest.raises(ValueError, match=f"rows of {nbytes} bytes"):
        row_sums(torch.zeros(3, nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"rows of {nbytes} bytes"):
        check_row_bytes(nbytes)
    check_row_bytes(nbytes + 4 - nbytes % 4)


# -- checked copies ------------------------------------------------------------------------

class Target:
    """A poisoned destination of 16 rows, the rows a stage goes to, and the copy's state."""

    def __init__(self, nbytes: int = 64) -> None:
        self.dst = torch.full((16, nbytes), POISON, dtype=torch.uint8)
        self.run = torch.ones(1, dtype=torch.int64)
        self.good = torch.zeros(1, dtype=torch.int64)
        self.landed: dict[int, torch.Tensor] = {}  # dst row -> the bytes it must hold

    def copy(self, stage: torch.Tensor, expect: torch.Tensor, ids: list[int]) -> None:
        checked_copy(stage, expect, self.dst, torch.tensor(ids), self.run, self.good)

    def check(self) -> None:
        want = torch.full_like(self.dst, POISON)
        for row, data in self.landed.items():
            want[row] = data
        assert torch.equal(self.dst, want)


@pytest.mark.parametrize("bad", [0, 1, 4, 5])
def test_checked_copy_stops_at_the_first_bad_row(bad: int) -> None:
    stage = random_rows(6, 64, 9)
    expect = row_sums(stage)
    stage[bad, 13] ^= 0x10  # the slot changed after its sum was taken
    if bad + 1 < 6:
        stage[bad + 1, 0] ^= 0x01
        expect[bad + 1] = row_sums(stage[bad + 1:bad + 2])[0]  # later rows good, still held back
    t, ids = Target(), [3, 15, 0, 7, 9, 2]
    t.copy(stage, expect, ids)
    t.landed = {ids[i]: stage[i] for i in range(bad)}
    t.check()
    assert int(t.good) == bad and int(t.run) == 0


def test_checked_copy_of_good_rows_lands_them_all() -> None:
    stage = random_rows(5, 64, 10)
    t, ids = Target(), [4, 1, 12, 8, 6]
    t.copy(stage, row_sums(stage), ids)
    t.landed = dict(zip(ids, stage, strict=True))
    t.check()
    assert int(t.good) == 5 and int(t.run) == 1


def test_checked_copy_after_a_failure_lands_nothing() -> None:
    stage = random_rows(4, 64, 11)
    t = Target()
    t.run.zero_()
    t.good.fill_(3)  # counted by earlier chunks
    t.copy(stage, row_sums(stage), [0, 1, 2, 3])
    t.check()
    assert int(t.good) == 3 and int(t.run) == 0


def test_checked_copy_carries_across_chunks() -> None:
    chunks = [random_rows(3, 64, 12 + i) for i in range(3)]
    expects = [row_sums(c) for c in chunks]
    expects[1][2] ^= 1  # the last row of the second chunk fails
    ids = [[5, 6, 7], [0, 15, 9], [1, 2, 3]]
    t = Target()
    t.copy(chunks[0], expects[0], ids[0])
    assert int(t.good) == 3 and int(t.run) == 1
    t.copy(chunks[1], expects[1], ids[1])
    assert int(t.good) == 5 and int(t.run) == 0
    t.copy(chunks[2], expects[2], ids[2])  # all good, but after a failure
    assert int(t.good) == 5 and int(t.run) == 0
    t.landed = {**dict(zip(ids[0], chunks[0], strict=True)),
                ids[1][0]: chunks[1][0], ids[1][1]: chunks[1][1]}
    t.check()


# -- sums as a commit carries them ---------------------------------------------------------

def test_unsigned_round_trip() -> None:
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    signed = to_int64(values)
    assert signed.dtype == np.int64
    assert signed.tolist() == [0, 1, 2**63 - 1, -(2**63), -1]
    back = to_unsigned(signed)
    assert back == values and all(type(v) is int for v in back)
    assert to_unsigned(to_int64(back)) == values
