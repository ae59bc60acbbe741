"""Admission in the vLLM-free scheduler core (kvconnector/offload/admission.py): the store
threshold and its bounded count table, the minimum prefix, shedding under backpressure, and a
request's own caps on what it stores and loads."""

from __future__ import annotations

import sys

import pytest

from kvconnector.offload.admission import AdmissionRules, CountTable, RequestLimits
from kvconnector.offload.jobs import JobReport
from kvconnector.offload.scheduler import OffloadScheduler
from transfer.keys import Namespace

BS = 4
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def make(num_slots: int = 16, **rules: int | None) -> OffloadScheduler:
    return OffloadScheduler(NS, num_slots, BS, 1, admission=AdmissionRules(**rules))


def finish(core: OffloadScheduler, req_id: str, hs: list[bytes]) -> list[int]:
    """The request finishes with every block computed; its stores complete. Returns the
    number of blocks each store job of it held."""
    core.request_finished(req_id, hs, list(range(1, len(hs) + 1)), len(hs) * BS)
    step = core.build_step()
    core.complete(JobReport(done={job.job_id: 1 for job in step.stores}))
    return [len(job.slots) for job in step.stores]


def stored(core: OffloadScheduler, hs: list[bytes]) -> int:
    """Leading blocks of `hs` the pool holds."""
    found = core.lookup("probe", hs, 0, len(hs) * BS + 1) // BS
    core._lookups.pop("probe")
    return found


# -- the count table -------------------------------------------------------------------------
def test_count_table_counts_offers_and_never_holds_more_than_its_capacity() -> None:
    table = CountTable(100)
    assert table.offer([b"a", b"b"]) == [1, 1]
    assert table.offer([b"a"]) == [2]
    for i in range(10_000):  # 100 times the capacity of distinct keys
        table.offer([i.to_bytes(4, "little")])
        assert len(table) <= 100
    assert len(table) == 100
    assert table.count(b"a") == 0  # forgotten: least recently offered
    assert table.offer([b"a"]) == [1]  # and counts again from 1
    # its memory is bounded too: the same after another 10,000 distinct keys
    size = sys.getsizeof(table._counts)
    for i in range(10_000, 20_000):
        table.offer([i.to_bytes(4, "little")])
    assert len(table) == 100 and sys.getsizeof(table._counts) == size


