"""A worker's shared-pool checks (kvconnector/offload/pool_checks.py): which blocks go by row
sums and which by xxh3 (the xxh3 checks themselves: test_checked_loads.py)."""

from __future__ import annotations

import torch

from kvconnector.offload.jobs import JobReport, TransferJob
from kvconnector.offload.pool_checks import PoolChecks
from transfer.checksums import block_checksum
from transfer.engine import CopyResult


def test_row_sums_only_where_the_engine_takes_and_stages_them() -> None:
    """A GPU worker's checks: row sums for stores and loads; loads back to xxh3 where the
    staging cannot be allocated, both back where the engine cannot sum (no cupy)."""
    class Engine:
        def __init__(self, can_sum: bool, stages: bool) -> None:
            self.can_sum, self._stages = can_sum, stages

        def reserve_checked_loads(self) -> bool:
            return self._stages

    job = TransferJob(1, "r", (0, 1), (5, 6), checked=(b"a", b"b"), sums=((1,), (2,)),
                      row_sums=((11,), (12,)))
    checks = PoolChecks(0, torch.device("cuda"))
    try:
        for can_sum, stages, stores, loads in [(True, True, True, [11, 12]),
                                               (True, False, True, None),
                                               (False, True, False, None)]:
            checks.bind(Engine(can_sum, stages))
            assert (checks.sums_store(job), checks.expected(job, 2)) == (stores, loads)
        cpu = PoolChecks(0, torch.device("cpu"))  # a CPU worker: xxh3 only
        cpu.bind(Engine(True, True))
        assert (cpu.sums_store(job), cpu.expected(job, 2)) == (False, None)
        cpu.close()
    finally:
        checks.close()


def test_hashed_stores_reported_with_their_checksums_then_row_sums() -> None:
    """A copied store is reported done with its blocks' xxh3s (of this rank's part of each
    slot, bound to its key) followed by the copy's row sums; a failed copy is not hashed."""
    rows = torch.arange(4 * 64, dtype=torch.int64).to(torch.uint8).view(4, 64)
    checks = PoolChecks(1, torch.device("cpu"))
    try:
        good = TransferJob(7, "r", (0, 1), (2, 3), checked=(b"k2", b"k3"))
        bad = TransferJob(8, "r", (0,), (1,), checked=(b"k1",))
        for job in (good, bad):
            checks.store_submitted(job)
        assert checks.store_copied(CopyResult(7, True, 128, 0.1, True, sums=(5, 6)), rows)
        assert not checks.store_copied(CopyResult(8, False, 0, 0.0, True), rows)
        checks.wait()
        report = JobReport()
        assert checks.report_hashed(report) == [7]
        assert report.sums == {7: {1: [block_checksum(rows[2].numpy(), b"k2"),
                                       block_checksum(rows[3].numpy(), b"k3"), 5, 6]}}
        assert (report.done, report.failed) == ({7: 1}, {})
        assert checks.report_hashed(JobReport()) == []  # reported once
    finally:
        checks.close()


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
