"""The engine tier's checks, as functions of a running LLM, so that every engine shape (TP 1 in
process, TP 2, a separate engine core, another attention backend) runs the same ones.

Each check ends with its negative control: the host pool zeroed under the connector's index, the
same request reloaded, and the output must change; a check that cannot see a corrupt pool proves
nothing. Each leaves every tier empty (`forget_everything`) for the next check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_support import (
    BLOCK_SIZE,
    Generation,
    block_bytes,
    corrupt_pools,
    counted,
    counters,
    forget_everything,
    generate,
    scheduler_connector,
    settle,
)
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM


def reload(llm: LLM, prompt: list[int],
           reference: Generation) -> tuple[Generation, dict[str, float]]:
    """settle() (stores complete, vLLM's prefix cache emptied), then `prompt` again: its tokens
    and logprobs must be `reference`'s. Returns it and what every counter gained meanwhile."""
    settle(llm)
    before = counters(llm)
    again = generate(llm, prompt)
    assert again.same_output(reference), (reference, again)
    return again, counted(llm, before)


def compute_then_reload(llm: LLM,
                        prompt: list[int]) -> tuple[Generation, Generation, dict[str, float]]:
    """Every tier emptied, `prompt` computed (nothing cached), then served from vLLM's own prefix
    cache, then `reload` of it against that reuse: returns (first, again, gained).

    Compared with the reuse, which computes exactly the tokens a reload computes: an engine's
    kernels may depend on the step's shape (vLLM 0.33's TRITON_ATTN runs a query of at most 8
    tokens, such as a 200-token prompt's last 8 after 192 cached, through its split-KV kernel;
    a whole prompt through another), so only the same cut is bit-identical."""
    forget_everything(llm)
    first = generate(llm, prompt)
    assert first.num_cached_tokens == 0, first
    reused = generate(llm, prompt)  # from vLLM's own prefix cache
    assert reused.num_cached_tokens > 0, reused
    again, gained = reload(llm, prompt, reused)
    return first, again, gained


def expect_loaded(gained: dict[str, float], got: Generation, tokens: int,
                  load_bytes: int) -> None:
    """Proof that `tokens` prompt tokens (`load_bytes` bytes, all TP ranks together) came from
    the connector, not vLLM's prefix cache nor a recompute: vLLM's per-request count, and its
    prefix-cache counters and the connector's own in `gained` (what `reload` returns)."""
    assert got.num_cached_tokens == tokens, got
    assert gained["prefix_cache_hits"] == 0, gained  # vLLM's own cache was emptied
    assert gained["external_prefix_cache_hits"] == tokens, gained
    assert gained["kvconnector_hit_tokens"] == tokens, gained
    assert gained["kvconnector_load_bytes"] == load_bytes, gained
    assert gained["kvconnector_failed_loads"] == 0, gained


def loaded_bytes(tokens: int, tensor_parallel_size: int = 1) -> int:
    """Bytes that loading `tokens` moves in a single-group model: every TP rank loads its share
    of each block; vLLM sums the ranks' reports."""
    return tokens // BLOCK_SIZE * block_bytes(tensor_parallel_size) * tensor_parallel_size


def expect_corruption_seen(llm: LLM, prompt: list[int], reference: Generation,
                           tokens: int) -> None:
    """Negative control: zero every pool slot, reload `prompt`: the loaded KV is zeros, so the
    output must differ from `reference` (which the same load gave from intact slots)."""
    settle(llm)
    assert corrupt_pools(llm) > 0
    corrupted = generate(llm, prompt)
    assert corrupted.num_cached_tokens == tokens, corrupted  # it was loaded, from zeros
    assert corrupted.logprobs != reference.logprobs, "zeroed KV blocks changed no logprob"
    forget_everything(llm)


def check_reload_after_reset(llm: LLM, seed: int, tensor_parallel_size: int = 1) -> None:
    """A prompt computed once, vLLM's prefix cache emptied, the same prompt again: its full
    blocks load from the CPU tier and tokens and logprobs are identical."""
    prompt = prompt_ids(seed, 200)
    stored = (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE  # 192: the last 8 tokens are computed
    first, again, gained = compute_then_reload(llm, prompt)
    expect_loaded(gained, again, stored, loaded_bytes(stored, tensor_parallel_size))
    expect_corruption_seen(llm, prompt, first, stored)


def check_block_aligned_reload(llm: LLM, seed: int, tensor_parallel_size: int = 1,
                               length: int = 1984) -> None:
    """A prompt of whole blocks: vLLM's own prefix cache reuses all but its last block (it never
    hits the block with the last token) and computes that block; a reload from the connector
    loads the same blocks and must give the same tokens and logprobs as that reuse, bit for bit.

    Compared with the reuse, not the first run: CPU attention's results for the last block can
    depend on how the prompt was cut into steps (computed whole, or 32 tokens after 1952
    cached), with vLLM's own cache as with the connector; loading every block (vLLM then
    computes only the last token) differs from both."""
    prompt = prompt_ids(seed, length)
    assert len(prompt) % BLOCK_SIZE == 0
    forget_everything(llm)
    first = generate(llm, prompt)
    assert first.num_cached_tokens == 0, first
    before = counters(llm)
    reused = generate(llm, prompt)  # from vLLM's own prefix cache
    assert reused.num_cached_tokens == length - BLOCK_SIZE, reused
    gained = counted(llm, before)
    assert (gained["prefix_cache_hits"], gained["external_prefix_cache_hits"]) == \
        (length - BLOCK_SIZE, 0), gained
    again, gained = reload(llm, prompt, reused)
    loaded = length - BLOCK_SIZE
    expect_loaded(gained, again, loaded, loaded_bytes(loaded, tensor_parallel_size))
    expect_corruption_seen(llm, prompt, reused, length - BLOCK_SIZE)


def check_extending_a_stored_prefix(llm: LLM, seed: int, tensor_parallel_size: int = 1) -> None:
    """A prompt that extends a stored one loads the stored prefix's blocks and computes the
    rest; its output is identical to computing it all (same engine, every tier empty)."""
    prefix = prompt_ids(seed, 200)
    longer = prefix + prompt_ids(seed + 1000, 100)
    forget_everything(llm)
    computed = generate(llm, longer)
    assert computed.num_cached_tokens == 0, computed
    forget_everything(llm)
    generate(llm, prefix)
    extended, gained = reload(llm, longer, computed)
    expect_loaded(gained, extended, 192, loaded_bytes(192, tensor_parallel_size))
    # the longer prompt's own 9 full blocks are now stored: the control reloads all of them
    expect_corruption_seen(llm, longer, computed, 288)


def _zero_slots(worker: Any, slots: list[int]) -> int:  # runs on each worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    pool = get_kv_transfer_group()._worker.pool.slots
    pool[slots] = 0
    return len(slots)


def zero_state_slot(llm: LLM, block_hashes: list[bytes], position: int) -> None:
    """Zero, on every worker, the pool slot holding the state group's block at `position` of a
    request (its block hashes: the `finished_hashes` fixture's), the attention blocks intact."""
    core = scheduler_connector(llm)._core()
    (group,) = [g for g in core.groups if g.state]
    (key,) = core._keys(group, [block_hashes[position]])
    workers = len(llm.collective_rpc(_zero_slots, args=([core.index.slot_of(key)],)))
    assert workers > 0
