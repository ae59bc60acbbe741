"""The vLLM-free scheduler core: lookups, load/store planning, completion, block safety."""

from __future__ import annotations

import pickle

import pytest

from kvconnector.offload.jobs import JobReport, StepJobs
from kvconnector.offload.scheduler import OffloadScheduler
from transfer.keys import Namespace

BS = 4
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def make(num_slots: int = 8, num_workers: int = 1, policy: str = "lru") -> OffloadScheduler:
    return OffloadScheduler(NS, num_slots, BS, num_workers, policy)


def done(*job_ids: int, workers: int = 1) -> JobReport:
    return JobReport(done=dict.fromkeys(job_ids, workers))


def store_all(core: OffloadScheduler, req_id: str, hs: list[bytes], block_ids: list[int]) -> None:
    """Store every block of a request and complete the job."""
    core.plan_stores(req_id, hs, block_ids, len(hs) * BS)
    step = core.build_step()
    core.complete(done(*(job.job_id for job in step.stores), workers=core.num_workers))


def test_store_plan_covers_ready_blocks_once() -> None:
    core = make()
    hs = hashes("a", 3)
    core.plan_stores("a", hs, [10, 11, 12], num_ready_tokens=2 * BS + 1)
    step = core.build_step()
    assert [(j.req_id, j.block_ids, len(j.slots)) for j in step.stores] == [("a", (10, 11), 2)]
    assert len(set(step.stores[0].slots)) == 2
    # Same readiness again: nothing new. One more block ready: only that one.
    core.plan_stores("a", hs, [10, 11, 12], num_ready_tokens=2 * BS + 3)
    assert core.build_step().stores == []
    core.plan_stores("a", hs, [10, 11, 12], num_ready_tokens=3 * BS)
    assert [j.block_ids for j in core.build_step().stores] == [(12,)]
    # Hashes bound readiness too (a block of placeholder tokens has no hash yet).
    core.plan_stores("a", hs, [10, 11, 12, 13], num_ready_tokens=4 * BS)
    assert core.build_step().stores == []


def test_keys_being_stored_are_not_hits_until_every_worker_reports() -> None:
    core = make(num_workers=2)
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0]
    assert core.lookup("b", hs, 0, 2 * BS + 1) == 0
    core.complete(done(job.job_id))
    assert core.lookup("b", hs, 0, 2 * BS + 1) == 0  # one of two workers
    assert core.has_jobs()
    core.complete(done(job.job_id))
    assert core.lookup("b", hs, 0, 2 * BS + 1) == 2 * BS
    assert not core.has_jobs()


def test_lookup_counts_the_longest_stored_prefix_and_changes_nothing() -> None:
    core = make()
    hs = hashes("a", 4)
    store_all(core, "a", hs[:2], [1, 2])
    other = hs[:2] + hashes("b", 2)[1:]
    assert core.lookup("b", other, 0, 100) == 2 * BS
    assert core.lookup("b", other, 0, 100) == 2 * BS  # again: same answer
    assert core.lookup("b", other, BS, 100) == BS  # from the local hit on
    assert core.lookup("b", hashes("z", 3), 0, 100) == 0
    assert core.build_step().is_empty()
    assert core.index.num_free == 8 - 2
    # Only full blocks of the request's tokens count.
    assert core.lookup("b", other, 0, BS + 1) == BS


def test_load_plan_reads_the_stored_slots_into_the_allocated_blocks() -> None:
    core = make()
    hs = hashes("a", 3)
    core.plan_stores("a", hs, [5, 6, 7], 3 * BS)
    stored = core.build_step().stores[0]
    core.complete(done(stored.job_id))
    assert core.lookup("b", hs, BS, 3 * BS + 2) == 2 * BS
    core.plan_load("b", hs, [20, 21, 22, 23], 2 * BS)
    load = core.build_step().loads[0]
    assert load.req_id == "b" and load.block_ids == (21, 22)
    assert load.slots == stored.slots[1:]
    # The loaded blocks are not stored again by the loading request.
    core.plan_stores("b", hs, [20, 21, 22, 23], 3 * BS)
    assert core.build_step().stores == []
    counters = core.take_counters()
    assert (counters.hit_tokens, counters.miss_tokens, counters.jobs_in_flight) == (2 * BS, 0, 1)


