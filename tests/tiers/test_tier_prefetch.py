"""Prefetch in the offload core (kvconnector/offload/prefetch.py), over the memory tier
(tests/tiers/memory_tier.py) below a 4-slot pool: a waiting request's blocks that only the tier
holds are fetched into the pool ahead (a tier op the workers run among the step's writes), and
a lookup then finds them in the pool; a lookup that reaches them in flight waits until the
deadline, then goes on without them; an aborted request's unsent prefetch is cancelled with
nothing left pinned or reserved; the bound holds; a slot whose evicted block the tier writes out
is filled only after that write; a bad block is a miss.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnector.offload.jobs import JobReport, StepJobs
from kvconnector.offload.prefetch import PrefetchRules
from kvconnector.offload.scheduler import OffloadScheduler
from transfer.keys import Namespace
from transfer.tier import PlannerContext, TierPlanner, TierSpec

BS = 4
NS = Namespace(model="prefetch", dtype="bfloat16", block_size=BS, block_layout="test")
A = [f"a-{i}".encode() for i in range(6)]
B = [f"b-{i}".encode() for i in range(4)]
KEYS_A = NS.keys(A)


class Rig:
    """The core over a 4-slot pool and the memory tier, driven by hand: `report` plays every
    worker (one) reporting a step's jobs and tier ops."""

    def __init__(self, spec: TierSpec, write_policy: str, max_blocks: int = 8) -> None:
        values = {key: option.default for key, option in spec.options.items()}
        settings = spec.settings(values | {"memory_blocks": 32,
                                           "memory_write_policy": write_policy})
        self.tier: TierPlanner = spec.make_planner(settings, PlannerContext(
            NS, num_workers=1, slot_bytes=64, rank_namespaces=(NS,)))
        self.core = OffloadScheduler(NS, 4, BS, 1, tiers=[self.tier],
                                     prefetch=PrefetchRules(max_blocks, deadline_s=5.0))
        self.now = 0.0
        self.core._clock = lambda: self.now

    def report(self, step: StepJobs, bad: dict[int, list[bytes]] | None = None) -> None:
        self.core.complete(JobReport(done={job.job_id: 1 for job in step.stores + step.loads},
                                     written={op.op_id: 1 for op in step.writes},
                                     bad=bad or {}))

    def store(self, req_id: str, hashes: list[bytes]) -> None:
        """The request computes and stores every block, then finishes."""
        self.core.request_finished(req_id, hashes, list(range(len(hashes))), len(hashes) * BS)
        for _ in range(3):  # its stores, then the tier's writes
            self.report(self.core.build_step())


@pytest.fixture
def rig(memory_tier: TierSpec) -> Iterator[Rig]:
    made = Rig(memory_tier, "through")
    made.store("a", A)  # the pool keeps a's last 4 blocks; the tier has all 6
    made.store("b", B)  # b's 4 evict them: only the tier holds a's blocks now
    assert made.core.index.present(KEYS_A) == [False] * 6
    try:
        yield made
    finally:
        made.core.close()


def fetches(step: StepJobs) -> list[tuple[str, tuple[bytes, ...]]]:
    return [(op.tier, op.keys) for op in step.writes if not op.is_write]


def test_a_waiting_requests_blocks_are_fetched_into_the_pool_and_then_hit_there(
        rig: Rig) -> None:
    core = rig.core
    core.prefetch("r", A, 6 * BS + 1)
    step = core.build_step()
    assert fetches(step) == [("memory", tuple(KEYS_A[:4]))]  # 4 slots: b's 4 are evicted
    assert core.has_jobs()
    rig.report(step)
    assert core.index.present(KEYS_A) == [True] * 4 + [False] * 2
    assert core.take_counters().prefetched_blocks == 4
    assert rig.tier.blocks.pins == {}  # the fetch released its pins
    assert core.lookup("r", A, 0, 6 * BS + 1) == 4 * BS  # pool hits now
    assert core.plan_load("r", A, list(range(10, 16)), 4 * BS) == {"pool": 4}


def test_a_request_scheduled_before_its_prefetch_is_planned_loads_as_usual(rig: Rig) -> None:
    core = rig.core
    core.prefetch("r", A, 6 * BS + 1)
    hits = core.lookup("r", A, 0, 6 * BS + 1)
    assert core.plan_load("r", A, list(range(10, 16)), hits) == {"memory": 4}
    step = core.build_step()
    assert fetches(step) == [] and len(step.loads) == 1  # no prefetch: its load fetches


def test_a_lookup_waits_for_a_prefetch_in_flight_until_its_deadline(rig: Rig) -> None:
    core = rig.core
    core.prefetch("r", A, 6 * BS + 1)
    step = core.build_step()  # sent, not reported yet
    assert core.lookup("r", A, 0, 6 * BS + 1) is None  # ask again later
    assert core.lookup("other", A, 0, 6 * BS + 1) is None  # anyone reaching those blocks
    rig.now += 5.0  # the deadline: go on without them (they are on their way to the pool)
    assert core.lookup("r", A, 0, 6 * BS + 1) == 0
    rig.report(step)
    assert core.lookup("r", A, 0, 6 * BS + 1) == 4 * BS


