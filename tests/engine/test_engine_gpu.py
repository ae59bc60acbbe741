"""vLLM's real GPU engine with the connector (marker `gpu_engine`: a CUDA build of vLLM on a CUDA
machine; skipped elsewhere). The engine tier's own checks (engine_checks.py) run unchanged on
TRITON_ATTN, the tiny random-weight Llama, TP 1, engine core and worker in this process, in each
mode a serving engine runs: eager or CUDA graphs (+ torch.compile), async scheduling on or off.

Each mode asserts what the worker really did (vLLM resolved a block-outermost layout, one copy a
block, host slots in pinned memory), then a reload after reset_prefix_cache(), a block-aligned
prompt and a prompt extending a stored prefix, identical in tokens and logprobs and counted by
vLLM and the connector alike, each ending with its negative control (zeroed slots change the
output). One more check: vLLM's prefix cache can be reset as soon as a long prompt's stores are
reported, on an engine's first long prompt too.

Run on a CUDA machine where a CUDA build of vLLM imports (0.32 or 0.33; a machine without network
can take vLLM's Python files and kernel library on PYTHONPATH): `pytest -m gpu_engine tests/engine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from engine_checks import (
    check_block_aligned_reload,
    check_extending_a_stored_prefix,
    check_reload_after_reset,
)
from engine_support import (
    block_bytes,
    forget_everything,
    generate,
    running_llm,
    scheduler_connector,
)
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.gpu_engine

MODES: dict[str, dict[str, Any]] = {
    "eager-async": dict(enforce_eager=True, async_scheduling=True),
    "graphs-async": dict(enforce_eager=False, async_scheduling=True),
    "eager-sync": dict(enforce_eager=True, async_scheduling=False),
    "graphs-sync": dict(enforce_eager=False, async_scheduling=False),
}


@pytest.fixture(scope="module", params=list(MODES))
def llm(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[LLM]:
    with running_llm(tiny_model, {"cpu_bytes": 256 * block_bytes()},
                     attention_backend="TRITON_ATTN", **MODES[request.param]) as engine:
        yield engine


def _worker_path(worker: object) -> tuple[str, int, str, bool, str]:  # runs on the worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    offload = get_kv_transfer_group()._worker
    return (offload.mode, offload.copies_per_block,
            worker.vllm_config.cache_config.kv_cache_layout,
            bool(offload.pool.slots.is_pinned()), str(offload._gpu_rows[0].device))


def test_the_connector_copies_whole_blocks_between_the_gpu_and_pinned_slots(llm: LLM) -> None:
    ((mode, copies, layout, pinned, device),) = llm.collective_rpc(_worker_path)
    assert (mode, copies, pinned) == ("block-major", 1, True), (mode, copies, layout, pinned)
    assert layout in ("BLNHC", "BLHNC", "BHLNC") and device.startswith("cuda"), (layout, device)


def test_a_reload_after_reset_is_identical(llm: LLM) -> None:
    check_reload_after_reset(llm, seed=1)


def test_a_prompt_extending_a_stored_prefix_loads_it_and_computes_the_rest(llm: LLM) -> None:
    check_extending_a_stored_prefix(llm, seed=2)


def test_a_block_aligned_prompt_reloads_all_but_its_last_block(llm: LLM) -> None:
    check_block_aligned_reload(llm, seed=3)


def test_the_prefix_cache_resets_once_a_long_prompts_stores_are_reported(llm: LLM) -> None:
    """reset_prefix_cache() succeeds as soon as the connector has no store in flight, for a long
    prompt as for a short one (the connector must not hold a finished request's blocks longer
    than its stores)."""
    forget_everything(llm)
    prompt = prompt_ids(4, 1900)
    first = generate(llm, prompt)
    assert first.num_cached_tokens == 0, first
    connector = scheduler_connector(llm)
    for _ in range(100):  # steps until the stores are reported (settle would retry the reset)
        if not connector.has_pending_push_work():
            break
        llm.llm_engine.step()
    assert not connector.has_pending_push_work()
    assert llm.reset_prefix_cache(), "vLLM refused the reset: a block is still held"
    again = generate(llm, prompt)
    assert again.same_output(first) and again.num_cached_tokens == 1888, again
    forget_everything(llm)
