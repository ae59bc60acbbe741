"""The scheduler core with several KV cache groups (vLLM's hybrid manager): full attention,
sliding window and state groups sharing one block pool, keys per group, prefixes bounded by every
group, from the pool and the disk tier together."""

from __future__ import annotations

import pytest

from kvconnector.offload.groups import CacheGroup, window_blocks
from kvconnector.offload.jobs import JobReport
from kvconnector.offload.scheduler import OffloadScheduler
from transfer.disk.planner import DiskPlanner
from transfer.keys import Namespace

BS = 4
WINDOW = 9  # tokens: a reload keeps ceil(8 / 4) = 2 sliding window blocks before its end
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="hybrid")
GROUPS = (CacheGroup(b"\x00"), CacheGroup(b"\x01", window=WINDOW))
NULL = 0


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def make(num_slots: int = 32) -> OffloadScheduler:
    return OffloadScheduler(NS, num_slots, BS, 1, groups=GROUPS, null_block=NULL)


def complete_step(core: OffloadScheduler) -> None:
    step = core.build_step()
    core.complete(JobReport(done=dict.fromkeys([j.job_id for j in step.stores + step.loads], 1)))


def test_window_blocks_matches_vllm_skipped_blocks() -> None:
    # vLLM frees (n - window + 1) // block_size blocks of an n-token prefix
    for window in range(1, 40):
        for blocks in range(1, 12):
            skipped = max(0, blocks * BS - window + 1) // BS
            assert blocks - skipped == min(blocks, window_blocks(window, BS))


def test_store_keys_are_per_group_and_skip_freed_sliding_blocks() -> None:
    core = make()
    hs = hashes("a", 5)
    full, sliding = [11, 12, 13, 14, 15], [NULL, NULL, 23, 24, 25]
    core.plan_stores("a", hs, [full, sliding], 5 * BS)
    (job,) = core.build_step().stores
    assert job.block_ids == (11, 12, 13, 14, 15, 23, 24, 25)
    keys = [NS.key(b"\x00" + h) for h in hs] + [NS.key(b"\x01" + h) for h in hs[2:]]
    assert core._jobs[job.job_id].keys == keys
    assert len(set(job.slots)) == 8


def test_lookup_needs_every_full_block_but_only_the_window_of_sliding_ones() -> None:
    core = make()
    hs = hashes("a", 6)
    core.plan_stores("a", hs, [[1, 2, 3, 4, 5, 6], [NULL, NULL, NULL, 7, 8, 9]], 6 * BS)
    complete_step(core)
    # Full blocks 0..5 stored, sliding 3..5: a 6-block prefix needs sliding 4, 5 only.
    assert core.lookup("b", hs, 0, 6 * BS + 1) == 6 * BS
    # A 4-block prefix would need sliding 2, 3, and 2 is missing; 5 blocks need 3, 4: present.
    assert core.lookup("c", hs[:5], 0, 5 * BS + 1) == 5 * BS
    # 4 blocks need sliding 2, 3; 3 need 1, 2; 2 need 0, 1; 1 needs 0: all missing
    assert core.lookup("d", hs[:4], 0, 4 * BS + 1) == 0


def test_lookup_never_answers_a_prefix_a_group_would_leave_unwritten() -> None:
    core = make()
    hs = hashes("a", 4)
    core.plan_stores("a", hs, [[1, 2, 3, 4], [NULL, NULL, 7, 8]], 4 * BS)
    complete_step(core)
    assert core.lookup("b", hs, 0, 4 * BS + 1) == 4 * BS
    for n in (1, 2, 3):  # their windows hold sliding blocks 0 or 1, freed before the store
        assert core.lookup("c", hs[:n], 0, n * BS + 1) == 0


