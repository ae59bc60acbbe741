"""A linear-attention hybrid in vLLM's real engine on CPU: a tiny random-weight Qwen3-Next
(tiny_hybrid.py: Gated DeltaNet layers, a Mamba-type state group in vLLM's "align" cache mode,
and full attention; vLLM raises the block size to unify the pages, to a size that depends on the
machine's CPU kernels: 256 or 384 tokens here, read back from the engine, never assumed) starts
with the connector, the hybrid manager on, and reloads after reset_prefix_cache() with identical
tokens and logprobs: the attention group's blocks and the state group's block at the prefix end
(the recurrent state there), counted by vLLM and the connector. A state written during decode (a
chat's next turn reaching past the first turn's prompt) reloads identically to vLLM's own reuse
of it. Controls: only the state's slot zeroed, and every slot zeroed: the output must change.

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
    reload,
    zero_state_slot,
)
from engine_support import (
    forget_everything,
    generate,
    on_gpu,
    running_llm,
    scheduler_connector,
    settle,
)
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    on_gpu(), reason="Qwen3-Next's MoE layers do not start in the GPU engine built without vLLM's "
                     "MoE kernels; Gemma 3 and LFM2 cover hybrid groups there")]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    from tiny_hybrid import write_tiny_qwen3_next

    model = write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next-weights"))
    # block_size None: vLLM sizes the blocks so an attention page is as large as a state's
    with running_llm(model, {"cpu_bytes": 64 << 20}, block_size=None) as engine:
        yield engine


@pytest.fixture(scope="module")
def bs(llm: LLM) -> int:
    """The block size vLLM chose for every group (it unifies the attention and state pages)."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    (size,) = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    assert config.hash_block_size == size and size >= 16, config
    return size


def state_load_bytes(llm: LLM, tokens: int, bs: int) -> int:
    """What loading `tokens` moves: the attention group's blocks and one state block."""
    return (tokens // bs + 1) * scheduler_connector(llm)._tiers.slot_bytes


def test_the_hybrid_manager_stays_on_with_a_gated_deltanet_group(llm: LLM, bs: int) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    assert {type(s) for s in specs} == {MambaSpec, FullAttentionSpec}, specs
    assert [s.mamba_cache_mode for s in specs if isinstance(s, MambaSpec)] == ["align"]
    # one page size for both groups: the state page padded to the attention page of `bs` tokens
    assert len({s.page_size_bytes for s in specs}) == 1, specs
    assert {s.block_size for s in specs} == {bs} and bs > 16  # raised above the default
    assert [g.state for g in scheduler_connector(llm)._core().groups] == \
        [isinstance(s, MambaSpec) for s in specs]


def test_a_reload_restores_the_attention_blocks_and_the_recurrent_state(
        llm: LLM, bs: int, finished_hashes: list[list[bytes]]) -> None:
    prompt = prompt_ids(31, 2 * bs + 88)  # vLLM's align mode ends its first chunk at 2 blocks
    first, again, gained = compute_then_reload(llm, prompt)
    expect_loaded(gained, again, 2 * bs, state_load_bytes(llm, 2 * bs, bs))
    # negative control 1: only the state's slot zeroed (the attention blocks intact)
    settle(llm)
    zero_state_slot(llm, finished_hashes[0], 1)
    corrupted = generate(llm, prompt)
    assert corrupted.num_cached_tokens == 2 * bs, corrupted
    assert corrupted.logprobs != first.logprobs, "a zeroed state changed no logprob"
    # negative control 2: every slot zeroed
    expect_corruption_seen(llm, prompt, first, 2 * bs)


def test_a_state_written_during_decode_reloads_as_vllm_reuses_it(
        llm: LLM, bs: int, finished_hashes: list[list[bytes]]) -> None:
    # The first turn's prompt ends 12 tokens short of 2 blocks: its decode computes position
    # 2 * bs - 1 and keeps the state there. The next turn (prompt + answer) resumes from it.
    prompt = prompt_ids(32, 2 * bs - 12)
    forget_everything(llm)
    answer = generate(llm, prompt)
    turn = prompt + list(answer.token_ids)
    reused = generate(llm, turn)  # vLLM's own prefix cache: the decoded state, not recomputed
    assert reused.num_cached_tokens == 2 * bs, reused
    again, gained = reload(llm, turn, reused)
    expect_loaded(gained, again, 2 * bs, state_load_bytes(llm, 2 * bs, bs))
    # control: the decoded state's slot zeroed
    settle(llm)
    zero_state_slot(llm, finished_hashes[0], 1)
    corrupted = generate(llm, turn)
    assert corrupted.num_cached_tokens == 2 * bs, corrupted
    assert corrupted.logprobs != reused.logprobs, "a zeroed decoded state changed no logprob"
    forget_everything(llm)
