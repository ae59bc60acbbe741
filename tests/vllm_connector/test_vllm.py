"""CrossLayerOffloadConnector as vLLM 0.32 and 0.33 load it: its factory (both roles, from the
module path), the layout it asks for, its options, the slot size, its stats and Prometheus
metrics, hit sources, sleep mode and shutdown, through the harness's engine (vllm_harness.py).
The acceptance scenarios in every engine variant are in vllm_connector/test_vllm_scenarios.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

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
    MambaSpec,
    SlidingWindowSpec,
)
from vllm_harness import (  # noqa: E402
    make_engine,
    make_prompt,
    poison_gpu,
    run_to_completion,
    total_stats,
)

from kvconnector.offload.worker import PER_LAYER  # noqa: E402
from kvconnector.vllm.connector import ConnectorOptions, CrossLayerOffloadConnector  # noqa: E402
from kvconnector.vllm.stats import OffloadStats  # noqa: E402
from kvconnector.vllm.tiers import largest_pp_stage  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE


# -- loading from the factory ------------------------------------------------------------------
def test_factory_loads_the_class_from_the_module_path_in_both_roles(model_dir: str) -> None:
    engine = make_engine(model_dir, h.Variant("BLNHC", tp=2))
    config = engine.vllm_config
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) \
        is CrossLayerOffloadConnector
    assert type(engine.connector) is CrossLayerOffloadConnector
    assert engine.connector.role is KVConnectorRole.SCHEDULER
    assert [type(w.connector) for w in engine.workers] == [CrossLayerOffloadConnector] * 2
    assert all(w.connector.role is KVConnectorRole.WORKER for w in engine.workers)
    # The layout the connector asked for is what vLLM resolved. SupportsHMA: vLLM's config does
    # not turn the hybrid manager off for it (this CUDA wheel on a CPU machine sees no platform,
    # which turns it off by itself; the harness's hybrid engines turn it back on).
    assert CrossLayerOffloadConnector.get_required_kvcache_layout(config) == "BLNHC"
    assert config.cache_config.kv_cache_layout == "BLNHC"
    assert supports_hma(CrossLayerOffloadConnector)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
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
    lines = [r.getMessage() for r in caplog.records
             if r.name == "vllm.kvconnector" and r.levelno == logging.INFO]
    assert lines == [f"CrossLayerOffloadConnector rank 0: asked for vLLM's default (opted out "
                     f"(layout 'engine')), vLLM resolved LBNHC for TRITON_ATTN; "
                     f"{worker.describe()}"]


# -- options, layout choice, stats, lifecycle --------------------------------------------------
def test_slots_are_sized_by_the_largest_pipeline_stage() -> None:
    from types import SimpleNamespace

    def config(layers: int, pp: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
                               model_config=SimpleNamespace(
                                   get_total_num_hidden_layers=lambda: layers))

    # vLLM splits 62 layers over 4 stages as 15/16/16/15: every stage sizes slots for 16.
    assert largest_pp_stage(config(62, 4)) == 16
    assert largest_pp_stage(config(81, 4)) == 21
    assert largest_pp_stage(config(32, 1)) == 0


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "needs exactly one of 'cpu_bytes'"),
    ({"cpu_bytes": 1, "cpu_gb": 2}, r"unknown key 'cpu_gb' \(did you mean 'cpu_bytes'\?\)"),
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


def test_connector_refuses_a_pool_without_a_block_and_groups_it_cannot_move(
        model_dir: str) -> None:
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
    groups = CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, hybrid)._tiers.groups
    assert [(g.prefix, g.window) for g in groups] == [(b"\x00", None), (b"\x01", 64)]
    # a state group keeps a state per block boundary only in vLLM's align mode
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,),
                      page_size_padded=full.page_size_bytes)
    state = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["m1"], mamba)])
    with pytest.raises(ValueError, match="group 1 is a MambaSpec \\(mamba_cache_mode 'none'"):
        CrossLayerOffloadConnector(config, KVConnectorRole.WORKER, state)
    aligned = dataclasses.replace(mamba, mamba_cache_mode="align")
    state.kv_cache_groups[1] = KVCacheGroupSpec(["m1"], aligned)
    groups = CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, state)._tiers.groups
    assert [(g.prefix, g.window, g.state) for g in groups] == [(b"\x00", None, False),
                                                                (b"\x01", None, True)]
    only_state = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["m1"], aligned)])
    with pytest.raises(ValueError, match="no attention KV cache group to offload"):
        CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, only_state)
    wide = dataclasses.replace(window, block_size=2 * BS)
    sizes = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], wide)])
    with pytest.raises(ValueError, match=f"different block sizes \\[{BS}, {2 * BS}\\]"):
        CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, sizes)
    config.kv_transfer_config.kv_connector_extra_config["remote_url"] = "tcp://127.0.0.1:1"
    config.kv_transfer_config.kv_connector_extra_config["remote_security"] = "none"
    with pytest.raises(ValueError, match="remote_url with 2 KV cache groups"):
        CrossLayerOffloadConnector(config, KVConnectorRole.SCHEDULER, hybrid)


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
    engine = make_engine(model_dir, h.Variant("BLNHC"))
    prompt = make_prompt(11, 2 * BS + 1)
    run_to_completion(engine, {"a": (prompt, 1)})
    request = engine.add("b", prompt, max_tokens=1)
    assert engine.connector.get_external_cache_hit_sources(request, 2 * BS) == {"host": 2 * BS}


def test_sleep_drains_copies_and_the_pool_serves_after_wake_up(model_dir: str) -> None:
    gate = h.HeldGate(hold={0: threading.Event()})
    engine = make_engine(model_dir, h.Variant("BLNHC"), gates=[gate])
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
    engine = make_engine(model_dir, h.Variant("BLNHC"))
    connector = engine.workers[0].connector
    so = engine.scheduler.schedule()
    connector.bind_connector_metadata(so.kv_connector_metadata)
    connector.start_load_kv(None, scheduler_output=so, request_ids=[], num_tokens=0)
    connector.clear_connector_metadata()


def test_shutdown_releases_the_pool(model_dir: str) -> None:
    engine = make_engine(model_dir, h.Variant("BLNHC"))
    connector = engine.workers[0].connector
    worker = connector._worker
    connector.shutdown()
    assert connector._worker is None
    with pytest.raises(RuntimeError, match="closed"):
        worker.engine.submit_load(99, [0], [1])