def test_load_writes_every_full_block_and_the_sliding_window_after_a_local_hit() -> None:
    core = make()
    hs = hashes("a", 6)
    core.plan_stores("a", hs, [[1, 2, 3, 4, 5, 6], [NULL, NULL, NULL, 7, 8, 9]], 6 * BS)
    complete_step(core)
    # 1 block cached locally; vLLM allocates the window's sliding blocks only (4, 5)
    assert core.lookup("b", hs, BS, 6 * BS + 1) == 5 * BS
    assert core.plan_load("b", hs, [[40, 41, 42, 43, 44, 45], [NULL, NULL, NULL, NULL, 54, 55]],
                          5 * BS) == {"pool": 5}
    (job,) = core.build_step().loads
    assert job.block_ids == (41, 42, 43, 44, 45, 54, 55)
    assert core._jobs[job.job_id].keys == ([NS.key(b"\x00" + h) for h in hs[1:]]
                                           + [NS.key(b"\x01" + h) for h in hs[4:]])


def test_failed_load_drops_every_group_key_and_stores_again() -> None:
    core = make()
    hs = hashes("a", 3)
    core.plan_stores("a", hs, [[1, 2, 3], [NULL, 5, 6]], 3 * BS)
    complete_step(core)
    assert core.lookup("b", hs, 0, 3 * BS + 1) == 3 * BS
    core.plan_load("b", hs, [[7, 8, 9], [NULL, 10, 11]], 3 * BS)
    (job,) = core.build_step().loads
    core.complete(JobReport(failed={job.job_id: 1}))
    assert core.lookup("c", hs, 0, 3 * BS + 1) == 0
    core.plan_stores("b", hs, [[7, 8, 9], [NULL, 10, 11]], 3 * BS)  # recomputed: stored again
    assert core.build_step().stores[0].block_ids == (7, 8, 9, 10, 11)


def test_store_reading_sliding_blocks_is_flushed_once_vllm_frees_them() -> None:
    core = make()
    hs = hashes("a", 4)
    core.plan_stores("a", hs, [[1, 2, 3, 4], [21, 22, 23, 24]], 4 * BS)
    (job,) = core.build_step().stores
    # sliding block 0 leaves the window at n - 9 + 1 >= 4, n = 12
    core.flush_windows({"a": 11})
    assert core.build_step().flush == []
    core.flush_windows({"a": 12})
    assert core.build_step().flush == [job.job_id]
    core.flush_windows({"a": 40})  # flushed once
    assert core.build_step().flush == []


def test_a_finished_request_flushes_its_old_sliding_stores_not_its_last_ones() -> None:
    core = make()
    hs = hashes("a", 3)
    core.plan_stores("a", hs[:2], [[1, 2], [21, 22]], 2 * BS)
    (first,) = core.build_step().stores
    # vLLM frees sliding blocks 0 and 1 at the finish (before handing over the table)
    assert core.request_finished("a", hs, [[1, 2, 3], [NULL, NULL, 23]], 3 * BS) is True
    step = core.build_step()
    assert [j.block_ids for j in step.stores] == [(3, 23)] and step.held == ["a"]
    core.flush_windows({})  # the request is gone: its store reading freed blocks is flushed
    assert core.build_step().flush == [first.job_id]


class LeadingCountsOnly(DiskPlanner):
    """A tier that answers how many leading keys it holds, not which (as a remote store)."""

    name = "counts"
    answers_per_key = False

    def __init__(self) -> None:
        super().__init__(NS, 4, "lru", "evict")


def test_bad_group_configurations_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="distinct key prefixes"):
        OffloadScheduler(NS, 4, BS, 1, groups=(CacheGroup(b"x"), CacheGroup(b"x", window=4)))
    with pytest.raises(ValueError, match="sliding window is a positive int, got 0"):
        OffloadScheduler(NS, 4, BS, 1, groups=(CacheGroup(b"a"), CacheGroup(b"b", window=0)))
    with pytest.raises(ValueError, match="tier 'counts' with 2 KV cache groups is not supported"):
        OffloadScheduler(NS, 4, BS, 1, groups=GROUPS, tiers=[LeadingCountsOnly()])
    with pytest.raises(ValueError, match="1 block tables for 2 KV cache groups"):
        make().plan_stores("a", hashes("a", 1), [5], BS)