def test_an_aborted_requests_unsent_prefetch_is_cancelled_leaving_nothing_held(
        rig: Rig) -> None:
    core = rig.core
    reclaimable = core.index.num_reclaimable
    core.prefetch("gone", A, 6 * BS + 1)
    core._plan_prefetches()  # planned for the next step (as build_step does first)
    assert core.index.num_reclaimable == reclaimable - 4 and rig.tier.blocks.pins
    core.request_finished("gone", A, [], 0)  # aborted while waiting
    step = core.build_step()
    assert fetches(step) == []
    assert not core.has_jobs() and not core._prefetching and not core._prefetches
    assert core.index.num_reclaimable == reclaimable and rig.tier.blocks.pins == {}
    assert core.take_counters().prefetched_blocks == 0


def test_a_sent_prefetch_of_an_aborted_request_completes(rig: Rig) -> None:
    core = rig.core
    core.prefetch("gone", A, 6 * BS + 1)
    step = core.build_step()
    core.request_finished("gone", A, [], 0)
    rig.report(step)
    assert not core.has_jobs()
    assert core.take_counters().prefetched_blocks == 4


def test_blocks_in_flight_are_bounded(memory_tier: TierSpec) -> None:
    rig = Rig(memory_tier, "through", max_blocks=3)
    try:
        rig.store("a", A)
        rig.store("b", B)
        rig.core.prefetch("r1", A, 6 * BS + 1)
        rig.core.prefetch("r2", A[:2] + B[2:], 4 * BS + 1)  # waits: the bound is reached
        step = rig.core.build_step()
        assert fetches(step) == [("memory", tuple(KEYS_A[:3]))]
        assert "r2" in rig.core._prefetch_wanted
        rig.report(step)
        assert not rig.core._prefetching
    finally:
        rig.core.close()


def test_a_slot_is_filled_only_once_its_evicted_block_is_written_below(
        memory_tier: TierSpec) -> None:
    rig = Rig(memory_tier, "evict")  # the tier keeps what the pool evicts
    try:
        rig.store("a", A[:4])  # the pool holds a's 4
        rig.store("b", B)  # b's 4 evict a's 4 to the tier
        core = rig.core
        core.prefetch("r", A[:4], 4 * BS + 1)
        step = core.build_step()
        # b's 4 blocks leave the pool for the tier first; the fetch into their slots waits
        writes = [op for op in step.writes if op.is_write]
        assert [set(op.keys) for op in writes] == [set(NS.keys(B))]
        assert fetches(step) == []
        rig.report(step)
        step = core.build_step()
        assert fetches(step) == [("memory", tuple(KEYS_A[:4]))]
        assert set(step.writes[0].slots) == set(writes[0].slots)
        rig.report(step)
        assert core.take_counters().prefetched_blocks == 4
    finally:
        rig.core.close()


def test_a_bad_block_is_a_miss_and_leaves_the_tier(rig: Rig) -> None:
    core = rig.core
    core.prefetch("r", A, 6 * BS + 1)
    step = core.build_step()
    (op,) = [op for op in step.writes if not op.is_write]
    rig.report(step, bad={op.op_id: [KEYS_A[1]]})
    assert core.index.present(KEYS_A[:4]) == [True, False, True, True]
    assert core.take_counters().prefetched_blocks == 3
    assert rig.tier.present([KEYS_A[1]]) == [False]


def test_a_lookup_offers_no_block_another_requests_load_is_fetching(rig: Rig) -> None:
    """Blocks on their way into the pool (another request's fetch holds their slots) are not
    offered: a fetch of them could reserve no slot, and the load would fail."""
    core = rig.core
    assert core.lookup("y", A[:2], 0, 2 * BS + 1) == 2 * BS
    assert core.plan_load("y", A[:2], [10, 11, 12], 2 * BS) == {"memory": 2}
    step = core.build_step()  # y's load fetches a's first 2 blocks into the pool
    assert core.lookup("x", A, 0, 6 * BS + 1) == 0  # (the tier holds all 6)
    core.plan_load("x", A, list(range(20, 27)), 0)
    rig.report(step)  # fetched and loaded: pool hits from now on
    hits = core.lookup("x2", A, 0, 6 * BS + 1)
    assert hits == 4 * BS  # the 2 fetched, and 2 more from the tier into the 2 other slots
    assert core.plan_load("x2", A, list(range(30, 37)), hits) == {"pool": 2, "memory": 2}
    rig.report(core.build_step())
    counters = core.take_counters()
    assert counters.failed_loads == 0 and counters.hit_tokens == 6 * BS
