"""The remote tier's vLLM-free parts: scheduler planning of fetches and write-through, the
asynchronous lookups, and the worker core fetching and putting through a real store process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import KVLayout
from kvconnector.offload.jobs import JobReport
from kvconnector.offload.remote_tier import RemoteFetcher, RemoteLookups, RemoteSettings
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security
from transfer.remote.store.testing import StoreProcess

BS = 4
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def settings(url: str, deadline_s: float = 0.3, timeout_s: float = 1.0) -> RemoteSettings:
    return RemoteSettings(url, Security.none(), deadline_s, timeout_s, only=False)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity="16MiB") as process:
        yield process


def wait_for(poll, timeout_s: float = 5.0):  # noqa: ANN001, ANN201 - a tiny test helper
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = poll()
        if value is not None:
            return value
        time.sleep(0.005)
    raise AssertionError("no answer in time")


# -- scheduler core ----------------------------------------------------------------------------
def test_plan_load_splits_cpu_hits_and_remote_fetches() -> None:
    core = OffloadScheduler(NS, 8, BS, 1, remote=True)
    hs = hashes("a", 4)
    core.plan_stores("a", hs[:2], [1, 2], 2 * BS)
    store = core.build_step().stores[0]
    assert store.keys == tuple(NS.keys(hs[:2]))  # write-through needs the keys
    core.complete(JobReport(done={store.job_id: 1}))
    assert core.lookup("b", hs, 0, 4 * BS + 1) == 2 * BS  # readable while the put runs
    assert core.remote_candidates("b") == NS.keys(hs[2:])
    core.set_remote_hits("b", 1)
    assert core.plan_load("b", hs, [5, 6, 7, 8, 9], 3 * BS) == (2, 0, 1)
    load = core.build_step().loads[0]
    assert (load.block_ids, load.keys, load.fail) == ((5, 6, 7), tuple(NS.keys(hs[2:3])), False)
    fetch_key = NS.key(hs[2])
    assert core.index.is_being_stored(fetch_key)  # its slot is reserved while the get runs
    core.complete(JobReport(done={load.job_id: 1}))
    assert core.index.contains(fetch_key)  # a good fetch stays in the CPU tier


def test_failed_fetch_forgets_the_key_and_no_room_fails_the_job() -> None:
    core = OffloadScheduler(NS, 1, BS, 1, remote=True)
    hs = hashes("a", 2)
    core.lookup("b", hs, 0, 2 * BS)
    core.set_remote_hits("b", 1)
    core.plan_load("b", hs, [3, 4], BS)
    load = core.build_step().loads[0]
    core.complete(JobReport(failed={load.job_id: 1}))
    assert len(core.index) == 0 and core.index.num_free == 1
    # Two remote hits, one slot: the job is planned failed (vLLM recomputes), nothing leaks.
    core.lookup("c", hs, 0, 2 * BS + 1)
    core.set_remote_hits("c", 2)
    assert core.plan_load("c", hs, [5, 6], 2 * BS) == (0, 0, 2)
    load = core.build_step().loads[0]
    assert load.fail and load.keys == ()
    core.complete(JobReport(failed={load.job_id: 1}))
    assert core.index.num_free == 1 and not core.has_jobs()


def test_write_through_pins_until_every_rank_reported_its_put() -> None:
    core = OffloadScheduler(NS, 2, BS, 2, remote=True)
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    job = core.build_step().stores[0].job_id
    # Rank 0 copies and puts before rank 1's copy is done: its put report waits.
    core.complete(JobReport(done={job: 1}))
    core.complete(JobReport(put={job: 1}))
    core.complete(JobReport(done={job: 1}))
    assert core.index.contains(NS.key(hs[0])) and core.has_jobs()
    assert core.index.prepare_store(NS.keys(hashes("b", 2))).slots == []  # slots still pinned
    core.complete(JobReport(put={job: 1}))
    assert not core.has_jobs()
    # A copy that failed on one rank: no pin, yet both ranks' put reports are awaited.
    core.plan_stores("c", hashes("c", 1), [3], BS)
    job = core.build_step().stores[0].job_id
    core.complete(JobReport(done={job: 1}, failed={job: 1}, put={job: 1}))
    assert core.has_jobs() and not core.index.contains(NS.key(hashes("c", 1)[0]))
    core.complete(JobReport(put={job: 1}))
    assert not core.has_jobs()
    with pytest.raises(ValueError, match="is unknown"):
        core.complete(JobReport(put={job: 1}))


def test_remote_only_keeps_the_pool_empty() -> None:
    core = OffloadScheduler(NS, 4, BS, 1, remote_only=True)
    hs = hashes("a", 2)
    core.plan_stores("a", hs, [1, 2], 2 * BS)
    store = core.build_step().stores[0]
    core.complete(JobReport(done={store.job_id: 1}))
    assert len(core.index) == 2 and core.has_jobs()  # pinned while the put reads the slots
    core.complete(JobReport(put={store.job_id: 1}))
    assert len(core.index) == 0 and core.index.num_free == 4 and not core.has_jobs()
    assert core.lookup("b", hs, 0, 2 * BS) == 0  # every hit must come from the store


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
    worker.attach_remote(lambda rows: RemoteFetcher(settings(url), NS.digest, rows, writes))
    return worker, caches


def block(caches: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    return torch.cat([v[b].reshape(-1).view(torch.uint8) for v in caches.values()])


def settle(worker: OffloadWorker, core: OffloadScheduler):  # noqa: ANN201
    events = None
    for _ in range(400):
        worker.drain()
        events = worker.poll()
        report = worker.take_report()
        if not report.is_empty():
            core.complete(report)
        if not core.has_jobs():
            return events
    raise AssertionError("jobs did not finish")


def test_worker_writes_through_and_fetches_bit_exact(store: StoreProcess) -> None:
    hs = hashes("w", 2)
    writer, wcaches = make_worker(store.url)
    reader, rcaches = make_worker(store.url)
    try:
        for b in (1, 2):
            for view in wcaches.values():
                page = view[b].view(torch.uint8)
                page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8))
        wcore = OffloadScheduler(NS, 4, BS, 1, remote=True)
        wcore.plan_stores("a", hs, [1, 2], 2 * BS)
        step = wcore.build_step()
        writer.submit_stores(step)
        settle(writer, wcore)
        with StoreClient(store.url, Security.none()) as client:
            assert client.stats()["blocks"] == 2
        rcore = OffloadScheduler(NS, 4, BS, 1, remote=True)
        for view in rcaches.values():
            view.view(torch.uint8).fill_(0xA5)
        rcore.lookup("b", hs, 0, 2 * BS + 1)
        rcore.set_remote_hits("b", 2)
        rcore.plan_load("b", hs, [5, 6], 2 * BS)
        reader.start_loads(rcore.build_step())
        events = settle(reader, rcore)
        assert events is not None and reader.remote_failures == 0
        for src, dst in ((1, 5), (2, 6)):
            assert torch.equal(block(wcaches, src), block(rcaches, dst))
        # The store gone: the next fetch fails as a load error naming the GPU blocks.
        store.kill()
        rcore.reset()
        rcore.lookup("c", hs, 0, 2 * BS + 1)
        rcore.set_remote_hits("c", 2)
        rcore.plan_load("c", hs, [3, 4], 2 * BS)
        reader.start_loads(rcore.build_step())
        events = settle(reader, rcore)
        assert (events.failed_loads, events.failed_block_ids) == ({"c"}, {3, 4})
        assert reader.remote_failures == 1
    finally:
        writer.close()
        reader.close()


def test_a_worker_that_does_not_write_reports_its_puts_and_sends_nothing(
        store: StoreProcess) -> None:
    # MLA at TP > 1: rank 0 puts the bytes every rank holds; the others only report.
    worker, caches = make_worker(store.url, writes=False)
    try:
        core = OffloadScheduler(NS, 4, BS, 1, remote=True)
        core.plan_stores("a", hashes("n", 2), [1, 2], 2 * BS)
        worker.submit_stores(core.build_step())
        settle(worker, core)  # returns only once the put is reported
        with StoreClient(store.url, Security.none()) as client:
            stats = client.stats()
        assert (stats["blocks"], stats["requests_put"]) == (0, 0)
        assert core.index.contains(NS.key(hashes("n", 2)[1]))  # the CPU tier still holds them
        assert worker.remote_failures == 0
    finally:
        worker.close()
