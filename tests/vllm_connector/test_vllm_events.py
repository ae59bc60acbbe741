"""KV events through vLLM's real Scheduler and AsyncScheduler (vllm_connector/vllm_harness.py),
on vLLM 0.32 and 0.33: with `kv_events_config` on, every batch vLLM would publish is recorded
and replayed as a router would, into a view of (medium, group, block hash); after each workload
the view must equal, block for block, what the pool and the disk can load, and every hash the
connector publishes must be one vLLM published for its GPU cache.

Workloads: evictions from a small pool into a disk, reloads, a connector reset; preemptions;
a load aborted while its copy is in flight; a failed store (which publishes nothing); a failed
load (its pool blocks are removed); the hybrid manager's groups; TP 2. A replay missing one
BlockRemoved must differ from what the engine holds (the view can catch a lost event).
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import make_prompt, poison_gpu, run_to_completion  # noqa: E402

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up  # noqa: E402
from kvconnector.servers.pool import PoolProcess  # noqa: E402
from kvconnector.vllm.events import external_hash  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
V = h.Variant


class Recorder:
    """Stands for vLLM's publisher: keeps every batch the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        return

    @property
    def events(self) -> list[Any]:
        return [event for batch in self.batches for event in batch.events]


def replay(events: Iterable[Any]) -> dict[str, set[tuple[int, bytes]]]:
    """A router's view: medium -> (group, hash) of every block stored and not removed since.
    The connector's media are exact: a second store of a block, or a removal of one not
    stored, is an error. AllBlocksCleared is vLLM's GPU cache's."""
    view: dict[str, set[tuple[int, bytes]]] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.pop("GPU", None)
            continue
        held = view.setdefault(event.medium, set())
        blocks = [(event.group_idx, block_hash) for block_hash in event.block_hashes]
        exact = event.medium != "GPU"
        for block in blocks:
            if isinstance(event, BlockStored):
                assert not (exact and block in held), f"{event.medium} block stored twice"
                held.add(block)
            else:
                assert not (exact and block not in held), f"{event.medium} removal of no block"
                held.discard(block)
    return view


def loadable(engine: h.Engine) -> dict[str, set[tuple[int, bytes]]]:
    """What the engine can load now, per medium: the pool's readable keys, the disk's."""
    core = engine.connector._scheduler

    def split(key: bytes) -> tuple[int, Any]:
        group, block_hash = engine.connector._events._split(key)
        return group, external_hash(block_hash)

    out = {"CPU": {split(k) for k in core.index.held_keys() if core.index.contains(k)}}
    if "disk" in core._by_name:
        disk = core.tier("disk").index
        out["STORAGE"] = {split(k) for k in disk.held_keys() if disk.contains(k)}
    return out


def ours(view: dict[str, set[tuple[int, bytes]]]) -> dict[str, set[tuple[int, bytes]]]:
    return {medium: view.get(medium, set()) for medium in ("CPU", "STORAGE")}


def assert_view_is_true(engine: h.Engine, recorder: Recorder) -> dict[str, set]:
    view = ours(replay(recorder.events))
    truth = loadable(engine)
    for medium, blocks in view.items():
        assert blocks == truth.get(medium, set()), medium
    gpu = {block_hash for event in recorder.events
           if isinstance(event, BlockStored) and event.medium == "GPU"
           for block_hash in event.block_hashes}
    assert {block_hash for blocks in view.values() for _, block_hash in blocks} <= gpu
    return view


@pytest.fixture
def events_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made from here on have vLLM's KV events on (its null publisher, replaced)."""
    original = h.make_vllm_config

    def with_events(setup: h.EngineSetup) -> Any:
        config = original(setup)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    monkeypatch.setattr(h, "make_vllm_config", with_events)


def recorded(engine: h.Engine) -> Recorder:
    recorder = Recorder()
    engine.scheduler.kv_event_publisher = recorder
    return recorder


