"""The block-major path in vLLM's real engine on CPU: under the reference backend REF_ATTN
(ref_attention.py), which declares the block-outermost layouts, vLLM takes the connector's
BHLNC, every layer's view is strided into one buffer (a layer's heads num_layers pages apart),
the connector moves each block in one copy, and the engine tier's checks hold as under CPU_ATTN:
a reload after reset_prefix_cache() and a prompt extending a stored prefix give identical tokens
and logprobs, proven loaded by vLLM's and the connector's counters, and zeroed pool slots change
the output (engine_checks.py)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING
from unittest.mock import patch

import pytest
from engine_checks import check_extending_a_stored_prefix, check_reload_after_reset
from engine_support import block_bytes, on_gpu, running_llm

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    on_gpu(), reason="REF_ATTN stands in for CPU_ATTN; the GPU engine's TRITON_ATTN reads "
                     "block-major views itself (test_engine_gpu.py)")]

LAYOUT = "BHLNC"  # block outermost, heads next: the per-layer view is not even page-dense


def test_a_layout_the_picked_backend_is_not_known_to_read_stops_the_engine_at_start_up(
        tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # As with vLLM's AMX_MLA, which takes BLNHC and fails on its first forward: with REF_ATTN
    # unproven, the worker refuses the layout vLLM took before any forward (first in this
    # module: the module's engine is not started yet).
    from ref_attention import NAME, ref_attention_backend
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from kvconnector.layout import registry

    unproven = dataclasses.replace(registry.lookup(NAME), reads_strides=False)
    monkeypatch.setitem(registry._REGISTRY, NAME, unproven)
    try:
        with ref_attention_backend(), pytest.raises(ValueError, match=(
                "asked for KV cache layout BLNHC .* and vLLM resolved it, but attention backend "
                "REF_ATTN reads the cache and is not known to read")), running_llm(
                    tiny_model, {"cpu_bytes": 256 * block_bytes(), "layout": "BLNHC"}):
            pass
    finally:  # the failed engine's process-wide state: vLLM keeps its worker-side connector
        ensure_kv_transfer_shutdown()  # global, and the next engine would reuse that one
        cleanup_dist_env_and_memory()
        gc.collect()


@pytest.fixture(scope="module")
def started(tiny_model: str) -> Iterator[tuple[LLM, list[str]]]:
    """The engine under REF_ATTN, and what the connector logged while it started."""
    from ref_attention import ref_attention_backend

    from kvconnector.vllm import connector

    logger = connector.logger
    with ExitStack() as stack:
        # The layers take their backend when the model is built: inside the block.
        with patch.object(logger, "info", wraps=logger.info) as info, ref_attention_backend():
            llm = stack.enter_context(running_llm(tiny_model, {"cpu_bytes": 256 * block_bytes(),
                                                               "layout": LAYOUT}))
        yield llm, [call.args[0] % call.args[1:] for call in info.call_args_list]


@pytest.fixture(scope="module")
def llm(started: tuple[LLM, list[str]]) -> LLM:
    return started[0]


def _worker_path(worker: object) -> tuple[str, str, int, str, list[tuple]]:  # runs on the worker
    from ref_attention import RefAttentionImpl
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    config = worker.vllm_config
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    impls = {type(layer.impl) for layer in layers.values()}
    assert impls == {RefAttentionImpl}, impls
    offload = get_kv_transfer_group()._worker
    views = {(tuple(layer.kv_cache.shape[1:]), layer.kv_cache.stride())
             for layer in layers.values()}
    return (config.cache_config.kv_cache_layout, offload.mode, offload.copies_per_block,
            offload.describe(), sorted(views))


def test_vllm_resolves_the_block_outermost_layout_blocks_move_in_one_copy_and_reload(
        started: tuple[LLM, list[str]]) -> None:
    llm, lines = started
    ((layout, mode, copies, described, strides),) = llm.collective_rpc(_worker_path)
    assert (layout, mode, copies) == (LAYOUT, "block-major", 1)
    # Each layer's [B, H, N, C] view (bf16 elements): blocks a whole block of all 4 layers apart,
    # heads 4 layers' (N, C) rows apart: nothing a kernel computing block x page would find.
    rows = 32 * 64  # N x C of one head of one layer
    assert strides == [((2, 32, 64), (2 * 4 * rows, 4 * rows, 64, 1))]
    assert lines == [f"CrossLayerOffloadConnector rank 0: asked for {LAYOUT} (set in "
                     f"kv_connector_extra_config), vLLM resolved {LAYOUT} for REF_ATTN; "
                     f"{described}"]
    assert described.startswith("block-major: 1 copy per block; ")
    check_reload_after_reset(llm, seed=1)


def test_a_prompt_extending_a_stored_prefix_loads_it_and_computes_the_rest(llm: LLM) -> None:
    check_extending_a_stored_prefix(llm, seed=2)