def test_a_state_group_needs_its_block_at_the_prefix_end_only() -> None:
    # vLLM's align mode: the state group's block at position i holds the state after block i;
    # the others in its table may be its null block (not kept).
    groups = (CacheGroup(b"\x00", state=True), CacheGroup(b"\x01"))
    core = OffloadScheduler(NS, 32, BS, 1, groups=groups, null_block=NULL)
    hs = hashes("s", 6)
    core.plan_stores("a", hs, [[NULL, 32, NULL, 34, NULL, 36], [1, 2, 3, 4, 5, 6]], 6 * BS)
    (job,) = core.build_step().stores
    assert job.block_ids == (32, 34, 36, 1, 2, 3, 4, 5, 6)  # null state blocks skipped
    # vLLM frees state block 1 once 2 blocks and a token are computed (it keeps the last
    # state only): the store reading it is finished before that step's forward
    core.flush_windows({"a": 2 * BS})
    assert core.build_step().flush == []
    core.flush_windows({"a": 2 * BS + 1})
    assert core.build_step().flush == [job.job_id]
    core.complete(JobReport(done={job.job_id: 1}))
    # 6 blocks: state 5 stored; 5 blocks: state 4 missing, 4 blocks: state 3 stored
    assert core.lookup("b", hs, 0, 6 * BS + 1) == 6 * BS
    assert core.lookup("c", hs[:5], 0, 5 * BS + 1) == 4 * BS
    # the load writes every attention block and the one state block
    assert core.plan_load("c", hs[:5], [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]],
                          4 * BS) == {"pool": 4}
    (load,) = core.build_step().loads
    assert load.block_ids == (43, 50, 51, 52, 53)
    with pytest.raises(ValueError, match="a state group has no window"):
        OffloadScheduler(NS, 4, BS, 1, groups=(CacheGroup(b"a", window=4, state=True),
                                               CacheGroup(b"b")))


def test_several_groups_load_from_the_pool_and_the_disk_together() -> None:
    # A state group and a full attention group, some blocks in the pool, the rest on disk (a
    # restarted engine's slab, found again): every block a group needs from either tier.
    groups = (CacheGroup(b"\x00", state=True), CacheGroup(b"\x01"))
    hs = hashes("d", 5)
    keys = OffloadScheduler(NS, 4, BS, 1, groups=groups)._keys
    state_keys, full_keys = keys(groups[0], hs), keys(groups[1], hs)
    on_disk = {full_keys[2]: 0, full_keys[3]: 1, state_keys[3]: 2, state_keys[1]: 3}
    core = OffloadScheduler(NS, 8, BS, 1, groups=groups, null_block=NULL,
                            tiers=[DiskPlanner(NS, 8, "lru", "evict", on_disk)])
    core.plan_stores("a", hs[:2], [[NULL, NULL], [1, 2]], 2 * BS)
    complete_step(core)  # full blocks 0 and 1 in the pool
    assert core.lookup("b", hs, 0, 5 * BS + 1) == 4 * BS  # state 3: disk; full 0-1 pool, 2-3 disk
    assert core.plan_load("b", hs, [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]],
                          4 * BS) == {"pool": 2, "disk": 2}  # positions 2, 3 read from disk
    (load,) = core.build_step().loads
    assert load.block_ids == (50, 51, 43, 52, 53)  # the pool's, then the disk's
    (read,) = load.fetches
    assert read.tier == "disk" and not read.is_write
    assert set(read.keys) == {state_keys[3], full_keys[2], full_keys[3]}
    assert sorted(read.places) == [0, 1, 2]
    assert len(load.slots) == 5 and not load.fail
    # a pool of 4 slots, 2 pinned by the load, has room to read 2 blocks, not 3: the prefix
    # of 4 is no hit; nor 3 (no state after block 2); 2 is (the state after block 1 read)
    small = OffloadScheduler(NS, 4, BS, 1, groups=groups, null_block=NULL,
                             tiers=[DiskPlanner(NS, 8, "lru", "evict", on_disk)])
    small.plan_stores("a", hs[:2], [[NULL, NULL], [1, 2]], 2 * BS)
    complete_step(small)
    assert small.lookup("b", hs, 0, 5 * BS + 1) == 2 * BS
