"""A worker's shared-pool checks (kvconnector/offload/pool_checks.py): which blocks go by row
sums and which by xxh3 (the xxh3 checks themselves: test_checked_loads.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvconnector.offload.jobs import JobReport, TransferJob, pack_row_sums
from kvconnector.offload.pool_checks import PoolChecks
from transfer import slot_checker
from transfer.checksums import block_checksum
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.engine import CopyResult
from transfer.slot_checker import SlotChecker


def test_row_sums_only_where_the_engine_takes_and_stages_them() -> None:
    """A GPU worker's checks: row sums for stores and loads; loads back to xxh3 where the
    staging cannot be allocated, both back where the engine cannot sum (no cupy)."""
    class Engine:
        def __init__(self, can_sum: bool, stages: bool) -> None:
            self.can_sum, self._stages = can_sum, stages

        def reserve_checked_loads(self) -> bool:
            return self._stages

    job = TransferJob(1, "r", (0, 1), (5, 6), checked=(b"a", b"b"), sums=((1,), (2,)),
                      row_sums=pack_row_sums([(11,), (2**64 - 1,)], 1))
    checks = PoolChecks(0, torch.device("cuda"))
    try:
        for can_sum, stages, stores, loads in [(True, True, True, [11, 2**64 - 1]),
                                               (True, False, True, None),
                                               (False, True, False, None)]:
            checks.bind(Engine(can_sum, stages))
            expected = checks.expected(job, 2)
            assert checks.sums_store(job) == stores
            assert (None if expected is None else expected.tolist()) == loads
            if expected is not None:  # as the copy engine takes them fastest
                assert expected.dtype == np.uint64
                assert checks.expected(job, 1).tolist() == [11]
                assert checks.expected(job, 3) is None  # more blocks than it carries sums of
                short = TransferJob(1, "r", (0, 1, 2), (5, 6, 7), checked=(b"a", b"b", b"c"),
                                    sums=((1,), (2,), (3,)), row_sums=job.row_sums)
                assert checks.expected(short, 3) is None  # checked, but two sums for three
        cpu = PoolChecks(0, torch.device("cpu"))  # a CPU worker: xxh3 only
        cpu.bind(Engine(True, True))
        assert (cpu.sums_store(job), cpu.expected(job, 2)) == (False, None)
        cpu.close()
        other_rank = PoolChecks(1, torch.device("cuda"))  # a rank the job carries none for
        other_rank.bind(Engine(True, True))
        assert other_rank.expected(job, 2) is None
        other_rank.close()
    finally:
        checks.close()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_row_sums_travel_packed_per_rank(ranks: int) -> None:
    """A job's row sums, packed per rank, read back as each rank's unsigned 64-bit sums, the
    largest included."""
    by_block = [tuple((b * 7919 + r * 104729) % 2**64 for r in range(ranks)) for b in range(5)]
    by_block[3] = (2**64 - 1,) * ranks
    job = TransferJob(1, "r", tuple(range(5)), tuple(range(5)), checked=(b"k",) * 5,
                      row_sums=pack_row_sums(by_block, ranks))
    for rank in range(ranks):
        assert job.rank_row_sums(rank).tolist() == [rows[rank] for rows in by_block]
    assert job.rank_row_sums(ranks) is None


@pytest.mark.parametrize("by_block", [[], [(1, 2), (3,)], [(1, 2), (3, None)], [(1, 2, 3)],
                                      [(1, 2), (-3, 4)], [(1, 2), (2**64, 4)],
                                      [(1, True)], [(1, 2.5)], [(1, "7")]],
                         ids=["no blocks", "a rank missing", "a None", "a rank too many",
                              "negative", "over 64 bits", "a bool", "a float", "a string"])
def test_row_sums_not_packed_unless_every_block_has_every_ranks(by_block: list) -> None:
    assert pack_row_sums(by_block, 2) == ()


def test_hashed_stores_reported_with_their_checksums() -> None:
    """A copied store that took no row sums (a CPU worker's) is reported done with its blocks'
    xxh3s (of this rank's part of each slot, bound to its key); a failed copy is not hashed."""
    rows = torch.arange(4 * 64, dtype=torch.int64).to(torch.uint8).view(4, 64)
    checks = PoolChecks(1, torch.device("cpu"))
    try:
        good = TransferJob(7, "r", (0, 1), (2, 3), checked=(b"k2", b"k3"))
        bad = TransferJob(8, "r", (0,), (1,), checked=(b"k1",))
        for job in (good, bad):
            checks.store_submitted(job)
        early = JobReport()
        assert checks.store_copied(CopyResult(7, True, 128, 0.1, True), rows, early)
        assert not checks.store_copied(CopyResult(8, False, 0, 0.0, True), rows, early)
        assert early.sums == {}  # nothing reported before it is hashed
        checks.wait()
        report = JobReport()
        assert checks.report_hashed(report) == [7]
        assert report.sums == {7: {1: [block_checksum(rows[2].numpy(), b"k2"),
                                       block_checksum(rows[3].numpy(), b"k3")]}}
        assert (report.done, report.failed, report.hashed) == ({7: 1}, {}, {})
        assert checks.report_hashed(JobReport()) == []  # reported once
    finally:
        checks.close()


def test_row_summed_stores_commit_at_once_and_hash_after() -> None:
    """A store whose copy took row sums is reported at once with them alone (its xxh3s nil:
    the commit waits for no hash); its xxh3s come later, in `hashed`, taken only of slots whose
    row sums still match: a slot written after the copy gets None (never an xxh3 of bytes
    other than those committed)."""
    rows = torch.randint(0, 256, (4, 64), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    sums = tuple(to_unsigned(row_sums(rows[[2, 3]])))
    checks = PoolChecks(1, torch.device("cpu"))
    try:
        checks.store_submitted(TransferJob(7, "r", (0, 1), (2, 3), checked=(b"k2", b"k3")))
        report = JobReport()
        rows[3, 10] ^= 0x01  # the second slot changed after the copy took its row sum
        assert not checks.store_copied(CopyResult(7, True, 128, 0.1, True, sums=sums), rows,
                                       report)  # reported now: the worker marks it done
        assert report.sums == {7: {1: [None, None, *sums]}}
        checks.wait()
        later = JobReport()
        assert checks.report_hashed(later) == []  # no store waited for it
        assert later.hashed == {7: {1: [block_checksum(rows[2].numpy(), b"k2"), None]}}
        assert not later.is_empty() and (later.done, later.sums) == ({}, {})
        again = JobReport()
        checks.report_hashed(again)
        assert again.hashed == {} and checks.hashing_later == 0  # reported once
    finally:
        checks.close()


def test_hash_checked_never_hashes_a_changed_slot() -> None:
    """SlotChecker.hash_checked over several threads' parts: each slot's xxh3 where its row
    sum is the one given, None elsewhere, in order; mismatched counts are refused."""
    rows = torch.randint(0, 256, (9, 128), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5))
    slots, keys = [8, 0, 4, 2, 6], [b"a", b"b", b"c", b"d", b"e"]
    sums = to_unsigned(row_sums(rows[slots]))
    sums[3] ^= 1 << 63  # as if slot 2 had changed since its commit
    checker = SlotChecker(threads=2)
    try:
        got = checker.hash_checked(rows, slots, keys, sums).result()
        assert got == [block_checksum(rows[s].numpy(), k) if i != 3 else None
                       for i, (s, k) in enumerate(zip(slots, keys, strict=True))]
        with pytest.raises(ValueError, match="4 row sums for 5 keys"):
            checker.hash_checked(rows, slots, keys, sums[:4])
    finally:
        checker.close()


@pytest.mark.parametrize("piece", [1, 12, 63, 64, 1 << 20])
def test_hash_checked_in_pieces(monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """A slot checked and hashed a piece at a time (a last piece shorter, one piece, or the
    whole slot in one; a piece size of partial words taken down to whole ones): the same xxh3
    as the whole block's, None where one word changed."""
    monkeypatch.setattr(slot_checker, "HASH_PIECE_BYTES", piece)
    rows = torch.randint(0, 256, (6, 136), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(9))
    slots, keys = [5, 1, 3], [b"x", b"y", b"z"]
    sums = to_unsigned(row_sums(rows[slots]))
    rows[3, 132] ^= 0x40  # slot 3's last word changed since its commit
    checker = SlotChecker(threads=1)
    try:
        got = checker.hash_checked(rows, slots, keys, sums).result()
    finally:
        checker.close()
    assert got == [block_checksum(rows[5].numpy(), b"x"), block_checksum(rows[1].numpy(), b"y"),
                   None]


def test_failed_tail_from_the_first_block_the_engine_found_bad() -> None:
    """A load checked on the way (CopyResult.good) fails from its first bad block, counted
    once; a load whose copy failed has no such tail (it fails whole), nor has a good one."""
    checks = PoolChecks(0, torch.device("cpu"))
    try:
        blocks = (10, 11, 12, 13)
        report = JobReport()
        assert checks.failed_tail(CopyResult(1, True, 8, 0.1, False, good=1), blocks,
                                  report) == (11, 12, 13)
        assert checks.failed_tail(CopyResult(2, True, 8, 0.1, False, good=4), blocks,
                                  report) == ()
        assert checks.failed_tail(CopyResult(3, False, 0, 0.0, False), blocks, report) == ()
        assert (report.checksum_failures, report.sums) == (1, {})
    finally:
        checks.close()
