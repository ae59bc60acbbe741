"""SlotChecker (transfer/slot_checker.py): the checksums a writer takes and a reader checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from transfer.checksums import block_checksum
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


def test_bad_input_is_refused_naming_it(checker: SlotChecker) -> None:
    rows = slot_rows()
    with pytest.raises(ValueError, match="3 checksums for 2 keys"):
        checker.verify(rows, [0, 1], NS.keys([b"a", b"b"]), [1, 2, 3])
    with pytest.raises(ValueError, match="2 slots for 1 keys"):
        checker.hash(rows, [0, 1], NS.keys([b"a"]))
    with pytest.raises(ValueError, match="dense 2-D uint8 host rows"):
        checker.hash(rows.view(torch.int8), [0], NS.keys([b"a"]))
