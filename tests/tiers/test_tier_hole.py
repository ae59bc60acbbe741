"""A pool with a hole at the head of a prefix: the pool evicted a prompt's first blocks (least
recently used) and kept its later ones, while a write-through tier below holds them all. A
lookup must offer only the hole from the tier: a fetch that also covered blocks the pool holds
could not reserve slots for them and would fail every time (vLLM recomputing, then asking
again, round after round).
"""

from __future__ import annotations

from kvconnector.offload.jobs import JobReport
from kvconnector.offload.scheduler import OffloadScheduler
from transfer.keys import Namespace
from transfer.tier import PlannerContext, TierSpec

BS = 4
NS = Namespace(model="hole", dtype="bfloat16", block_size=BS, block_layout="test")
HASHES = [f"hole-{i}".encode() for i in range(6)]


def drive(core: OffloadScheduler) -> None:
    """The step's jobs and writes all reported done by the one worker."""
    step = core.build_step()
    core.complete(JobReport(done={job.job_id: 1 for job in step.stores + step.loads},
                            written={op.op_id: 1 for op in step.writes}))


def test_a_lookup_fetches_only_the_hole_before_blocks_the_pool_holds(
        memory_tier: TierSpec) -> None:
    values = {key: option.default for key, option in memory_tier.options.items()}
    settings = memory_tier.settings(values | {"memory_blocks": 32,
                                              "memory_write_policy": "through"})
    planner = memory_tier.make_planner(settings, PlannerContext(
        NS, num_workers=1, slot_bytes=64, rank_namespaces=(NS,)))
    core = OffloadScheduler(NS, 4, BS, 1, tiers=[planner])
    try:
        for ready in (2, 4, 6):  # 6 blocks through a 4-slot pool: it keeps the last 4
            core.plan_stores("a", HASHES, list(range(6)), ready * BS)
            drive(core)
            drive(core)
        keys = NS.keys(HASHES)
        assert core.index.present(keys) == [False, False, True, True, True, True]
        assert planner.present(keys) == [True] * 6
        offered = core.lookup("b", HASHES, 0, 6 * BS + 1)
        assert offered == 2 * BS  # the hole, from the tier
        assert core.plan_load("b", HASHES, list(range(10, 16)), offered) == {"memory": 2}
        (load,) = core.build_step().loads
        assert not load.fail and load.fetch_keys == tuple(keys[:2])
    finally:
        core.close()