def test_loaded_keys_are_pinned_against_eviction() -> None:
    core = make(num_slots=2)
    hs = hashes("a", 2)
    store_all(core, "a", hs, [1, 2])
    core.lookup("b", hs, 0, 100)
    core.plan_load("b", hs, [3, 4], 2 * BS)
    load = core.build_step().loads[0]
    core.plan_stores("c", hashes("c", 2), [5, 6], 2 * BS)
    assert core.build_step().stores == []  # both slots pinned by the load
    assert core.take_counters().unplaced_blocks == 2
    core.complete(done(load.job_id))
    core.plan_stores("d", hashes("d", 1), [7], BS)
    assert len(core.build_step().stores) == 1
    assert core.take_counters().evictions == 1


def test_plan_load_refuses_more_than_the_lookup_offered() -> None:
    core = make()
    hs = hashes("a", 2)
    store_all(core, "a", hs, [1, 2])
    core.lookup("b", hs, 0, 100)
    with pytest.raises(ValueError, match="cannot load 12 tokens"):
        core.plan_load("b", hs, [1, 2, 3], 3 * BS)
    with pytest.raises(ValueError, match="cannot load 5 tokens"):
        core.plan_load("b", hs, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        core.lookup("b", hs, 3, 100)


def test_misses_are_counted_at_admission_only() -> None:
    core = make()
    hs = hashes("a", 3)
    for _ in range(3):  # vLLM may ask again while a request waits for blocks
        assert core.lookup("a", hs, 0, 3 * BS + 1) == 0
    core.plan_load("a", hs, [1, 2, 3], 0)
    counters = core.take_counters()
    assert (counters.hit_tokens, counters.miss_tokens) == (0, 3 * BS)
    assert core.build_step().loads == []


def test_finished_request_is_held_until_its_stores_are_reported() -> None:
    core = make()
    hs = hashes("a", 3)
    core.plan_stores("a", hs, [1, 2, 3], 2 * BS)
    first = core.build_step().stores[0]
    # Finishing with the last block ready: one more store, and the blocks stay allocated.
    assert core.request_finished("a", hs, [1, 2, 3], 3 * BS) is True
    step = core.build_step()
    assert step.held == ["a"]
    assert [j.block_ids for j in step.stores] == [(3,)]
    core.complete(done(first.job_id, step.stores[0].job_id))
    assert not core.has_jobs()
    assert core.lookup("z", hs, 0, 100) == 3 * BS


def test_finished_request_without_stores_is_not_held() -> None:
    core = make()
    hs = hashes("a", 2)
    store_all(core, "a", hs, [1, 2])
    core.lookup("b", hs, 0, 100)
    assert core.request_finished("b", hs, [7, 8], 2 * BS) is False  # all stored already
    assert core.request_finished("never-seen", hs, [1], BS) is False
    assert core.build_step().is_empty()


def test_request_waiting_for_a_load_is_never_held() -> None:
    core = make()
    hs = hashes("a", 2)
    store_all(core, "a", hs, [1, 2])
    core.lookup("b", hs, 0, 100)
    core.plan_load("b", hs, [3, 4], 2 * BS)
    load = core.build_step().loads[0]
    assert core.request_finished("b", hs, [3, 4], 0) is False  # aborted while loading
    core.complete(done(load.job_id))
    assert not core.has_jobs()


def test_preemption_flushes_the_stores_in_flight() -> None:
    core = make()
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0]
    core.request_preempted("a")
    assert core.build_step().flush == [job.job_id]
    # Resumed with a new block table: the blocks are considered again, and the keys already
    # being stored are not stored twice.
    core.plan_stores("a", hs, [8, 9], 2 * BS)
    assert core.build_step().stores == []
    core.complete(done(job.job_id))
    core.request_preempted("a")
    assert core.build_step().flush == []


