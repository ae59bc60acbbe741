"""A state hybrid in vLLM's real engine on CPU: a tiny random-weight LFM2 (tiny_hybrid.py: short
convolutions, a Mamba-type state group in vLLM's "align" cache mode, and full attention) starts
with the connector, the hybrid manager on, and reloads after reset_prefix_cache() with identical
tokens and logprobs: the attention group's blocks of the prefix and the state group's block at
the prefix's last position (the convolution state there), proven loaded by vLLM's and the
connector's counters. Two negative controls: every pool slot zeroed, and only the state group's
slot zeroed (the state is restored and read, not recomputed): the output must change.

One engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from engine_checks import (
    compute_then_reload,
    expect_corruption_seen,
    expect_loaded,
    zero_state_slot,
)
from engine_support import BLOCK_SIZE, generate, running_llm, scheduler_connector, settle
from tiny_llama import HEAD_SIZE, NUM_KV_HEADS, prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

# vLLM pads the state page to the attention page; a physical block is one page of 2 layers
SLOT_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2 * 2


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    from tiny_hybrid import write_tiny_lfm2

    model = write_tiny_lfm2(tmp_path_factory.mktemp("tiny-lfm2-weights"))
    with running_llm(model, {"cpu_bytes": 512 * SLOT_BYTES}) as engine:
        yield engine


def test_the_hybrid_manager_stays_on_with_a_state_group(llm: LLM) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    assert len(specs) == 2, specs
    assert {type(s) for s in specs} == {MambaSpec, FullAttentionSpec}, specs
    assert all(s.mamba_cache_mode == "align" for s in specs if isinstance(s, MambaSpec))
    assert [g.state for g in scheduler_connector(llm)._core().groups] == \
        [isinstance(s, MambaSpec) for s in specs]


@pytest.mark.parametrize(("seed", "length", "loaded"), [(21, 200, 192), (22, 192, 160)],
                         ids=["200 tokens", "block-aligned 192"])
def test_a_reload_restores_the_attention_blocks_and_the_state(
        llm: LLM, finished_hashes: list[list[bytes]], seed: int, length: int,
        loaded: int) -> None:
    prompt = prompt_ids(seed, length)
    first, again, gained = compute_then_reload(llm, prompt)
    blocks = loaded // BLOCK_SIZE
    # the attention group's blocks and one state block
    expect_loaded(gained, again, loaded, (blocks + 1) * SLOT_BYTES)
    # negative control 1: only the state's slot zeroed (the attention blocks intact)
    settle(llm)
    zero_state_slot(llm, finished_hashes[0], blocks - 1)
    corrupted = generate(llm, prompt)
    assert corrupted.num_cached_tokens == loaded, corrupted
    assert corrupted.logprobs != first.logprobs, "a zeroed state changed no logprob"
    # negative control 2: every slot zeroed
    expect_corruption_seen(llm, prompt, first, loaded)
