"""The remote tier's vLLM-free parts: scheduler planning of fetches and write-through, the
asynchronous lookups, and the worker core fetching and putting through a real store process."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import transfer.remote.planner as remote_planner
from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import KVLayout
from kvconnector.offload.jobs import JobReport, TransferEvents
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from kvconnector.servers.store import StoreProcess
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace
from transfer.remote.planner import RemoteLookups, RemotePlanner
from transfer.remote.settings import RemoteSettings
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security
from transfer.remote.worker import RemoteWorker
from transfer.tier import TierOp

BS = 4
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def settings(url: str, deadline_s: float = 0.3, timeout_s: float = 1.0,
             only: bool = False) -> RemoteSettings:
    return RemoteSettings(url, Security.none(), deadline_s, timeout_s, only=only)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity="16MiB") as process:
        yield process


MakeCore = Callable[..., OffloadScheduler]


@pytest.fixture
def make_core(store: StoreProcess) -> Iterator[MakeCore]:
    """OffloadScheduler(num_slots, num_workers=1, only=False) with the store as its one tier;
    closed (its lookup connection) at the end."""
    made: list[OffloadScheduler] = []

    def make(num_slots: int, num_workers: int = 1, only: bool = False) -> OffloadScheduler:
        tier = RemotePlanner(settings(store.url, only=only), NS.digest)
        made.append(OffloadScheduler(NS, num_slots, BS, num_workers, tiers=[tier]))
        return made[-1]

    yield make
    for core in made:
        core.close()


def put_blocks(url: str, hs: list[bytes]) -> None:
    """Put blocks of `hs` into the store under the scheduler's keys (what another engine
    wrote through)."""
    with StoreClient(url, Security.none(), namespace=NS,
                     pool=torch.zeros(len(hs), 64, dtype=torch.uint8)) as client:
        assert client.put(NS.keys(hs), list(range(len(hs)))).all_ok


def wait_for(poll, timeout_s: float = 5.0):  # noqa: ANN001, ANN201 - a tiny test helper
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = poll()
        if value is not None:
            return value
        time.sleep(0.005)
    raise AssertionError("no answer in time")


def write_op(core: OffloadScheduler) -> TierOp:
    """The one write the next step carries."""
    (op,) = core.build_step().writes
    assert op.tier == "remote" and op.is_write
    return op


# -- scheduler core ----------------------------------------------------------------------------
def test_plan_load_splits_cpu_hits_and_remote_fetches(store: StoreProcess,
                                                      make_core: MakeCore) -> None:
    core = make_core(8)
    hs = hashes("a", 4)
    put_blocks(store.url, hs[2:3])  # the store holds the third block only
    core.plan_stores("a", hs[:2], [1, 2], 2 * BS)
    store_job = core.build_step().stores[0]
    core.complete(JobReport(done={store_job.job_id: 1}))
    write = write_op(core)  # write-through: the stored keys out of their slots
    assert (write.keys, write.slots) == (tuple(NS.keys(hs[:2])), store_job.slots)
    # Readable while the put runs; the store is asked for the keys past the pool's only (it
    # lacks the first two, so a lookup of all four would find none there).
    assert core.lookup("b", hs, 0, 4 * BS + 1) is None  # the store's answer is in flight
    assert wait_for(lambda: core.lookup("b", hs, 0, 4 * BS + 1)) == 3 * BS
    assert core.plan_load("b", hs, [5, 6, 7, 8, 9], 3 * BS) == {"pool": 2, "remote": 1}
    load = core.build_step().loads[0]
    fetch_key = NS.key(hs[2])
    assert (load.block_ids, load.fetch_keys, load.fail) == ((5, 6, 7), (fetch_key,), False)
    assert [(op.tier, op.op_id, op.is_write) for op in load.fetches] == \
        [("remote", load.job_id, False)]
    assert load.fetch_slots == load.fetches[0].slots and len(load.slots) == 3
    assert core.index.is_being_stored(fetch_key)  # its slot is reserved while the get runs
    core.complete(JobReport(done={load.job_id: 1}))
    assert core.index.contains(fetch_key)  # a good fetch stays in the CPU tier
    assert core.has_jobs()  # the write-through is not reported yet
    core.complete(JobReport(written={write.op_id: 1}))
    assert not core.has_jobs()


def test_failed_fetch_forgets_the_key_and_remote_hits_are_capped_by_room(
        store: StoreProcess, make_core: MakeCore) -> None:
    core = make_core(1)
    hs = hashes("a", 2)
    put_blocks(store.url, hs)
    assert wait_for(lambda: core.lookup("b", hs, 0, 2 * BS)) == BS
    assert core.plan_load("b", hs, [3, 4], BS) == {"remote": 1}
    load = core.build_step().loads[0]
    core.complete(JobReport(failed={load.job_id: 1}))
    assert len(core.index) == 0 and core.index.num_free == 1
    # Two remote hits, one slot: only the one that fits is offered; its load succeeds and
    # nothing leaks.
    assert wait_for(lambda: core.lookup("c", hs, 0, 2 * BS + 1)) == BS
    with pytest.raises(ValueError, match="cannot load"):
        core.plan_load("c", hs, [5, 6], 2 * BS)
    assert wait_for(lambda: core.lookup("c", hs, 0, 2 * BS + 1)) == BS
    assert core.plan_load("c", hs, [5, 6], BS) == {"remote": 1}
    load = core.build_step().loads[0]
    assert not load.fail and load.fetch_keys == (NS.key(hs[0]),) and load.block_ids == (5,)
    core.complete(JobReport(done={load.job_id: 1}))
    assert not core.has_jobs() and len(core.index) == 1 and core.index.contains(NS.key(hs[0]))
    assert core.index.num_reclaimable == 1  # the fetched block is idle: no pin left


def test_a_failed_fetchs_keys_are_refused_until_written_anew(
        store: StoreProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = RemotePlanner(settings(store.url), NS.digest)
    try:
        hs = hashes("r", 3)
        keys = NS.keys(hs)
        put_blocks(store.url, hs)
        assert wait_for(lambda: tier.lookup("a", keys)) == 3
        tier.complete_fetch(1, keys, keys[1:2])  # the second came back bad
        assert wait_for(lambda: tier.lookup("b", keys)) == 1  # ends before it
        assert tier.lookup("c", keys[1:]) == 0  # at once, no round trip
        assert tier.plan_fetch(2, keys, [0, 1, 2]) is None
        assert tier.plan_fetch(3, keys[2:], [2]) is not None
        op = tier.plan_write(4, keys[1:2], [1], evicted=False)
        assert op is not None and op.keys == tuple(keys[1:2])
        tier.complete_write(4, keys[1:2])  # the put failed: still refused
        assert tier.lookup("d", keys[1:]) == 0
        tier.plan_write(5, keys[1:2], [1], evicted=False)
        tier.complete_write(5, [])  # written anew: offered again
        assert wait_for(lambda: tier.lookup("e", keys)) == 3
        # At most MAX_REFUSED keys are refused, the oldest forgotten first.
        monkeypatch.setattr(remote_planner, "MAX_REFUSED", 2)
        tier.complete_fetch(6, keys, keys)
        assert tier.lookup("f", keys[1:]) == 0 and tier.plan_fetch(7, keys[:1], [0]) is not None
    finally:
        tier.close()


def test_write_through_pins_until_every_rank_reported_its_put(make_core: MakeCore) -> None:
    core = make_core(2, num_workers=2)
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0].job_id
    # The write is planned once every rank's copy is done, not before.
    core.complete(JobReport(done={job: 1}))
    assert core.build_step().writes == []
    core.complete(JobReport(done={job: 1}))
    write = write_op(core)
    assert write.keys == tuple(NS.keys(hs))
    core.complete(JobReport(written={write.op_id: 1}))  # rank 0 put; rank 1's still runs
    assert core.index.contains(NS.key(hs[0])) and core.has_jobs()
    assert core.index.prepare_store(NS.keys(hashes("b", 2))).slots == []  # slots still pinned
    core.complete(JobReport(written={write.op_id: 1}))
    assert not core.has_jobs() and core.index.num_reclaimable == 2
    with pytest.raises(ValueError, match="is unknown"):
        core.complete(JobReport(written={write.op_id: 1}))
    # A copy that failed on one rank: nothing to write, nothing pinned, no report awaited.
    core.plan_stores("c", hashes("c", 1), [3], BS)
    job = core.build_step().stores[0].job_id
    core.complete(JobReport(done={job: 1}, failed={job: 1}))
    assert core.build_step().writes == [] and not core.has_jobs()
    assert not core.index.contains(NS.key(hashes("c", 1)[0]))
    assert core.index.num_reclaimable == 2


def test_remote_only_keeps_the_pool_empty(store: StoreProcess, make_core: MakeCore) -> None:
    core = make_core(4, only=True)
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    store_job = core.build_step().stores[0]
    core.complete(JobReport(done={store_job.job_id: 1}))
    write = write_op(core)
    assert len(core.index) == 2 and core.has_jobs()  # pinned while the put reads the slots
    core.complete(JobReport(written={write.op_id: 1}))
    assert len(core.index) == 0 and core.index.num_free == 4 and not core.has_jobs()
    # Every hit must come from the store: none while it lacks them, and a fetched block only
    # passes through the pool.
    assert wait_for(lambda: core.lookup("b", hs, 0, 2 * BS)) == 0
    put_blocks(store.url, hs[:1])
    assert wait_for(lambda: core.lookup("c", hs, 0, 2 * BS)) == BS
    assert core.plan_load("c", hs, [5, 6], BS) == {"remote": 1}
    load = core.build_step().loads[0]
    core.complete(JobReport(done={load.job_id: 1}))
    assert len(core.index) == 0 and core.index.num_free == 4 and not core.has_jobs()


# -- lookups -------------------------------------------------------------------------------------
def test_lookups_answer_later_then_zero_when_the_store_is_down(store: StoreProcess) -> None:
    keys = NS.keys(hashes("a", 3))
    with StoreClient(store.url, Security.none(), namespace=NS,
                     pool=torch.zeros(4, 64, dtype=torch.uint8)) as client:
        assert client.put(keys[:2], [0, 1]).all_ok
    lookups = RemoteLookups(settings(store.url), NS.digest)
    try:
        assert lookups.poll("r", keys) is None  # in flight: vLLM asks again later
        assert wait_for(lambda: lookups.poll("r", keys)) == 2
        store.kill()
        started = time.monotonic()
        assert lookups.poll("s", keys) is None
        assert wait_for(lambda: lookups.poll("s", keys)) == 0  # late: the CPU tier's answer
        assert time.monotonic() - started < 0.3 + 0.5
        assert lookups.failures == 1
        assert lookups.poll("t", keys) == 0  # known down: answered at once, nothing sent
    finally:
        lookups.close()


# -- worker core ---------------------------------------------------------------------------------
def make_worker(url: str, writes: bool = True) -> tuple[OffloadWorker, dict[str, torch.Tensor]]:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, block_size=BS,
                      dtype=torch.bfloat16, order="BLNHC")
    caches = {f"l{i}": v for i, v in enumerate(allocate(layout, num_blocks=8).layer_views())}
    worker = OffloadWorker(caches, 4, backend=ThreadBackend())
    worker.attach(RemoteWorker(settings(url), NS.digest, writes))
    return worker, caches


def block(caches: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    return torch.cat([v[b].reshape(-1).view(torch.uint8) for v in caches.values()])


def settle(worker: OffloadWorker, core: OffloadScheduler) -> TransferEvents:
    """Step until every job and write is done (what a finished job plans, such as a
    write-through, goes out in the next step); the events of all polls."""
    events = TransferEvents()
    for _ in range(400):
        worker.drain()
        events.update(worker.poll())
        report = worker.take_report()
        if not report.is_empty():
            core.complete(report)
        step = core.build_step()
        worker.start_loads(step)
        worker.submit_stores(step)
        if not core.has_jobs():
            return events
    raise AssertionError("jobs did not finish")


def test_worker_writes_through_and_fetches_bit_exact(store: StoreProcess,
                                                     make_core: MakeCore) -> None:
    hs = hashes("w", 2)
    writer, wcaches = make_worker(store.url)
    reader, rcaches = make_worker(store.url)
    try:
        for b in (1, 2):
            for view in wcaches.values():
                page = view[b].view(torch.uint8)
                page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8))
        wcore = make_core(4)
        wcore.plan_stores("a", hs, [1, 2], 2 * BS)
        writer.submit_stores(wcore.build_step())
        settle(writer, wcore)
        with StoreClient(store.url, Security.none()) as client:
            assert client.stats()["blocks"] == 2
        assert writer.failures["remote"] == 0
        rcore = make_core(4)
        for view in rcaches.values():
            view.view(torch.uint8).fill_(0xA5)
        assert wait_for(lambda: rcore.lookup("b", hs, 0, 2 * BS + 1)) == 2 * BS
        assert rcore.plan_load("b", hs, [5, 6], 2 * BS) == {"remote": 2}
        reader.start_loads(rcore.build_step())
        events = settle(reader, rcore)
        assert events.finished_loads == {"b"} and not events.failed_loads
        assert reader.failures["remote"] == 0
        for src, dst in ((1, 5), (2, 6)):
            assert torch.equal(block(wcaches, src), block(rcaches, dst))
        # The store gone after the lookup: the fetch fails as a load error naming the GPU
        # blocks.
        rcore.reset()
        assert wait_for(lambda: rcore.lookup("c", hs, 0, 2 * BS + 1)) == 2 * BS
        store.kill()
        assert rcore.plan_load("c", hs, [3, 4], 2 * BS) == {"remote": 2}
        reader.start_loads(rcore.build_step())
        events = settle(reader, rcore)
        assert (events.failed_loads, events.failed_block_ids) == ({"c"}, {3, 4})
        assert reader.failures["remote"] == 1
    finally:
        writer.close()
        reader.close()


def test_a_worker_that_does_not_write_reports_its_puts_and_sends_nothing(
        store: StoreProcess, make_core: MakeCore) -> None:
    # MLA at TP > 1: rank 0 puts the bytes every rank holds; the others only report.
    worker, caches = make_worker(store.url, writes=False)
    try:
        core = make_core(4)
        core.plan_stores("a", hashes("n", 2), [1, 2], 2 * BS)
        worker.submit_stores(core.build_step())
        settle(worker, core)  # returns only once the write is reported
        with StoreClient(store.url, Security.none()) as client:
            stats = client.stats()
        assert (stats["blocks"], stats["requests_put"]) == (0, 0)
        assert core.index.contains(NS.key(hashes("n", 2)[1]))  # the CPU tier still holds them
        assert worker.failures["remote"] == 0
    finally:
        worker.close()
