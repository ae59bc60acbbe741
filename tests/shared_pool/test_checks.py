"""SlotChecker (transfer/slot_checker.py): the checksums a writer takes and a reader checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from transfer.checksums import block_checksum
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.keys import Namespace
from transfer.slot_checker import SlotChecker

NS = Namespace(model="m", dtype="bfloat16", block_size=4, block_layout="x")


@pytest.fixture
def checker() -> Iterator[SlotChecker]:
    made = SlotChecker(threads=3)
    yield made
    made.close()


def slot_rows(num_slots: int = 8, width: int = 100_000) -> torch.Tensor:
    """Rows of `width` bytes (over the 64 KiB from which xxhash releases the GIL) in a wider
    slot stride, as a worker's part of a shared slot."""
    raw = torch.randint(0, 256, (num_slots, width + 4096), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    return raw[:, 4096:]


def test_each_rows_checksum_is_the_block_checksum_bound_to_its_key(checker: SlotChecker) -> None:
    rows = slot_rows()
    slots, keys = [5, 0, 7, 2, 3], NS.keys([b"a", b"b", b"c", b"d", b"e"])
    sums = checker.hash(rows, slots, keys).result()
    assert sums == [block_checksum(rows[s].numpy(), k) for s, k in zip(slots, keys, strict=True)]
    assert len(set(checker.hash(rows, [1, 1], keys[:2]).result())) == 2  # the key is in it
    assert checker.hash(rows, [], []).result() == []


def test_verify_counts_the_good_blocks_before_the_first_bad_one(checker: SlotChecker) -> None:
    rows = slot_rows()
    slots, keys = [1, 4, 6, 3], NS.keys([b"w", b"x", b"y", b"z"])
    sums = checker.hash(rows, slots, keys).result()
    assert checker.verify(rows, slots, keys, sums).result() == 4
    rows[6, 99_999] ^= 1  # the last byte of the third block
    assert checker.verify(rows, slots, keys, sums).result() == 2
    rows[6, 99_999] ^= 1
    assert checker.verify(rows, slots, keys, [sums[0], None, *sums[2:]]).result() == 1
    assert checker.verify(rows, slots, list(reversed(keys)), sums).result() == 0  # wrong keys


def test_a_block_without_its_xxh3_is_checked_by_its_row_sum(checker: SlotChecker) -> None:
    """A block committed by row sums and never hashed: its row sum checks it (the reference
    sum of transfer/copy/row_sums.py); a flipped byte anywhere fails it, and one with neither
    checksum fails too."""
    rows = slot_rows(width=600_000)  # over two of the 256 KiB pieces
    slots, keys = [2, 5, 0], NS.keys([b"p", b"q", b"r"])
    xxh3s = checker.hash(rows, slots, keys).result()
    by_rows = to_unsigned(row_sums(rows[slots]))
    assert checker.verify(rows, slots, keys, [None] * 3, by_rows).result() == 3
    assert checker.verify(rows, slots, keys, [xxh3s[0], None, None], by_rows).result() == 3
    for at in (0, 262_143, 262_144, 599_999):
        rows[5, at] ^= 0x10
        assert checker.verify(rows, slots, keys, [None] * 3, by_rows).result() == 1
        rows[5, at] ^= 0x10
    assert checker.verify(rows, slots, keys, [None] * 3, [by_rows[0], None, None]).result() == 1


def test_bad_input_is_refused_naming_it(checker: SlotChecker) -> None:
    rows = slot_rows()
    with pytest.raises(ValueError, match="3 checksums and 0 row sums for 2 keys"):
        checker.verify(rows, [0, 1], NS.keys([b"a", b"b"]), [1, 2, 3])
    with pytest.raises(ValueError, match="2 checksums and 1 row sums for 2 keys"):
        checker.verify(rows, [0, 1], NS.keys([b"a", b"b"]), [1, 2], [5])
    with pytest.raises(ValueError, match="2 slots for 1 keys"):
        checker.hash(rows, [0, 1], NS.keys([b"a"]))
    with pytest.raises(ValueError, match="dense 2-D uint8 host rows"):
        checker.hash(rows.view(torch.int8), [0], NS.keys([b"a"]))
