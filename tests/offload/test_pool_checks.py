"""A worker's shared-pool checks (kvconnector/offload/pool_checks.py): which blocks go by row
sums and which by xxh3 (the xxh3 checks themselves: test_checked_loads.py)."""

from __future__ import annotations

import torch

from kvconnector.offload.jobs import TransferJob
from kvconnector.offload.pool_checks import PoolChecks


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
