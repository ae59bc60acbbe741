"""Prefetch in vLLM's real CPU engine (TP 1, in process) over a remote store: a queue of 16
requests whose prefixes sit only in the store (a fresh engine: its pool is empty), served with
and without `prefetch_blocks` in the same run. vLLM starts a request's load as soon as it can
give it GPU blocks, so the engines serving the queue get KV cache for 2 requests: the others
wait in vLLM's queue, where prefetch moves their blocks. One runs at a time (as the first engine
computed them: CPU attention's numbers depend on the batch).

A first engine, set up as those serving the queue, computes the 16 prompts one by one (200
tokens each: 6 full blocks go to the store), each served once more from its own prefix cache.
Each next engine gets all 16 at once: every output (tokens and logprobs) is identical to that
reuse of the same 192 tokens in the first engine; every loadable token is a hit; without
prefetch all of them come from the store, with it the blocks fetched ahead are pool hits, and
the store serves exactly the rest. The sum over the requests of their time from queued to first
token is printed for both, with their ratio, not asserted: speed is measured by benchmarks,
never by a timed test (benchmarks/bench_prefetch.py measures what prefetch hides: a queue
whose every request is mostly its fetch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from engine_support import (
    Generation,
    block_bytes,
    counted,
    counters,
    generate,
    running_llm,
    settle,
)
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

    from kvconnector.servers.store import StoreProcess

pytestmark = pytest.mark.engine

PROMPTS = [prompt_ids(60 + i, 200) for i in range(16)]
LOADABLE = 192  # tokens of each prompt a lookup offers (6 full blocks)
REMOTE_DEADLINE_S = 30.0
MAX_LEN = 256  # a request needs 7 blocks of 32 tokens (200 + 16); vLLM checks 8 fit
GPU_BLOCKS = 16  # KV cache for 2 requests
QUEUE_ENGINE = dict(max_num_seqs=1, max_model_len=MAX_LEN,
                    kv_cache_memory_bytes=GPU_BLOCKS * block_bytes())


def _extra(url: str, prefetch_blocks: int) -> dict[str, Any]:
    return {"cpu_bytes": 128 * block_bytes(), "remote_url": url, "remote_security": "none",
            "remote_lookup_deadline_s": REMOTE_DEADLINE_S, "remote_timeout_s": REMOTE_DEADLINE_S,
            "prefetch_blocks": prefetch_blocks, "prefetch_deadline_s": REMOTE_DEADLINE_S}


@pytest.fixture(scope="module")
def computed(tiny_model: str, store: StoreProcess) -> list[Generation]:
    """Each prompt computed, then served from vLLM's own prefix cache: a load of its 192 tokens
    is compared with that reuse (engine_checks.compute_then_reload says why), in an engine set
    up as the ones serving the queue (a GPU's attention kernels depend on those sizes)."""
    outputs = []
    with running_llm(tiny_model, _extra(store.url, 0), **QUEUE_ENGINE) as llm:
        for prompt in PROMPTS:
            assert generate(llm, prompt).num_cached_tokens == 0
            outputs.append(generate(llm, prompt))
            assert outputs[-1].num_cached_tokens == LOADABLE, outputs[-1]
        settle(llm)  # every put done
    return outputs


def serve_queue(llm: LLM) -> tuple[list[Generation], list[float]]:
    """All 16 prompts at once; each one's output and its queued-to-first-token seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                           use_tqdm=False)
    generations, waits = [], []
    for output in outputs:
        generations.append(Generation.of(output))
        waits.append(output.metrics.first_token_ts - output.metrics.queued_ts)
    return generations, waits


def test_a_queue_served_with_prefetch_loads_from_the_pool_identically(
        tiny_model: str, store: StoreProcess, computed: list[Generation]) -> None:
    totals = {}
    for prefetch_blocks in (0, 96):
        with running_llm(tiny_model, _extra(store.url, prefetch_blocks), **QUEUE_ENGINE) as llm:
            before = counters(llm)
            outputs, waits = serve_queue(llm)
            gained = counted(llm, before)
        for i, (got, want) in enumerate(zip(outputs, computed, strict=True)):
            assert got.same_output(want), (i, want, got)
            assert got.num_cached_tokens == LOADABLE, (i, got)
        prefetched = gained["kvconnector_prefetched_blocks"]
        assert gained["kvconnector_hit_tokens"] == len(PROMPTS) * LOADABLE, gained
        assert gained["kvconnector_failed_loads"] == 0, gained
        # every block fetched ahead served one request from the pool; the store the rest
        assert gained["kvconnector_remote_hit_tokens"] == \
            len(PROMPTS) * LOADABLE - prefetched * 32, gained
        if prefetch_blocks:
            assert prefetched >= 6 * (len(PROMPTS) - 2), gained  # all but the first two
        else:
            assert prefetched == 0, gained
        totals[prefetch_blocks] = sum(waits)
    print(f"\nqueued-to-first-token, 16 requests, summed: without prefetch {totals[0]:.3f} s, "
          f"with {totals[96]:.3f} s, ratio {totals[96] / totals[0]:.2f}")