def test_count_table_keeps_the_most_recently_offered_and_an_offer_never_evicts_itself() -> None:
    table = CountTable(3)
    table.offer([b"a", b"b", b"c"])
    table.offer([b"a"])  # b is now the least recently offered
    table.offer([b"d"])
    assert (table.count(b"a"), table.count(b"b"), table.count(b"c"), table.count(b"d")) == \
        (2, 0, 1, 1)
    # an offer larger than the table keeps its first keys counted, the rest untracked
    assert table.offer([b"w", b"x", b"y", b"z"]) == [1, 1, 1, 1]
    assert [table.count(k) for k in (b"w", b"x", b"y", b"z")] == [1, 1, 1, 0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_count_table_refuses_a_bad_capacity(bad: object) -> None:
    with pytest.raises(ValueError, match="positive int capacity"):
        CountTable(bad)  # type: ignore[arg-type]


# -- engine-wide rules ------------------------------------------------------------------------
def test_defaults_store_every_block_at_the_first_offer() -> None:
    core = make()
    hs = hashes("a", 5)
    assert finish(core, "a", hs) == [5]
    assert stored(core, hs) == 5
    counters = core.take_counters()
    assert (counters.threshold_skipped_blocks, counters.shed_blocks) == (0, 0)


def test_threshold_two_stores_a_prefix_the_second_time_it_is_seen() -> None:
    core = make(store_threshold=2)
    hs = hashes("a", 5)
    assert finish(core, "r1", hs) == []
    assert stored(core, hs) == 0
    assert core.take_counters().threshold_skipped_blocks == 5
    assert finish(core, "r2", hs) == [5]
    assert stored(core, hs) == 5
    # a longer prompt sharing the first 3 blocks: those are at their 3rd offer (stored
    # already), its own 2 at their first: nothing new is stored
    longer = hs[:3] + hashes("b", 2)
    assert finish(core, "r3", longer) == []
    assert core.take_counters().threshold_skipped_blocks == 2


def test_threshold_counts_are_bounded_by_max_tracker_size() -> None:
    core = make(store_threshold=2, max_tracker_size=4)
    hs = hashes("a", 2)
    finish(core, "r1", hs)
    finish(core, "noise", hashes("n", 4))  # 4 newer prefixes push a's counts out
    assert len(core.admission.counts) == 4
    assert finish(core, "r2", hs) == []  # counted from 1 again: not stored
    assert finish(core, "r3", hs) == [2]


def test_min_prefix_tokens_stores_nothing_of_a_short_prompt() -> None:
    core = make(min_prefix_tokens=3 * BS)
    short, long = hashes("s", 2), hashes("l", 4)
    assert finish(core, "short", short) == []
    assert stored(core, short) == 0
    # a long prompt: nothing until 3 blocks are computed, then all of them at once
    core.plan_stores("long", long, [1, 2, 3, 4], 2 * BS)
    assert core.build_step().stores == []
    core.plan_stores("long", long, [1, 2, 3, 4], 3 * BS)
    assert [len(job.slots) for job in core.build_step().stores] == [3]


def test_stores_past_the_blocks_in_flight_bound_are_shed_and_counted_never_queued() -> None:
    core = make(max_store_blocks_in_flight=3)
    a, b, c = hashes("a", 2), hashes("b", 2), hashes("c", 2)
    core.plan_step_stores([("a", a, [1, 2], 2 * BS), ("b", b, [3, 4], 2 * BS)])
    step = core.build_step()
    assert [len(job.slots) for job in step.stores] == [2, 1]  # b's second block shed
    assert core.take_counters().shed_blocks == 1
    core.plan_stores("c", c, [5, 6], 2 * BS)  # 3 in flight: all of c shed at once
    assert core.build_step().stores == []
    assert core.take_counters().shed_blocks == 2
    assert core.index.num_free == 16 - 3  # the shed blocks hold no slot
    core.complete(JobReport(done={job.job_id: 1 for job in step.stores}))
    assert (stored(core, a), stored(core, b), stored(core, c)) == (2, 1, 0)
    core.plan_stores("c2", c, [5, 6], 2 * BS)  # room again
    assert [len(job.slots) for job in core.build_step().stores] == [2]


@pytest.mark.parametrize(("rules", "message"), [
    ({"store_threshold": -1}, "store_threshold must be an int >= 0, got -1"),
    ({"max_tracker_size": 0}, "max_tracker_size must be an int >= 1, got 0"),
    ({"min_prefix_tokens": 1.0}, "min_prefix_tokens must be an int >= 0, got 1.0"),
    ({"max_store_blocks_in_flight": True}, "max_store_blocks_in_flight must be an int >= 0"),
])
def test_bad_rules_are_refused(rules: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdmissionRules(**rules)


# -- a request's own limits -------------------------------------------------------------------
def test_a_request_that_skips_offloading_stores_nothing_while_its_neighbour_does() -> None:
    core = make()
    core.set_request_limits("quiet", RequestLimits(max_offload_tokens=0))
    quiet, loud = hashes("q", 3), hashes("l", 3)
    core.plan_step_stores([("quiet", quiet, [1, 2, 3], 3 * BS),
                           ("loud", loud, [4, 5, 6], 3 * BS)])
    assert [job.req_id for job in core.build_step().stores] == ["loud"]
    core.request_finished("quiet", quiet, [1, 2, 3], 3 * BS)
    assert core.build_step().stores == []
    assert core.admission.limits("quiet") == RequestLimits()  # forgotten once finished


def test_max_offload_tokens_caps_the_blocks_stored() -> None:
    core = make()
    core.set_request_limits("r", RequestLimits(max_offload_tokens=2 * BS + 1))
    hs = hashes("a", 5)
    assert finish(core, "r", hs) == [2]
    assert stored(core, hs) == 2


def test_max_load_tokens_caps_the_tokens_a_lookup_offers() -> None:
    core = make()
    hs = hashes("a", 5)
    finish(core, "writer", hs)
    core.set_request_limits("recompute", RequestLimits(max_load_tokens=0))
    core.set_request_limits("some", RequestLimits(max_load_tokens=2 * BS + 3))
    assert core.lookup("recompute", hs, 0, 5 * BS + 1) == 0
    assert core.lookup("some", hs, 0, 5 * BS + 1) == 2 * BS
    assert core.lookup("some", hs, BS, 5 * BS + 1) == 2 * BS  # from its computed tokens on
    assert core.lookup("other", hs, 0, 5 * BS + 1) == 5 * BS


@pytest.mark.parametrize(("params", "limits", "ignored"), [
    (None, RequestLimits(), []),
    ({}, RequestLimits(), []),
    ({"max_offload_tokens": 0, "max_load_tokens": 64}, RequestLimits(0, 64), []),
    ({"max_offload_tokens": -1}, RequestLimits(),
     ["max_offload_tokens must be a non-negative int, got -1; ignored"]),
    ({"max_load_tokens": "0", "max_offload_tokens": True}, RequestLimits(),
     ["max_offload_tokens must be a non-negative int, got True; ignored",
      "max_load_tokens must be a non-negative int, got '0'; ignored"]),
    ({"do_remote_prefill": True}, RequestLimits(), []),  # other connectors' fields: not ours
])
def test_request_limits_from_kv_transfer_params(params: object, limits: RequestLimits,
                                                ignored: list[str]) -> None:
    assert RequestLimits.from_params(params) == (limits, ignored)  # type: ignore[arg-type]
