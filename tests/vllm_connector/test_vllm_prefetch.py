"""Prefetch through vLLM 0.32's and 0.33's real Scheduler and AsyncScheduler (the fake-worker
harness, vllm_connector/vllm_harness.py; the fake worker compares every byte a request starts
from), over a disk tier below a small pool (`prefetch_blocks`).

Prompt A's blocks are evicted to disk. A long "blocker" request (its own stores off through
`max_offload_tokens: 0`, so the pool's contents stay put) takes the step's token budget, so a
new request for A waits in vLLM's queue: its 4 disk blocks move into the pool meanwhile, and
when it is scheduled they are pool hits, loaded bit-exact. Then: an aborted request's unsent
prefetch is cancelled and a sent one completes, leaking nothing; many requests over a pool too
small for them, with preemptions, keep every token right, at TP 1 and TP 2 (each rank reading
its own part); TP 2 ranks each fetch their own part. With vLLM's hybrid manager on (full
attention with a sliding window group, or an align-mode state group) a queued request's blocks
are prefetched for every group, those a load of its prefix reads (every full attention block,
the sliding ones inside the window, the state at the prefix's end), and an abort cancels it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import random  # noqa: E402

import vllm_harness as h  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm_harness import make_prompt, poison_gpu, run_to_completion, total_stats  # noqa: E402

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
BLOCKER = 20 * BS + 5  # prefilled over 3 steps of the engine's 128-token budget


def disk_engine(model_dir: str, disk: Path, *, cpu_slots: int = 8, tp: int = 1,
                async_scheduling: bool = False, window: int | None = None, state: bool = False,
                write_policy: str = "evict", prefetch_blocks: int = 8,
                **setup: Any) -> h.Engine:
    # hybrid: a slot holds one of the two groups sharing the tensors, half the layers
    layers = len(h.stage_layers(1)[0]) // (2 if window or state else 1)
    slot = round_up(layers * h.page_bytes(tp), HOST_ALIGNMENT)
    config = {"cpu_bytes": cpu_slots * slot, "disk_path": str(disk),
              "disk_bytes": 64 * (slot + 4096), "disk_write_policy": write_policy,
              "prefetch_blocks": prefetch_blocks, "prefetch_deadline_s": 30.0}
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, sliding_window=window, state=state,
                                  extra_config=config, **setup))


def add(engine: h.Engine, req_id: str, prompt: list[int], max_tokens: int = 2,
        params: dict[str, Any] | None = None) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, extra_args=None if params is None else
                              {"kv_transfer_params": params})
    request = Request(req_id, prompt, sampling, None,
                      block_hasher=get_request_block_hasher(BS, sha256))
    engine.scheduler.add_request(request)
    engine.added.add(req_id)
    return request


def a_on_disk(engine: h.Engine, a: list[int], b: list[int]) -> None:
    """A computed, then B's stores evict A's last 4 blocks to disk (an 8-slot pool)."""
    run_to_completion(engine, {"a": (a, 2)})
    run_to_completion(engine, {"b": (b, 2)})
    assert engine.scheduler.reset_prefix_cache()  # vLLM's GPU prefix cache, not the tiers
    poison_gpu(engine)


@pytest.mark.parametrize(("tp", "async_scheduling"), [
    pytest.param(1, False, id="Scheduler-tp1"), pytest.param(2, True, id="AsyncScheduler-tp2")])
def test_a_waiting_requests_disk_blocks_are_prefetched_and_load_from_the_pool(
        model_dir: str, tmp_path: Path, tp: int, async_scheduling: bool) -> None:
    engine = disk_engine(model_dir, tmp_path / "disk", tp=tp, async_scheduling=async_scheduling)
    a, b = make_prompt(1, 6 * BS + 5), make_prompt(2, 6 * BS + 3)
    a_on_disk(engine, a, b)
    before = dict(total_stats(engine).data)
    blocker = make_prompt(3, BLOCKER)
    add(engine, "blocker", blocker, params={"max_offload_tokens": 0})
    request = add(engine, "a2", a)
    engine.step()
    assert request.status == RequestStatus.WAITING  # queued behind the blocker's prefill
    run_to_completion(engine, {"blocker": (blocker, 2), "a2": (a, 2)})
    for worker in engine.workers:
        assert worker.starts["a2"] == [6 * BS]  # resumed after the load: every byte checked
    stats = total_stats(engine).data
    gained = {k: stats[k] - before.get(k, 0) for k in stats}
    assert gained["prefetched_blocks"] == 4
    assert gained["disk_read_bytes"] == 4 * tp * h.block_bytes(tp)  # the prefetch's reads
    assert (gained["hit_tokens"], gained["disk_hit_tokens"]) == (6 * BS, 0)  # pool hits
    assert gained["failed_loads"] == 0


def test_an_aborted_requests_prefetch_is_cancelled_or_completes_leaking_nothing(
        model_dir: str, tmp_path: Path) -> None:
    engine = disk_engine(model_dir, tmp_path / "disk")
    core = engine.connector._scheduler
    a, b = make_prompt(4, 6 * BS + 5), make_prompt(5, 6 * BS + 3)
    a_on_disk(engine, a, b)
    blocker = make_prompt(6, 40 * BS + 5)  # 6 steps of prefill
    add(engine, "blocker", blocker, params={"max_offload_tokens": 0})
    add(engine, "unsent", a)
    engine.abort("unsent")  # before any step: nothing planned
    engine.step()
    assert not core._prefetches
    add(engine, "held", a)
    engine.step()  # planned: its slots' evicted blocks are written to disk first
    assert [p.sent for p in core._prefetches.values()] == [False]
    engine.abort("held")  # cancelled: nothing sent, nothing held
    assert not core._prefetches and not core._prefetching
    add(engine, "sent", a)
    engine.run(until=lambda: any(p.sent for p in core._prefetches.values()))
    engine.abort("sent")  # sent: it completes
    assert engine.scheduler.requests["blocker"].status == RequestStatus.RUNNING
    run_to_completion(engine, {"blocker": (blocker, 2)})  # no leaks
    assert total_stats(engine).data["prefetched_blocks"] == 4
    run_to_completion(engine, {"a3": (a, 2)})  # and A loads from the pool
    assert all(w.starts["a3"] == [6 * BS] for w in engine.workers)
    assert total_stats(engine).data["disk_hit_tokens"] == 0


def test_many_requests_over_a_small_pool_with_preemptions_keep_every_token(
        model_dir: str, tmp_path: Path) -> None:
    engine = disk_engine(model_dir, tmp_path / "disk", cpu_slots=6, prefetch_blocks=3,
                         num_gpu_blocks=16, max_num_seqs=6)
    rng = random.Random(11)
    families = [make_prompt(30 + i, 4 * BS) for i in range(4)]
    requests = {}
    for i in range(16):
        prompt = families[i % 4][:rng.randrange(BS + 1, 4 * BS)] + \
            make_prompt(50 + i, rng.randrange(30))
        requests[f"r{i}"] = (prompt, rng.randrange(4, 30))
    run_to_completion(engine, requests)
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {f"again-{k}": v for k, v in requests.items()})
    stats = total_stats(engine).data
    assert engine.preemptions > 0
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0
    assert stats["prefetched_blocks"] > 0  # queued requests' blocks came ahead
    # a lookup never offers a block another request's load is fetching (or a store is
    # writing) into the pool: that load could not reserve its slot, and would fail
    failures = {name: stats[name] for name in ("failed_loads", "failed_stores",
                                               "disk_failed_reads", "disk_failed_writes")}
    assert not any(failures.values()), failures


def test_preemptions_at_tp2_keep_every_token_and_each_rank_reads_its_part(
        model_dir: str, tmp_path: Path) -> None:
    """Requests over a small pool with preemptions, two TP ranks (AsyncScheduler): queued
    requests' disk blocks come ahead, every token is right, and every block fetched from disk,
    ahead or by a load, was read once by each rank, its own part."""
    tp = 2
    engine = disk_engine(model_dir, tmp_path / "disk", tp=tp, async_scheduling=True,
                         cpu_slots=6, prefetch_blocks=3, num_gpu_blocks=16, max_num_seqs=6)
    rng = random.Random(12)
    families = [make_prompt(70 + i, 4 * BS) for i in range(3)]
    requests = {}
    for i in range(9):
        prompt = families[i % 3][:rng.randrange(BS + 1, 4 * BS)] + \
            make_prompt(90 + i, rng.randrange(30))
        requests[f"r{i}"] = (prompt, rng.randrange(4, 30))
    run_to_completion(engine, requests)
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    before = dict(total_stats(engine).data)
    preempted = engine.preemptions
    run_to_completion(engine, {f"again-{k}": v for k, v in requests.items()})
    stats = total_stats(engine).data
    gained = {k: stats[k] - before.get(k, 0) for k in stats}
    assert engine.preemptions > preempted  # the second pass preempted too
    assert gained["prefetched_blocks"] > 0 and gained["hit_tokens"] > 0
    assert gained["failed_loads"] == 0 and gained["failed_stores"] == 0, gained
    assert gained.get("disk_failed_reads", 0) == 0, gained
    read_blocks = gained["prefetched_blocks"] + gained["disk_hit_tokens"] // BS
    assert gained["disk_read_bytes"] == read_blocks * tp * h.block_bytes(tp), gained


@pytest.mark.parametrize(("window", "state", "async_scheduling"), [
    pytest.param(40, False, False, id="sliding-window-Scheduler"),
    pytest.param(None, True, True, id="state-AsyncScheduler")])
def test_a_queued_hybrid_requests_blocks_are_prefetched_for_every_group(
        model_dir: str, tmp_path: Path, window: int | None, state: bool,
        async_scheduling: bool) -> None:
    """A restarted hybrid engine finds A's blocks only on disk; A waits behind a blocker, and
    the blocks a load of its 6-block prefix reads (6 full attention blocks, plus the 3 sliding
    ones inside the window or the state after 6 blocks) are fetched ahead, all but one: the
    prefetch may take one block fewer than they are, and the load reads that one from disk."""
    a = make_prompt(10, 6 * BS + 7)
    first = disk_engine(model_dir, tmp_path / "disk", cpu_slots=16, window=window,
                        state=state, write_policy="through")
    run_to_completion(first, {"a": (a, 2)})
    h.Engine.shutdown_all()
    needed = 6 + (3 if window else 1)
    engine = disk_engine(model_dir, tmp_path / "disk", cpu_slots=16, window=window,
                         state=state, write_policy="through", prefetch_blocks=needed - 1,
                         async_scheduling=async_scheduling)
    assert len(engine.kv_cache_config.kv_cache_groups) == 2
    assert engine.connector._scheduler.prefetching
    assert h.reload_blocks(engine, 6) == needed
    assert len(engine.connector._scheduler.index) == 0  # only on disk
    poison_gpu(engine)
    blocker = make_prompt(11, BLOCKER)
    add(engine, "blocker", blocker, params={"max_offload_tokens": 0})
    request = add(engine, "a2", a)
    engine.step()
    assert request.status == RequestStatus.WAITING  # queued behind the blocker's prefill
    run_to_completion(engine, {"blocker": (blocker, 2), "a2": (a, 2)})
    for worker in engine.workers:
        assert worker.starts["a2"] == [6 * BS]  # resumed after the load: every byte checked
    stats = total_stats(engine).data
    assert stats["prefetched_blocks"] == needed - 1
    # the load: 6 blocks, one position of them with a block read from disk
    assert (stats["hit_tokens"], stats["disk_hit_tokens"]) == (6 * BS, BS)
    assert stats["disk_read_bytes"] == needed * h.block_bytes(1) // 2  # each block read once
    assert stats["failed_loads"] == 0 and stats["disk_failed_reads"] == 0


def test_an_aborted_hybrid_requests_prefetch_is_cancelled(model_dir: str,
                                                         tmp_path: Path) -> None:
    """A sliding window engine whose pool is full of B's idle blocks, A's only on disk: a
    queued request for A plans its prefetch into slots whose blocks go to disk first (not sent
    yet); its abort cancels it, holding nothing; A then loads every group bit-exact."""
    engine = disk_engine(model_dir, tmp_path / "disk", cpu_slots=12, window=40,
                         prefetch_blocks=12)
    core = engine.connector._scheduler
    a, b = make_prompt(12, 6 * BS + 5), make_prompt(13, 6 * BS + 3)
    a_on_disk(engine, a, b)
    hashes = Request("probe", a, SamplingParams(max_tokens=1), None,
                       block_hasher=get_request_block_hasher(BS, sha256)).block_hashes
    a_keys = [key for group in core.groups for key in core._keys(group, hashes)]
    assert not any(core.index.present(a_keys))  # B's stores evicted every block of A
    blocker = make_prompt(14, 40 * BS + 5)  # 6 steps of prefill
    add(engine, "blocker", blocker, params={"max_offload_tokens": 0})
    add(engine, "unsent", a)
    engine.abort("unsent")  # before any step: nothing planned
    engine.step()
    assert not core._prefetches
    add(engine, "held", a)
    engine.step()  # planned: its slots' evicted blocks are written to disk first
    assert [p.sent for p in core._prefetches.values()] == [False]
    assert len(core._prefetching) == h.reload_blocks(engine, 6)
    engine.abort("held")  # cancelled: nothing sent, nothing held
    assert not core._prefetches and not core._prefetching
    run_to_completion(engine, {"blocker": (blocker, 2)})
    stats = total_stats(engine).data
    assert stats["prefetched_blocks"] == 0
    run_to_completion(engine, {"a3": (a, 2)})
    assert all(w.starts["a3"] == [6 * BS] for w in engine.workers)
    stats = total_stats(engine).data
    assert stats["failed_loads"] == 0 and stats["disk_hit_tokens"] == 6 * BS