def test_failed_load_drops_the_keys_and_stores_the_recomputed_blocks() -> None:
    core = make(num_workers=2)
    hs = hashes("a", 3)
    store_all(core, "a", hs, [1, 2, 3])
    core.lookup("b", hs, 0, 100)
    core.plan_load("b", hs, [4, 5, 6], 3 * BS)
    load = core.build_step().loads[0]
    core.complete(JobReport(done={load.job_id: 1}, failed={load.job_id: 1}))
    assert core.take_counters().failed_loads == 1
    assert core.lookup("c", hs, 0, 100) == 0
    # vLLM recomputes the blocks; the request stores them again.
    core.plan_stores("b", hs, [4, 5, 6], 3 * BS)
    assert [j.block_ids for j in core.build_step().stores] == [(4, 5, 6)]


def test_failed_store_leaves_no_readable_key() -> None:
    core = make()
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0]
    core.complete(JobReport(failed={job.job_id: 1}))
    assert core.lookup("b", hs, 0, 100) == 0
    assert core.take_counters().failed_stores == 1
    assert core.index.num_free == 8


def test_reset_forgets_the_tier_while_jobs_in_flight_finish() -> None:
    core = make()
    hs = hashes("a", 2)
    store_all(core, "a", hs[:1], [1])
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0]
    core.reset()
    assert core.lookup("b", hs, 0, 100) == 0
    core.complete(done(job.job_id))
    assert core.lookup("b", hs, 0, 100) == 0
    assert core.index.num_free == 8


def test_reports_for_unknown_or_finished_jobs_are_refused() -> None:
    core = make()
    with pytest.raises(ValueError, match="job 7"):
        core.complete(done(7))
    core.plan_stores("a", hashes("a", 1), [1], BS)
    job = core.build_step().stores[0]
    with pytest.raises(ValueError, match="waits for 1"):
        core.complete(done(job.job_id, workers=2))


def test_constructor_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        OffloadScheduler(NS, 4, BS, 0)
    with pytest.raises(ValueError, match="block_size"):
        OffloadScheduler(NS, 4, True, 1)
    with pytest.raises(ValueError, match="policy"):
        OffloadScheduler(NS, 4, BS, 1, "fifo")


def test_step_and_report_are_picklable_and_reports_merge() -> None:
    core = make()
    core.plan_stores("a", hashes("a", 2), [1, 2], 2 * BS)
    step = core.build_step()
    assert pickle.loads(pickle.dumps(step)) == step
    a = JobReport(done={1: 1, 2: 1}, load_bytes=10, store_seconds=0.5)
    b = JobReport(done={1: 1}, failed={3: 1}, load_bytes=5, store_seconds=0.25)
    merged = a.merged(b)
    assert (merged.done, merged.failed, merged.load_bytes, merged.store_seconds) == (
        {1: 2, 2: 1}, {3: 1}, 15, 0.75)
    assert StepJobs().is_empty() and JobReport().is_empty()


def test_arc_policy_is_accepted() -> None:
    core = make(num_slots=2, policy="arc")
    store_all(core, "a", hashes("a", 2), [1, 2])
    assert core.lookup("b", hashes("a", 2), 0, 100) == 2 * BS


def test_a_steps_stores_are_planned_with_one_index_call() -> None:
    core = make(num_slots=3)
    calls = []
    prepare_stores = core.index.prepare_stores
    core.index.prepare_stores = lambda lists: calls.append(lists) or prepare_stores(lists)
    # b shares a's first block (being stored by a's job: skipped) and needs two more slots,
    # of which one is left.
    core.plan_step_stores([("a", [b"x0", b"x1"], [1, 2], 2 * BS),
                           ("b", [b"x0", b"y1", b"y2"], [3, 4, 5], 3 * BS),
                           ("c", [b"z0"], [6], BS - 1)])  # no full block yet
    assert len(calls) == 1 and [len(keys) for keys in calls[0]] == [2, 3]
    step = core.build_step()
    assert [(j.req_id, j.block_ids) for j in step.stores] == [("a", (1, 2)), ("b", (4,))]
    assert core.take_counters().unplaced_blocks == 1
