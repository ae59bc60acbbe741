"""CrossLayerOffloadConnector inside vLLM 0.32 and 0.33: its factory, its Scheduler and
AsyncScheduler, its cache allocation and worker-side driver, with a fake model forward
(tests/vllm_harness.py).

Every scenario runs in eight variants: block-major (the connector's own BLNHC request) and the
per-layer fallback (VLLM_KV_CACHE_LAYOUT=LBNHC), at TP 1 and TP 2 (two workers merged by vLLM's
KVOutputAggregator), each under Scheduler and AsyncScheduler, and with two pipeline stages (PP 2
at TP 1 and 2, Scheduler: each stage's workers hold and move their own layers; earlier stages
return only connector output, merged at the last stage's rank as vLLM's executor does). On vLLM
0.33 also in a speculator's step order (transfer results taken before the stores, a drafter
layer written in between). Before each forward of a request that starts with computed tokens,
the harness compares every byte of them with what the fake model writes there; the GPU caches
are poisoned before loads.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm_harness as h  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from kvconnector.offload_worker import BLOCK_MAJOR, PER_LAYER  # noqa: E402
from kvconnector.vllm import (  # noqa: E402
    CUDA_AUTO_BACKENDS,
    ConnectorOptions,
    CrossLayerOffloadConnector,
    _largest_pp_stage,
    required_layout,
    slot_order,
)
from kvconnector.vllm_stats import OffloadStats  # noqa: E402

pytestmark = pytest.mark.vllm

POISON = 0xA5
BS = h.BLOCK_SIZE
NEEDS_DEFERRED_FINALIZE = pytest.mark.skipif(
    not h.DEFERS_FINALIZE, reason="a speculator's step order needs vLLM 0.33's driver")
# (layout, TP, PP, AsyncScheduler, speculator step order)
VARIANTS = [
    pytest.param(("BLNHC", 1, 1, False, False), id="block-major-Scheduler"),
    pytest.param(("BLNHC", 1, 1, True, False), id="block-major-AsyncScheduler"),
    pytest.param(("LBNHC", 1, 1, False, False), id="per-layer-Scheduler"),
    pytest.param(("LBNHC", 1, 1, True, False), id="per-layer-AsyncScheduler"),
    pytest.param(("BLNHC", 2, 1, False, False), id="tp2-Scheduler"),
    pytest.param(("BLNHC", 2, 1, True, False), id="tp2-AsyncScheduler"),
    pytest.param(("BLNHC", 1, 2, False, False), id="pp2-Scheduler"),
    # (vLLM's config refuses PP with async scheduling under Model Runner V1)
    pytest.param(("BLNHC", 2, 2, False, False), id="tp2-pp2-Scheduler"),
    pytest.param(("BLNHC", 1, 1, False, True), id="speculator-Scheduler",
                 marks=NEEDS_DEFERRED_FINALIZE),
    pytest.param(("BLNHC", 2, 1, True, True), id="speculator-tp2-AsyncScheduler",
                 marks=NEEDS_DEFERRED_FINALIZE),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return h.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def shut_engines_down() -> Iterator[None]:
    yield
    h.Engine.shutdown_all()


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple:
    layout = request.param[0]
    if layout != "BLNHC":
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)  # the engine override wins
    return request.param


def ranks(variant: tuple) -> int:
    return variant[1] * variant[2]  # TP x PP workers


def make_engine(model_dir: str, variant: tuple, gates: list[h.HeldGate] | None = None,
                cpu_slots: int = 256, **setup: object) -> h.Engine:
    layout, tp, pp, async_scheduling, speculator = variant
    page_bytes = (h.NUM_KV_HEADS // tp) * BS * 2 * h.HEAD_SIZE * 2  # one layer's block
    largest_stage = max(map(len, h.stage_layers(pp)))
    engine = h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                    tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                    speculator=speculator,
                                    extra_config={"cpu_bytes": cpu_slots * largest_stage
                                                  * page_bytes},
                                    **setup), gates=gates)
    assert engine.layout == layout
    mode = BLOCK_MAJOR if layout == "BLNHC" else PER_LAYER
    for worker in engine.workers:
        assert worker.connector._worker.mode == mode
        # a slot holds its stage's layers only
        assert worker.connector._worker.block_bytes == len(worker.layer_names) * page_bytes
    return engine


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50, 950) for _ in range(length)]


def stored_tokens(engine: h.Engine, prompt: list[int]) -> int:
    """Tokens of the longest prefix of `prompt` the CPU tier holds now."""
    core = engine.connector._scheduler
    request = h.Request("probe", prompt, h.SamplingParams(max_tokens=1), None,
                        block_hasher=h.get_request_block_hasher(BS, h.sha256))
    keys = core.namespace.keys(request.block_hashes)
    return BS * next((i for i, key in enumerate(keys) if not core.index.contains(key)),
                     len(keys))


def poison_gpu(engine: h.Engine) -> None:
    for worker in engine.workers:
        for view in worker.caches.values():
            view.view(torch.uint8).fill_(POISON)


def total_stats(engine: h.Engine) -> OffloadStats:
    total = OffloadStats()
    for data in engine.stats:
        total.aggregate(CrossLayerOffloadConnector.build_kv_connector_stats(data))
    return total


def run_to_completion(engine: h.Engine, requests: dict[str, tuple[list[int], int]]) -> None:
    """Add the requests not added yet, run until the engine is idle, check outputs and leaks."""
    for req_id, (prompt, max_tokens) in requests.items():
        if req_id not in engine.added:
            engine.add(req_id, prompt, max_tokens)
    engine.run()
    for req_id, (prompt, max_tokens) in requests.items():
        assert engine.finished[req_id] == engine.expected_tokens(prompt, max_tokens), req_id
    engine.assert_no_leaks()


# -- loading from the factory ------------------------------------------------------------------
def test_factory_loads_the_class_from_the_module_path_in_both_roles(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 2, 1, False, False))
    config = engine.vllm_config
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) \
        is CrossLayerOffloadConnector
    assert type(engine.connector) is CrossLayerOffloadConnector
    assert engine.connector.role is KVConnectorRole.SCHEDULER
    assert [type(w.connector) for w in engine.workers] == [CrossLayerOffloadConnector] * 2
    assert all(w.connector.role is KVConnectorRole.WORKER for w in engine.workers)
    # The layout the connector asked for is what vLLM resolved; vLLM turned HMA off for it.
    assert CrossLayerOffloadConnector.get_required_kvcache_layout(config) == "BLNHC"
    assert config.cache_config.kv_cache_layout == "BLNHC"
    assert not supports_hma(CrossLayerOffloadConnector)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert not engine.connector.requires_kv_delivery
    assert engine.connector._scheduler.num_workers == 2


def test_layout_opt_out_keeps_vllm_default_and_moves_layer_by_layer(
        model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvconnector")
    engine = h.Engine(h.EngineSetup(model_dir=model_dir,
                                    extra_config={"cpu_bytes": 1 << 20, "layout": "engine"}))
    assert engine.layout == "LBNHC"  # vLLM's first choice
    worker = engine.workers[0].connector._worker
    assert worker.mode == PER_LAYER and worker.copies_per_block == h.NUM_LAYERS
    assert "layer-major" in worker.describe()
    # One line per worker says which path and why.
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvconnector"]
    assert lines == [f"CrossLayerOffloadConnector rank 0: asked for vLLM's default (opted out "
                     f"(layout 'engine')), vLLM resolved LBNHC; {worker.describe()}"]


# -- the acceptance scenarios, in every variant ------------------------------------------------
def test_identical_request_loads_every_stored_byte(model_dir: str, variant: tuple) -> None:
    engine = make_engine(model_dir, variant)
    prompt = make_prompt(1, 4 * BS + 6)
    run_to_completion(engine, {"a": (prompt, 3)})
    assert stored_tokens(engine, prompt) == 4 * BS  # every full block, the partial one not
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=3)
    engine.step()
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    checked = [w.prefix_checks for w in engine.workers]
    run_to_completion(engine, {"b": (prompt, 3)})
    for worker, before in zip(engine.workers, checked, strict=True):
        assert worker.starts["b"] == [4 * BS]  # resumed after the load with 64 tokens computed
        assert worker.prefix_checks - before == 4 * BS  # every loaded byte compared
    stats = total_stats(engine)
    block_bytes = sum(worker.connector._worker.block_bytes for worker in engine.workers)
    assert (stats.data["hit_tokens"], stats.data["failed_loads"]) == (4 * BS, 0)
    assert stats.data["load_bytes"] == 4 * block_bytes  # every rank's bytes of 4 blocks
    assert stats.data["store_bytes"] == 4 * block_bytes


def test_request_sharing_a_prefix_gets_exactly_that_prefix(model_dir: str,
                                                           variant: tuple) -> None:
    engine = make_engine(model_dir, variant)
    prompt = make_prompt(2, 5 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    shares_two = prompt[:2 * BS + 5] + make_prompt(3, 2 * BS)
    shares_none = [prompt[0] + 1] + prompt[1:]
    run_to_completion(engine, {"c": (shares_two, 2), "d": (shares_none, 2)})
    for worker in engine.workers:
        assert worker.starts["c"] == [2 * BS]
        assert worker.starts["d"] == [0]


def test_full_prompt_hit_recomputes_only_the_last_token(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 1, 1, False, False))
    prompt = make_prompt(4, 3 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=2)
    run_to_completion(engine, {"b": (prompt, 2)})
    assert engine.workers[0].starts["b"] == [3 * BS - 1]


def test_failed_load_is_recomputed(model_dir: str, variant: tuple) -> None:
    gates = [h.HeldGate() for _ in range(ranks(variant))]
    engine = make_engine(model_dir, variant, gates=gates)
    prompt = make_prompt(5, 3 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    load_job = engine.connector._scheduler._next_job_id  # the next job is b's load
    for gate in gates:
        gate.fail.add(load_job)
    engine.add("b", prompt, max_tokens=2)
    run_to_completion(engine, {"b": (prompt, 2)})
    assert all(gate.seen.count(load_job) == 1 for gate in gates)  # it ran, and failed, everywhere
    for worker in engine.workers:
        assert worker.starts["b"] == [0]  # recomputed from scratch, never read poison
    stats = total_stats(engine)
    assert (stats.data["failed_loads"], stats.data["hit_tokens"]) == (1, 3 * BS)
    assert stored_tokens(engine, prompt) == 3 * BS  # the recomputed blocks are stored again


def test_failed_load_fails_the_request_under_the_fail_policy(model_dir: str,
                                                             variant: tuple) -> None:
    gates = [h.HeldGate() for _ in range(ranks(variant))]
    engine = make_engine(model_dir, variant, gates=gates, kv_load_failure_policy="fail")
    prompt = make_prompt(13, 2 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    for gate in gates:
        gate.fail.add(engine.connector._scheduler._next_job_id)
    engine.add("b", prompt, max_tokens=2)
    engine.run()
    assert engine.finished["b"] == []  # finished with an error, never served poisoned KV
    assert all("b" not in w.starts for w in engine.workers)
    engine.assert_no_leaks()


def test_reset_connector_cache_empties_the_tier(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 1, 1, True, False))
    prompt = make_prompt(14, 3 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert stored_tokens(engine, prompt) == 3 * BS
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert stored_tokens(engine, prompt) == 0
    run_to_completion(engine, {"b": (prompt, 2)})
    assert engine.workers[0].starts["b"] == [0]
    assert stored_tokens(engine, prompt) == 3 * BS


def test_finished_request_keeps_its_blocks_while_its_store_is_in_flight(
        model_dir: str, variant: tuple) -> None:
    # a's store held
    gates = [h.HeldGate(hold={0: threading.Event()}) for _ in range(ranks(variant))]
    engine = make_engine(model_dir, variant, gates=gates, num_gpu_blocks=10)
    prompt, other = make_prompt(6, 4 * BS + 6), make_prompt(7, 5 * BS + 10)
    engine.drain_when_idle = False
    engine.add("a", prompt, max_tokens=3)
    engine.step()
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    assert len(a_blocks) == 5
    engine.run(until=lambda: "a" in engine.finished)
    engine.add("e", other, max_tokens=2)  # needs 6 of the 9 blocks: only 4 are free
    for _ in range(6):
        engine.step()
    assert "a" in engine.scheduler.requests  # finished, blocks held for the store
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt > 0 for b in a_blocks)
    assert not any(a_blocks & set(w.states["e"].block_ids)
                   for w in engine.workers if "e" in w.states)
    assert "e" not in engine.finished
    for gate in gates:
        gate.hold[0].set()
    engine.drain_when_idle = True
    run_to_completion(engine, {"a": (prompt, 3), "e": (other, 2)})
    # The store read a's bytes, not e's: load them into a poisoned cache and compare.
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=3)
    run_to_completion(engine, {"b": (prompt, 3)})
    assert all(w.starts["b"] == [4 * BS] for w in engine.workers)


def test_preempted_request_store_finishes_before_its_blocks_are_rewritten(
        model_dir: str, variant: tuple) -> None:
    # e and a fill the pool; when e needs one more block, vLLM preempts a (the newest) and hands
    # its blocks to e while a's store (job 1) is held in flight on the copy thread. The flush
    # before that step's forward releases it and must wait for it.
    gates = [h.HeldGate(hold={1: threading.Event()}) for _ in range(ranks(variant))]
    engine = make_engine(model_dir, variant, gates=gates, num_gpu_blocks=10)
    flushes: list[tuple[int, bool]] = []  # (rank, store 1 still in flight) per flush of it
    for worker in engine.workers:
        core = worker.connector._worker
        original = core.flush

        def flush(step, core=core, original=original, rank=worker.rank):
            if 1 in step.flush:
                flushes.append((rank, not core.engine.wait([1], timeout=0)))
                gates[rank].hold[1].set()  # the copy may run now; flush must wait for it
            original(step)
            if 1 in step.flush:
                assert core.engine.wait([1], timeout=0), "flush returned before the store ended"

        core.flush = flush
    e, a = make_prompt(8, 4 * BS - 4), make_prompt(9, 4 * BS + 6)
    engine.drain_when_idle = False  # the held copy would block a quiet step's drain
    engine.add("e", e, max_tokens=30)
    engine.add("a", a, max_tokens=30)
    engine.step()
    jobs = engine.connector._scheduler._jobs
    assert (jobs[1].req_id, jobs[1].is_store, len(jobs[1].keys)) == ("a", True, 4)
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    engine.run(until=lambda: bool(flushes), max_steps=100)
    engine.drain_when_idle = True
    run_to_completion(engine, {"e": (e, 30), "a": (a, 30)})
    assert engine.preemptions == 1
    assert flushes == [(w.rank, True) for w in engine.workers]
    for worker in engine.workers:
        assert a_blocks & worker.block_history["e"], "e never got any of a's freed blocks"
        # a resumed by loading what the held store copied: a's bytes, not e's (compared).
        assert worker.starts["a"] == [0, 4 * BS]


def test_small_pool_many_requests_leaks_nothing(model_dir: str, variant: tuple) -> None:
    engine = make_engine(model_dir, variant, cpu_slots=12, num_gpu_blocks=16, max_num_seqs=6)
    rng = random.Random(10)
    families = [make_prompt(20 + i, 3 * BS) for i in range(4)]
    requests = {}
    for i in range(16):
        prompt = families[i % 4][:rng.randrange(BS + 1, 3 * BS)] + make_prompt(40 + i,
                                                                               rng.randrange(30))
        requests[f"r{i}"] = (prompt, rng.randrange(4, 30))
    run_to_completion(engine, requests)
    assert engine.preemptions > 0
    # Second wave, GPU prefix cache dropped: the CPU tier serves what it kept.
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {f"again-{k}": v for k, v in requests.items()})
    stats = total_stats(engine)
    assert stats.data["hit_tokens"] > 0 and stats.data["evictions"] > 0
    assert stats.data["failed_loads"] == stats.data["failed_stores"] == 0
    assert sum(len(w.starts) for w in engine.workers) == len(engine.workers) * 32


# -- options, layout choice, stats, lifecycle --------------------------------------------------
def test_slot_order_names_equal_bytes_equally() -> None:
    # A slot holds one block of every layer: the block-major chunk, or the per-layer pages in
    # layer order. Layouts that give the same slot bytes share a namespace; BHLNC does not.
    assert {slot_order(x) for x in ("BLNHC", "LBNHC")} == {"LNHC"}
    assert {slot_order(x) for x in ("BLHNC", "LBHNC", "LHBNC")} == {"LHNC"}
    assert slot_order("BHLNC") == "HLNC"


def test_slots_are_sized_by_the_largest_pipeline_stage() -> None:
    from types import SimpleNamespace

    def config(layers: int, pp: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
                               model_config=SimpleNamespace(
                                   get_total_num_hidden_layers=lambda: layers))

    # vLLM splits 62 layers over 4 stages as 15/16/16/15: every stage sizes slots for 16.
    assert _largest_pp_stage(config(62, 4)) == 16
    assert _largest_pp_stage(config(81, 4)) == 21
    assert _largest_pp_stage(config(32, 1)) == 0


def test_required_layout_choices() -> None:
    auto = ConnectorOptions(cpu_bytes=1)
    # No backend configured on CUDA: every backend vLLM may pick must accept the layout.
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "auto", (9, 0))[0] == "BLNHC"
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "auto", (10, 0))[0] == "BLHNC"  # FlashInfer
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "fp8", (9, 0))[0] == "BLHNC"
    # ... and elsewhere the set is unknown (ROCm/XPU backends lack stride evidence): opt out.
    layout, why = required_layout(auto, None, "auto")
    assert layout is None and "non-CUDA platform" in why
    assert required_layout(auto, ["FLASH_ATTN"], "auto")[0] == "BLNHC"
    assert required_layout(auto, ["TRITON_MLA"], "auto")[0] == "BLNHC"
    layout, why = required_layout(auto, ["FLEX_ATTENTION"], "auto")
    assert layout is None and "FLEX_ATTENTION" in why
    layout, why = required_layout(auto, ["ROCM_AITER_MLA"], "auto")
    assert layout is None and "ROCM_AITER_MLA" in why
    assert required_layout(ConnectorOptions(cpu_bytes=1, layout="BHLNC"), None, "auto")[0] \
        == "BHLNC"
    assert required_layout(ConnectorOptions(cpu_bytes=1, layout="engine"), ["FLASH_ATTN"],
                           "auto")[0] is None


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "needs 'cpu_bytes'"),
    ({"cpu_bytes": 1, "cpu_gb": 2}, "unknown kv_connector_extra_config key"),
    ({"cpu_bytes": -5}, "cpu_bytes must be a positive integer"),
    ({"cpu_bytes": 1.5}, "cpu_bytes must be a positive integer"),
    ({"cpu_bytes": 1, "eviction": "fifo"}, "eviction must be one of"),
    ({"cpu_bytes": 1, "layout": "LBHNC"}, "layout must be one of"),
    ({"cpu_bytes": 1, "copy_backend": "nccl"}, "copy_backend must be one of"),
    ({"cpu_bytes": 1, "max_store_bytes": 0}, "max_store_bytes must be a positive integer"),
])
def test_options_refuse_bad_values(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.parse(extra)


def test_connector_refuses_a_pool_without_a_block_and_hybrid_groups(model_dir: str) -> None:
    config = h.make_vllm_config(h.EngineSetup(model_dir=model_dir,
                                              extra_config={"cpu_bytes": 100}))
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    one_group = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["l0"], full)])
    with pytest.raises(ValueError, match="cpu_bytes 100 holds no block"):
        CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, one_group)
    config.kv_transfer_config.kv_connector_extra_config["cpu_bytes"] = 1 << 20
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=16,
                               dtype=torch.bfloat16, sliding_window=64)
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)])
    with pytest.raises(ValueError, match="one full-attention KV cache group, got 2"):
        CrossLayerOffloadConnector(config, KVConnectorRole.WORKER, hybrid)


def test_stats_aggregate_reduce_and_reach_prometheus(model_dir: str) -> None:
    a = OffloadStats({"hit_tokens": 32, "miss_tokens": 96, "load_bytes": 4_000_000_000,
                      "load_seconds": 2.0, "jobs_in_flight": 3})
    b = CrossLayerOffloadConnector.build_kv_connector_stats({"hit_tokens": 32,
                                                             "jobs_in_flight": 1})
    total = a.aggregate(b).reduce()
    assert (total["hit_tokens"], total["hit_rate"], total["load_GBps"],
            total["jobs_in_flight"]) == (64, 0.4, 2.0, 1)
    assert OffloadStats({"jobs_in_flight": 5}).is_empty()  # a gauge alone is no news
    config = h.make_vllm_config(h.EngineSetup(model_dir=model_dir,
                                              extra_config={"cpu_bytes": 1 << 20}))
    prom = KVConnectorProm(config, ["engine"], {0: ["0"]})
    prom.observe(OffloadStats({"hit_tokens": 48, "evictions": 2, "jobs_in_flight": 7}).data)
    from prometheus_client import REGISTRY

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"engine": "0"})

    assert sample("vllm:kvconnector_hit_tokens_total") == 48
    assert sample("vllm:kvconnector_evictions_total") == 2
    assert sample("vllm:kvconnector_jobs_in_flight") == 7


def test_external_hits_are_reported_as_the_host_tier(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 1, 1, False, False))
    prompt = make_prompt(11, 2 * BS + 1)
    run_to_completion(engine, {"a": (prompt, 1)})
    request = engine.add("b", prompt, max_tokens=1)
    assert engine.connector.get_external_cache_hit_sources(request, 2 * BS) == {"host": 2 * BS}


def test_sleep_drains_copies_and_the_pool_serves_after_wake_up(model_dir: str) -> None:
    gate = h.HeldGate(hold={0: threading.Event()})
    engine = make_engine(model_dir, ("BLNHC", 1, 1, False, False), gates=[gate])
    connector = engine.workers[0].connector
    engine.drain_when_idle = False
    prompt = make_prompt(12, 2 * BS + 3)
    engine.add("a", prompt, max_tokens=1)
    engine.step()
    assert connector._worker.jobs_in_flight == 1
    threading.Timer(0.05, gate.hold[0].set).start()  # the copy finishes while sleep waits
    connector.unregister_kv_caches()  # what vLLM 0.33's worker calls before releasing the cache
    assert connector._worker.engine.wait([0], timeout=0)
    engine.drain_when_idle = True
    run_to_completion(engine, {"a": (prompt, 1)})
    # Asleep: the KV cache's contents are gone. Awake (0.33 calls the base class's no-op
    # restore_kv_caches; 0.32 has none), the pool serves the prefix, every byte compared.
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    if hasattr(connector, "restore_kv_caches"):
        connector.restore_kv_caches()
    run_to_completion(engine, {"b": (prompt, 1)})
    assert engine.workers[0].starts["b"] == [2 * BS]
    assert total_stats(engine).data["hit_tokens"] == 2 * BS


def test_start_load_kv_accepts_extra_keyword_arguments(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 1, 1, False, False))
    connector = engine.workers[0].connector
    so = engine.scheduler.schedule()
    connector.bind_connector_metadata(so.kv_connector_metadata)
    connector.start_load_kv(None, scheduler_output=so, request_ids=[], num_tokens=0)
    connector.clear_connector_metadata()


def test_shutdown_releases_the_pool(model_dir: str) -> None:
    engine = make_engine(model_dir, ("BLNHC", 1, 1, False, False))
    connector = engine.workers[0].connector
    worker = connector._worker
    connector.shutdown()
    assert connector._worker is None
    with pytest.raises(RuntimeError, match="closed"):
        worker.engine.submit_load(99, [0], [1])
