"""A sliding-window hybrid in vLLM's real engine on CPU: a tiny random-weight Gemma-3 text model
(tiny_hybrid.py: sliding-window and full-attention layers, window GEMMA3_WINDOW) with the
connector loaded keeps vLLM's hybrid KV cache manager on (three KV cache groups, as many KV
blocks as without the connector), and reloads after reset_prefix_cache() with identical tokens
and logprobs: the full-attention group's blocks of the prefix and each sliding-window group's
blocks inside the window, proven loaded by vLLM's and the connector's counters, and zeroed pool
slots change the output.

Two engines in all, one at a time: the same model without the connector (its block count), then
with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from engine_checks import compute_then_reload, expect_corruption_seen, expect_loaded, reload
from engine_support import BLOCK_SIZE, forget_everything, generate, running_llm
from tiny_hybrid import GEMMA3_LAYERS, GEMMA3_WINDOW
from tiny_llama import HEAD_SIZE, NUM_KV_HEADS, prompt_ids

from kvconnector.offload.groups import window_blocks

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

PAGE_BYTES = BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2 * 2  # one layer's K and V, bfloat16
# vLLM groups the 6 layers 2 by 2 (two sliding-window groups, one full): a physical block is
# one page of each of 2 layers, whichever group owns it.
NUM_GROUPS = 3
SLOT_BYTES = 2 * PAGE_BYTES
WINDOW_BLOCKS = window_blocks(GEMMA3_WINDOW, BLOCK_SIZE)  # 2: the window before a prefix end


def _kv_cache_config(llm: LLM) -> object:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_hybrid import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-weights"))


@pytest.fixture(scope="module")
def blocks_without_connector(tiny_gemma3: str) -> int:
    """KV blocks vLLM allocates for the model with no connector (its engine stopped before the
    module's engine starts: one engine at a time)."""
    with running_llm(tiny_gemma3, {}, kv_transfer_config=None) as engine:
        return _kv_cache_config(engine).num_blocks


@pytest.fixture(scope="module")
def llm(tiny_gemma3: str, blocks_without_connector: int) -> Iterator[LLM]:
    with running_llm(tiny_gemma3, {"cpu_bytes": 512 * SLOT_BYTES}) as engine:
        yield engine


def test_the_hybrid_manager_stays_on_and_allocates_as_many_blocks_as_without_the_connector(
        llm: LLM, blocks_without_connector: int) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    config = _kv_cache_config(llm)
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups)
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"], kinds
    assert all(g.kv_cache_spec.sliding_window == GEMMA3_WINDOW for g in config.kv_cache_groups
               if isinstance(g.kv_cache_spec, SlidingWindowSpec))
    assert sum(len(g.layer_names) for g in config.kv_cache_groups) == len(GEMMA3_LAYERS)
    assert any(isinstance(g.kv_cache_spec, FullAttentionSpec) for g in config.kv_cache_groups)
    # the hybrid manager off would give every layer full-length KV: 6 pages a block, not 2
    assert config.num_blocks == blocks_without_connector, (config.num_blocks,
                                                           blocks_without_connector)
    assert config.num_blocks * SLOT_BYTES == sum(t.size for t in config.kv_cache_tensors) \
        // NUM_GROUPS  # the groups' tensors alias one buffer


def _reload(llm: LLM, prompt: list[int], loaded_tokens: int) -> None:
    """Compute `prompt`, empty vLLM's prefix cache, run it again: identical, `loaded_tokens`
    loaded from the CPU tier (the full group's blocks and each window's), then the negative
    control."""
    first, again, gained = compute_then_reload(llm, prompt)
    blocks = loaded_tokens // BLOCK_SIZE
    physical = blocks + (NUM_GROUPS - 1) * min(blocks, WINDOW_BLOCKS)
    expect_loaded(gained, again, loaded_tokens, physical * SLOT_BYTES)
    expect_corruption_seen(llm, prompt, first, loaded_tokens)


def test_a_reload_after_reset_gives_identical_tokens_and_logprobs(llm: LLM) -> None:
    # 200 tokens: 6 full blocks stored; the full group loads 6, each window group its last 2
    _reload(llm, prompt_ids(11, 200), 192)


def test_a_block_aligned_prompt_reloads_all_but_its_last_block(llm: LLM) -> None:
    # As vLLM's own prefix cache: the block holding the last token is computed again
    _reload(llm, prompt_ids(12, 192), 160)


def test_a_prompt_extending_a_stored_prefix_loads_it_and_computes_the_rest(llm: LLM) -> None:
    prefix = prompt_ids(13, 200)
    longer = prefix + prompt_ids(1013, 100)
    forget_everything(llm)
    computed = generate(llm, longer)
    forget_everything(llm)
    generate(llm, prefix)
    extended, gained = reload(llm, longer, computed)
    assert extended.num_cached_tokens == 192, extended
    assert gained["kvconnector_hit_tokens"] == 192, gained
    assert gained["kvconnector_load_bytes"] == (6 + 2 * WINDOW_BLOCKS) * SLOT_BYTES, gained
    forget_everything(llm)