def disk_engine(model_dir: str, disk: Path, cpu_slots: int, async_scheduling: bool = False,
                tp: int = 1, **setup: Any) -> h.Engine:
    slot = round_up(len(h.stage_layers(1)[0]) * h.page_bytes(tp), HOST_ALIGNMENT)
    config = {"cpu_bytes": cpu_slots * slot, "disk_path": str(disk),
              "disk_bytes": 64 * (slot + 4096), "disk_write_policy": "evict"}
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, extra_config=config, **setup))


@pytest.mark.usefixtures("events_on")
@pytest.mark.parametrize(("async_scheduling", "tp"), [
    pytest.param(False, 1, id="Scheduler-tp1"), pytest.param(True, 2, id="AsyncScheduler-tp2")])
def test_replay_equals_what_the_pool_and_disk_hold(model_dir: str, tmp_path: Path,
                                                   async_scheduling: bool, tp: int) -> None:
    engine = disk_engine(model_dir, tmp_path / "disk", 8, async_scheduling, tp)
    recorder = recorded(engine)
    a, b = make_prompt(1, 6 * BS + 5), make_prompt(2, 6 * BS + 3)
    run_to_completion(engine, {"a": (a, 2)})
    view = assert_view_is_true(engine, recorder)
    assert len(view["CPU"]) == 6 and not view["STORAGE"]
    # Self-describing: a's first CPU event chains its blocks from the prompt's start.
    first = next(e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "CPU")
    assert (first.parent_block_hash, first.block_size, first.group_idx) == (None, BS, 0)
    assert first.token_ids == a[:len(first.block_hashes) * BS]
    assert (first.kv_cache_spec_kind, first.locality, first.ownership) == (
        "full_attention", "LOCAL", None)
    gpu = next(e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "GPU")
    assert first.block_hashes[0] == gpu.block_hashes[0]  # vLLM's own external hash

    run_to_completion(engine, {"b": (b, 2)})  # 6 blocks in 8 slots: a's tail 4 go to disk
    view = assert_view_is_true(engine, recorder)
    assert (len(view["CPU"]), len(view["STORAGE"])) == (8, 4)
    removed = [e for e in recorder.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in removed) == 4
    disk = [e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert {(e.locality, e.ownership, e.block_size) for e in disk} == {("LOCAL", "disk", BS)}
    blocks = {tuple(e.token_ids[i * BS:(i + 1) * BS]) for e in disk
              for i in range(len(e.block_hashes))}  # described when a stored them
    assert blocks == {tuple(a[i * BS:(i + 1) * BS]) for i in range(2, 6)}

    # Negative control: a replay that lost one BlockRemoved claims a block the pool dropped.
    lost = next(i for i, e in enumerate(recorder.events)
                if isinstance(e, BlockRemoved) and e.medium == "CPU")
    short = ours(replay(recorder.events[:lost] + recorder.events[lost + 1:]))
    assert short["CPU"] != loadable(engine)["CPU"]

    assert engine.scheduler.reset_prefix_cache()  # the GPU's only
    poison_gpu(engine)
    run_to_completion(engine, {"a2": (a, 2)})  # a's 4 disk blocks come back into the pool
    assert all(w.starts["a2"] == [6 * BS] for w in engine.workers)
    assert_view_is_true(engine, recorder)

    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    c = make_prompt(3, 2 * BS + 1)
    run_to_completion(engine, {"c": (c, 2)})  # vLLM publishes at its next step's update
    view = assert_view_is_true(engine, recorder)
    assert (len(view["CPU"]), len(view["STORAGE"])) == (2, 0)  # c's blocks only


@pytest.mark.usefixtures("events_on")
def test_a_failed_store_publishes_nothing(model_dir: str) -> None:
    gates = [h.HeldGate(fail={0}), h.HeldGate()]  # a's store fails on rank 0 only
    engine = h.make_engine(model_dir, V("BLNHC", tp=2), gates=gates)
    recorder = recorded(engine)
    prompt = make_prompt(3, 3 * BS + 2)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert 0 in gates[0].seen and h.total_stats(engine).data["failed_stores"] == 1
    assert not [e for e in recorder.events if getattr(e, "medium", None) == "CPU"]
    assert not assert_view_is_true(engine, recorder)["CPU"]


@pytest.mark.usefixtures("events_on")
def test_a_failed_load_removes_its_blocks_and_the_recompute_stores_them_again(
        model_dir: str) -> None:
    gates = [h.HeldGate(), h.HeldGate()]
    engine = h.make_engine(model_dir, V("BLNHC", tp=2, async_scheduling=True), gates=gates)
    recorder = recorded(engine)
    prompt = make_prompt(5, 3 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    load_job = engine.connector._scheduler._next_job_id
    gates[1].fail.add(load_job)  # as a checksum refused on one rank
    run_to_completion(engine, {"b": (prompt, 2)})
    cpu = [(type(e).__name__, len(e.block_hashes)) for e in recorder.events
           if getattr(e, "medium", None) == "CPU"]
    assert cpu == [("BlockStored", 3), ("BlockRemoved", 3), ("BlockStored", 3)]
    assert len(assert_view_is_true(engine, recorder)["CPU"]) == 3


@pytest.mark.usefixtures("events_on")
def test_a_load_aborted_in_flight_leaves_a_true_view(model_dir: str) -> None:
    gates = [h.HeldGate(), h.HeldGate()]
    engine = h.make_engine(model_dir, V("BLNHC", tp=2), gates=gates, num_gpu_blocks=10)
    recorder = recorded(engine)
    prompt = make_prompt(21, 4 * BS + 6)
    run_to_completion(engine, {"a": (prompt, 3)})
    assert engine.scheduler.reset_prefix_cache()
    load, release = engine.connector._scheduler._next_job_id, threading.Event()
    for gate in gates:
        gate.hold[load] = release
    engine.drain_when_idle = False
    engine.add("b", prompt, max_tokens=3)
    engine.step()
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(gate.reached(load) for gate in gates)
    h.abort_while_loading(engine, "b", ("c", make_prompt(22, 5 * BS + 10)), steps=4)
    assert_view_is_true(engine, recorder)
    release.set()
    engine.drain_when_idle = True
    run_to_completion(engine, {"c": (make_prompt(22, 5 * BS + 10), 2)})
    view = assert_view_is_true(engine, recorder)
    assert len(view["CPU"]) == 4 + 5  # a's blocks, then c's


@pytest.mark.usefixtures("events_on")
@pytest.mark.parametrize("variant", [
    pytest.param(V("BLNHC", tp=2, async_scheduling=True), id="tp2-AsyncScheduler"),
    pytest.param(V("BLNHC"), id="Scheduler")])
def test_preemptions_and_evictions_of_a_small_pool(model_dir: str, variant: h.Variant) -> None:
    engine = h.make_engine(model_dir, variant, cpu_slots=12, num_gpu_blocks=16, max_num_seqs=6)
    recorder = recorded(engine)
    rng = random.Random(10)
    families = [make_prompt(20 + i, 3 * BS) for i in range(4)]
    requests = {}
    for i in range(16):
        prompt = families[i % 4][:rng.randrange(BS + 1, 3 * BS)] + make_prompt(40 + i,
                                                                               rng.randrange(30))
        requests[f"r{i}"] = (prompt, rng.randrange(4, 30))
    run_to_completion(engine, requests)
    assert engine.preemptions > 0
    assert_view_is_true(engine, recorder)
    assert engine.scheduler.reset_prefix_cache()
    run_to_completion(engine, {f"again-{k}": v for k, v in requests.items()})
    view = assert_view_is_true(engine, recorder)
    assert len(view["CPU"]) == 12  # the pool is full
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in recorder.events)


@pytest.mark.usefixtures("events_on")
@pytest.mark.parametrize(("variant", "kinds"), [
    pytest.param(V("BLNHC", window=40), {0: "full_attention", 1: "sliding_window"},
                 id="sliding-window"),
    pytest.param(V("BLNHC", tp=2, async_scheduling=True, state=True),
                 {0: "full_attention", 1: "mamba"}, id="state-tp2")])
def test_hybrid_groups_publish_each_group_under_its_index(model_dir: str, variant: h.Variant,
                                                          kinds: dict[int, str]) -> None:
    engine = h.make_engine(model_dir, variant)
    recorder = recorded(engine)
    prompt = make_prompt(4, 6 * BS + 7)
    run_to_completion(engine, {"a": (prompt, 3)})
    view = assert_view_is_true(engine, recorder)
    assert {group for group, _ in view["CPU"]} == {0, 1}
    stored = [e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {e.group_idx: e.kv_cache_spec_kind for e in stored} == kinds
    full = [t for e in stored if e.group_idx == 0 for t in e.token_ids]
    assert full == prompt[:6 * BS]
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {"b": (prompt, 3)})
    assert all(w.starts["b"] == [6 * BS] for w in engine.workers)
    assert_view_is_true(engine, recorder)


def test_without_kv_events_config_the_connector_does_no_event_work(model_dir: str) -> None:
    engine = h.make_engine(model_dir, V("BLNHC"))
    run_to_completion(engine, {"a": (make_prompt(6, 3 * BS + 1), 2)})
    assert engine.connector._events is None and engine.connector._scheduler.events is None
    assert list(engine.connector.take_events()) == []


@pytest.mark.usefixtures("events_on")
def test_two_engines_sharing_a_pool_each_publish_what_the_other_stores_and_evicts(
        model_dir: str, tmp_path: Path) -> None:
    # A pool of 8 slots between two engines: each one's stream follows the daemon's change
    # log, so a block the other engine stores is loadable here (and published), and a block
    # the other's store evicts is removed from this one's view.
    with PoolProcess(tmp_path / "pool.log", f"e{uuid.uuid4().hex[:10]}", capacity="128KiB",
                     slot_bytes="16KiB") as pool:
        engines = [h.Engine(h.EngineSetup(model_dir=model_dir, extra_config={"pool": pool.name}))
                   for _ in range(2)]
        recorders = [recorded(engine) for engine in engines]
        a, b = make_prompt(11, 5 * BS + 3), make_prompt(12, 6 * BS + 3)
        keys = h.prompt_keys(engines[0], a) + h.prompt_keys(engines[0], b)

        def shared_view_is_true(expected: int) -> None:
            for engine, recorder in zip(engines, recorders, strict=True):
                engine.step()  # an update: this step's events go out
                core, events = engine.connector._scheduler, engine.connector._events
                truth = {(0, external_hash(events._split(k)[1]))
                         for k, held in zip(keys, core.index.present(keys), strict=True) if held}
                view = ours(replay(recorder.events))["CPU"]
                assert view == truth and len(view) == expected
                assert {e.ownership for e in recorder.events
                        if getattr(e, "medium", None) == "CPU"} == {f"shared_pool:{pool.name}"}

        run_to_completion(engines[0], {"a": (a, 2)})
        shared_view_is_true(5)
        # the other engine's stream: a's blocks, stored by engine 0, with hashes only
        other = [e for e in recorders[1].events
                 if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert sum(len(e.block_hashes) for e in other) == 5
        run_to_completion(engines[1], {"b": (b, 2)})  # 6 more blocks: 3 of a's are evicted
        shared_view_is_true(8)
        removed = [e for e in recorders[0].events
                   if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert sum(len(e.block_hashes) for e in removed) == 3
        mine = [e for e in recorders[1].events if isinstance(e, BlockStored)
                and e.medium == "CPU" and e.token_ids]
        assert [t for e in mine for t in e.token_ids] == b[:6 * BS]  # its own: described
        assert engines[0].scheduler.reset_prefix_cache(reset_connector=True)
        shared_view_is_true(0)  # the namespace's blocks left the pool, for both engines
        h.Engine.shutdown_all()
