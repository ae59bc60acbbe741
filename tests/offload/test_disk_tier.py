"""The disk tier under the offload cores: cache -> pool -> disk -> pool -> cache, write-through
and write-back (evict), a restart in a new process, corrupt and failing blocks, capacity."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_offload_worker import (
    BS,
    NS,
    POISON,
    assert_blocks_equal,
    block_bytes,
    fill_random,
    make_caches,
    poison,
    run_step,
)

from kvconnector.offload.jobs import JobReport
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from transfer.disk.io import DiskIO
from transfer.disk.planner import DiskPlanner, restored_blocks
from transfer.disk.slab import DiskError, SlabFile, open_direct, slab_path
from transfer.disk.worker import DiskWorker

DISK_SLOTS = 16
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk"
    path.mkdir()
    try:
        import os
        os.close(open_direct(path / ".probe", os.O_RDWR | os.O_CREAT))
    except DiskError as exc:
        pytest.skip(f"no O_DIRECT under {path}: {exc}")
    return path


class GatedSlab(SlabFile):
    """Writes wait for `gate` when it is set."""

    gate: threading.Event | None = None

    def write(self, first_slot: int, keys: Sequence[bytes], datas: Sequence[memoryview],
              footers: Sequence[memoryview], sums: Sequence[int | None] | None = None) -> None:
        if self.gate is not None:
            assert self.gate.wait(60)
        super().write(first_slot, keys, datas, footers, sums)


def tier(directory: Path, caches: dict[str, torch.Tensor], pool_slots: int, write_policy: str,
         disk_slots: int = DISK_SLOTS, slab_cls: type[SlabFile] = SlabFile,
         ) -> tuple[OffloadScheduler, OffloadWorker]:
    """A scheduler core and a worker with a disk tier; the index finds what the slab holds."""
    worker = OffloadWorker(caches, num_slots=pool_slots)
    stored = restored_blocks(directory, NS.digest, [NS.digest], disk_slots)
    planner = DiskPlanner(NS, disk_slots, "lru", write_policy, stored)
    core = OffloadScheduler(NS, pool_slots, BS, 1, tiers=[planner])
    slab = slab_cls(directory, NS.digest, worker.block_bytes, disk_slots)
    worker.attach(DiskWorker(DiskIO(slab, worker.pool.slots, threads=3)))
    return core, worker


def settle(core: OffloadScheduler, worker: OffloadWorker) -> None:
    """Step until every job (stores, spills, loads) is reported."""
    for _ in range(10):
        run_step(core, worker)
        if not core.has_jobs():
            return
    raise AssertionError("jobs still in flight after 10 steps")


def hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def store(core: OffloadScheduler, worker: OffloadWorker, req: str, hs: list[bytes],
          blocks: list[int]) -> None:
    core.plan_stores(req, hs, blocks, len(hs) * BS)
    settle(core, worker)


def load(core: OffloadScheduler, worker: OffloadWorker, req: str, hs: list[bytes],
         blocks: list[int], expect: tuple[int, int, int]) -> set[int]:
    """Look up and load `hs` into `blocks`; returns the GPU blocks that failed to load."""
    assert core.lookup(req, hs, 0, len(hs) * BS + 1) == sum(expect) * BS
    split = {name: n for name, n in zip(("pool", "disk", "remote"), expect, strict=True) if n}
    assert core.plan_load(req, hs, blocks, sum(expect) * BS) == split
    step = core.build_step()
    worker.flush(step)
    worker.start_loads(step)
    worker.submit_stores(step)
    failed: set[int] = set()
    for _ in range(3):  # a read finished in drain starts its copy in poll
        worker.drain()
        events = worker.poll()
        core.complete(worker.take_report())
        failed |= events.failed_block_ids
        if req in events.finished_loads:
            return failed
    raise AssertionError(f"the load of {req} did not finish")


@pytest.mark.parametrize("write_policy", ["through", "evict"])
def test_evicted_blocks_come_back_from_disk_bit_exact(disk: Path, write_policy: str) -> None:
    caches = make_caches("BLNHC")
    core, worker = tier(disk, caches, 3, write_policy)
    try:
        a = fill_random(caches, [0, 1, 2], seed=11)
        store(core, worker, "a", hashes("a", 3), [0, 1, 2])
        b = fill_random(caches, [3, 4, 5], seed=12)
        store(core, worker, "b", hashes("b", 3), [3, 4, 5])  # evicts a from the pool
        assert [core.index.contains(k) for k in NS.keys(hashes("a", 3))] == [False] * 3
        assert all(core.tier("disk").index.contains(k) for k in NS.keys(hashes("a", 3)))
        poison(caches, list(range(12)))
        assert load(core, worker, "a2", hashes("a", 3), [6, 7, 8], (0, 3, 0)) == set()
        assert_blocks_equal(caches, [6, 7, 8], a)
        counters = core.take_counters()
        assert counters.disk_hit_tokens == 3 * BS and counters.disk_read_bytes == \
            3 * worker.block_bytes
        # through: a and b once stored; evict: a when b's store evicted it, b when the load did
        assert counters.disk_write_bytes == 6 * worker.block_bytes
        assert counters.disk_read_seconds > 0 and counters.disk_write_seconds > 0
        # b, evicted by the load, is on disk too (write-through: written; evict: spilled).
        assert load(core, worker, "b2", hashes("b", 3), [9, 10, 11], (0, 3, 0)) == set()
        assert_blocks_equal(caches, [9, 10, 11], b)
        assert not core.has_jobs() and worker.jobs_in_flight == 0
    finally:
        worker.close()


def test_evict_policy_writes_a_victim_before_its_slot_is_stored_again(disk: Path) -> None:
    caches = make_caches("BLNHC")
    core, worker = tier(disk, caches, 2, "evict", slab_cls=GatedSlab)
    slab = worker.tiers["disk"].io.slab
    try:
        a = fill_random(caches, [0, 1], seed=21)
        store(core, worker, "a", hashes("a", 2), [0, 1])
        assert not core.has_jobs() and len(core.tier("disk").index) == 0
        b = fill_random(caches, [2, 3], seed=22)
        slab.gate = threading.Event()  # hold the spill of a
        core.plan_stores("b", hashes("b", 2), [2, 3], 2 * BS)
        step = core.build_step()
        assert len(step.writes) == 1
        assert sorted(step.writes[0].slots) == sorted(step.stores[0].slots)
        worker.start_loads(step)
        worker.submit_stores(step)
        assert worker.engine.inflight_store_bytes == 0  # b's copy waits behind the spill
        assert worker.poll().finished_sending == set() and worker.jobs_in_flight == 2
        slab.gate.set()
        worker.drain()
        worker.poll()
        core.complete(worker.take_report())
        assert not core.has_jobs()
        poison(caches, list(range(12)))
        assert load(core, worker, "a2", hashes("a", 2), [4, 5], (0, 2, 0)) == set()
        assert_blocks_equal(caches, [4, 5], a)  # a spilled after b's copy would read as b
        assert load(core, worker, "b2", hashes("b", 2), [6, 7], (0, 2, 0)) == set()
        assert_blocks_equal(caches, [6, 7], b)
    finally:
        worker.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["BLNHC", "LBNHC"])
def test_restart_in_a_new_process_finds_the_blocks(disk: Path, device: str, order: str) -> None:
    """cache -> pool -> disk in one process; a fresh pool in a new one -> cache, every byte."""
    script = f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]
        from pathlib import Path
        from test_disk_tier import tier, store, hashes
        from test_offload_worker import make_caches, fill_random
        caches = make_caches({order!r}, {device!r})
        core, worker = tier(Path({str(disk)!r}), caches, 8, "through")
        fill_random(caches, [1, 3, 5, 7], seed=31)
        store(core, worker, "a", hashes("a", 4), [1, 3, 5, 7])
        assert core.take_counters().disk_write_bytes == 4 * worker.block_bytes
        worker.close()
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = fill_random(make_caches(order), [1, 3, 5, 7], seed=31)
    caches = make_caches(order, device)
    poison(caches, list(range(12)))
    core, worker = tier(disk, caches, 8, "through")
    try:
        assert len(core.tier("disk").index) == 4
        assert load(core, worker, "b", hashes("a", 4), [0, 2, 4, 6], (0, 4, 0)) == set()
        assert_blocks_equal(caches, [0, 2, 4, 6], expected)
        assert core.index.lookup_prefix(NS.keys(hashes("a", 4))) == 4  # now in the pool too
    finally:
        worker.close()


def test_a_corrupt_block_is_a_load_error_and_leaves_the_disk_index(disk: Path) -> None:
    caches = make_caches("BLNHC")
    core, worker = tier(disk, caches, 4, "through")
    try:
        a = fill_random(caches, [0, 1, 2], seed=41)
        store(core, worker, "a", hashes("a", 3), [0, 1, 2])
    finally:
        worker.close()
    core, worker = tier(disk, caches, 4, "through")  # a restart: a is on disk only
    try:
        slot = core.tier("disk").index.prepare_load(NS.keys(hashes("a", 3))[1:2]).slots[0]
        core.tier("disk").index.complete_load(NS.keys(hashes("a", 3))[1:2])
        with slab_path(disk, NS.digest).open("r+b") as f:
            offset = worker.tiers["disk"].io.slab.offset(slot) + 100
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 1]))
        poison(caches, list(range(12)))
        failed = load(core, worker, "b", hashes("a", 3), [4, 5, 6], (0, 3, 0))
        assert failed == {5, 6}  # vLLM recomputes from the first bad block
        assert_blocks_equal(caches, [4], a[:1])
        for b in (5, 6):  # the bad block never reached the cache, nor did the one after it
            assert all(bool((page == POISON).all()) for page in block_bytes(caches, b))
        keys = NS.keys(hashes("a", 3))
        assert [core.tier("disk").index.contains(k) for k in keys] == [True, False, True]
        counters = core.take_counters()
        assert (counters.disk_failed_reads, counters.failed_loads) == (1, 1)
        assert not core.has_jobs() and worker.jobs_in_flight == 0
    finally:
        worker.close()


def test_disk_capacity_evicts_and_a_lookup_takes_only_what_the_pool_can_hold(disk: Path) -> None:
    caches = make_caches("BLNHC")
    core, worker = tier(disk, caches, 2, "through", disk_slots=3)
    try:
        store(core, worker, "a", hashes("a", 2), [0, 1])
        store(core, worker, "b", hashes("b", 2), [2, 3])  # disk: 3 slots, a's tail goes
        keys = NS.keys(hashes("a", 2) + hashes("b", 2))
        assert [core.tier("disk").index.contains(k) for k in keys] == [True, False, True, True]
        assert core.take_counters().disk_evictions == 1
        core.plan_stores("c", hashes("c", 1), [4], BS)  # evicts b1 from the pool: room 1
        # b0 is in the pool and b1 on disk, but the load pins b0: no slot left to read b1 into.
        assert core.lookup("d", hashes("b", 2), 0, 100) == 1 * BS
        assert core.lookup("e", hashes("a", 1), 0, 100) == 1 * BS  # a0 on disk, room 1
        core.plan_stores("f", hashes("f", 1), [5], BS)  # the last pool slot: room 0
        assert core.lookup("e", hashes("a", 1), 0, 100) == 0
        assert core._lookups["e"].tier_hits == []  # no room: no tier below is asked
        settle(core, worker)  # c and f written through: a0 and b0 leave the disk
        assert core.index.num_reclaimable == 2 and core.take_counters().disk_evictions == 2
    finally:
        worker.close()


def test_reset_erases_the_disk_so_a_restart_finds_nothing(disk: Path) -> None:
    caches = make_caches("BLNHC")
    core, worker = tier(disk, caches, 4, "through")
    try:
        fill_random(caches, [0, 1], seed=51)
        store(core, worker, "a", hashes("a", 2), [0, 1])
        assert len(restored_blocks(disk, NS.digest, [NS.digest], DISK_SLOTS)) == 2
        core.reset()
        assert len(core.tier("disk").index) == 0 and core.lookup("b", hashes("a", 2), 0, 100) == 0
        step, _ = run_step(core, worker)
        assert step.erase == ["disk"]
        assert restored_blocks(disk, NS.digest, [NS.digest], DISK_SLOTS) == {}
        fill_random(caches, [2], seed=52)
        store(core, worker, "c", hashes("c", 1), [2])  # the erased slab takes blocks again
    finally:
        worker.close()
    core, worker = tier(disk, caches, 4, "through")
    try:
        assert len(core.tier("disk").index) == 1 and core.tier("disk").index.contains(NS.key(b"c0"))
    finally:
        worker.close()


# -- the scheduler core alone: corners a real engine hits by chance ------------------------------
def test_a_disk_hit_is_pinned_before_the_pool_writes_its_victims_there() -> None:
    # Pool of one slot holding b0, disk of one slot holding a0 (write-back). Loading a0 evicts
    # b0 from the pool, whose write-back wants the disk's only slot: a0 is pinned first, so b0 is
    # not placed and the load reads a0 (before, b0's write evicted a0 and the load failed).
    a0, b0 = NS.key(b"a0"), NS.key(b"b0")
    core = OffloadScheduler(NS, 1, BS, 1, tiers=[DiskPlanner(NS, 1, "lru", "evict", {a0: 0})])
    core.plan_stores("b", [b"b0"], [0], BS)
    (store,) = core.build_step().stores
    core.complete(JobReport(done={store.job_id: 1}))
    assert core.lookup("a", [b"a0"], 0, BS + 1) == BS
    assert core.plan_load("a", [b"a0"], [3], BS) == {"disk": 1}
    step = core.build_step()
    (load,) = step.loads
    assert not load.fail and [op.keys for op in load.fetches] == [(a0,)]
    assert step.writes == []  # b0 found no disk slot: it is gone, a0 stays
    core.complete(JobReport(done={load.job_id: 1}))
    assert core.tier("disk").index.contains(a0) and core.index.contains(a0)
    assert not core.index.contains(b0) and not core.tier("disk").index.contains(b0)


def test_a_bad_disk_block_reported_by_every_rank_in_turn_is_dropped_once() -> None:
    a0 = NS.key(b"a0")
    core = OffloadScheduler(NS, 4, BS, 2, tiers=[DiskPlanner(NS, 4, "lru", "evict", {a0: 0})])
    assert core.lookup("a", [b"a0"], 0, BS + 1) == BS
    core.plan_load("a", [b"a0"], [3], BS)
    (load,) = core.build_step().loads
    for _ in range(2):  # rank 0, then rank 1 a step later, each with the same bad key
        core.complete(JobReport(failed={load.job_id: 1}, bad={load.job_id: [a0]}))
    counters = core.take_counters()
    assert (counters.disk_failed_reads, counters.failed_loads) == (1, 1)
    assert not core.tier("disk").index.contains(a0) and not core.has_jobs()


def test_a_reset_during_a_store_writes_nothing_through() -> None:
    core = OffloadScheduler(NS, 4, BS, 1, tiers=[DiskPlanner(NS, 4, "lru", "through")])
    core.plan_stores("a", [b"a0", b"a1"], [0, 1], 2 * BS)
    step = core.build_step()
    core.reset()  # reset_cache while the store copies: its keys drain, none may come back
    core.complete(JobReport(done={step.stores[0].job_id: 1}))
    assert core.build_step().writes == [] and not core.has_jobs()
    assert core.lookup("b", [b"a0", b"a1"], 0, 2 * BS + 1) == 0
