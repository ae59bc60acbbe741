"""Admission in vLLM's real CPU engine (TP 1, in process), `store_threshold` 2: a prompt seen
once stores nothing, seen twice stores its blocks, which then reload identically; a request
whose `kv_transfer_params` say `max_offload_tokens: 0` stores nothing while its neighbour in the
same steps does (both seen twice); one with `max_load_tokens: 0` recomputes a stored prefix.

A prompt of 200 tokens and 16 generated: 6 full blocks are computed (the 7th is never full),
and a lookup offers all 6 (192 tokens) to a later request with the same prompt. A load is
compared with vLLM's own prefix-cache reuse of the same 192 tokens (`reused`;
engine_checks.compute_then_reload says why), a recompute with the first computation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from engine_support import (
    Generation,
    block_bytes,
    counted,
    counters,
    forget_everything,
    running_llm,
    settle,
)
from request_support import generate_for, generate_together
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

BLOCKS = 6  # full blocks of a 200-token prompt + 16 generated tokens
LOADABLE = 192  # tokens a lookup offers for the same 200-token prompt


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[LLM]:
    with running_llm(tiny_model, {"cpu_bytes": 64 * block_bytes(), "store_threshold": 2}) as engine:
        yield engine


def reused(llm: LLM, prompt: list[int]) -> Generation:
    """`prompt` served from vLLM's own prefix cache, which must still hold it (no settle since it
    was computed). It offloads nothing, so it is no offer the store threshold counts."""
    got = generate_for(llm, prompt, kv_transfer_params={"max_offload_tokens": 0})
    assert got.num_cached_tokens == LOADABLE, got
    return got


def test_threshold_two_a_prompt_seen_once_stores_nothing_seen_twice_stores_its_blocks(
        llm: LLM) -> None:
    prompt = prompt_ids(51, 200)
    forget_everything(llm)
    before = counters(llm)
    first = generate_for(llm, prompt)
    reference = reused(llm, prompt)
    settle(llm)
    gained = counted(llm, before)
    assert gained["kvconnector_store_bytes"] == 0, gained
    assert gained["kvconnector_threshold_skipped_blocks"] == BLOCKS, gained

    before = counters(llm)
    second = generate_for(llm, prompt)  # vLLM's prefix cache was emptied: computed again
    settle(llm)
    gained = counted(llm, before)
    assert second.same_output(first), (first, second)
    assert gained["kvconnector_hit_tokens"] == 0, gained  # nothing was stored to load
    assert gained["kvconnector_store_bytes"] == BLOCKS * block_bytes(), gained
    assert gained["kvconnector_threshold_skipped_blocks"] == 0, gained

    before = counters(llm)
    third = generate_for(llm, prompt)
    gained = counted(llm, before)
    assert third.same_output(reference), (reference, third)
    assert third.num_cached_tokens == LOADABLE, third
    assert gained["kvconnector_hit_tokens"] == LOADABLE, gained
    assert gained["kvconnector_load_bytes"] == LOADABLE // 32 * block_bytes(), gained
    forget_everything(llm)


def test_a_request_that_skips_offloading_stores_nothing_while_its_neighbour_does(
        llm: LLM) -> None:
    quiet, loud = prompt_ids(52, 200), prompt_ids(53, 200)
    skip = {"max_offload_tokens": 0}
    forget_everything(llm)
    for _ in range(2):  # both seen twice: past the threshold
        generate_together(llm, [(quiet, None, skip), (loud, None, None)])
        reference = reused(llm, loud)
        settle(llm)
    before = counters(llm)
    quiet_again = generate_for(llm, quiet)
    loud_again = generate_for(llm, loud)
    gained = counted(llm, before)
    assert loud_again.same_output(reference), (reference, loud_again)
    assert (quiet_again.num_cached_tokens, loud_again.num_cached_tokens) == (0, LOADABLE)
    assert gained["kvconnector_hit_tokens"] == LOADABLE, gained
    forget_everything(llm)


def test_a_request_that_skips_loading_recomputes_a_stored_prefix(llm: LLM) -> None:
    prompt = prompt_ids(54, 200)
    forget_everything(llm)
    for _ in range(2):
        computed = generate_for(llm, prompt)
        reference = reused(llm, prompt)
        settle(llm)
    before = counters(llm)
    recomputed = generate_for(llm, prompt, kv_transfer_params={"max_load_tokens": 0})
    settle(llm)
    gained = counted(llm, before)
    assert recomputed.same_output(computed), (computed, recomputed)
    assert recomputed.num_cached_tokens == 0, recomputed
    assert (gained["kvconnector_hit_tokens"], gained["kvconnector_load_bytes"]) == (0, 0), gained
    loaded = generate_for(llm, prompt)  # without the field: the stored prefix loads
    assert loaded.num_cached_tokens == LOADABLE and loaded.same_output(reference), loaded
    forget_everything(llm)
