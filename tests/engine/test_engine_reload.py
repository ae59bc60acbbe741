"""vLLM's real engine on CPU, TP 1, engine core and worker in this process: a reload from the
CPU tier after vLLM's prefix cache is emptied, and a prompt extending a stored prefix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from engine_checks import (
    check_block_aligned_reload,
    check_extending_a_stored_prefix,
    check_reload_after_reset,
)
from engine_support import block_bytes, expected_copy_path, on_gpu, running_llm

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[LLM]:
    with running_llm(tiny_model, {"cpu_bytes": 256 * block_bytes()}) as engine:
        yield engine


def _worker_path(worker: object) -> tuple[str, int, str]:  # runs on the worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    offload = get_kv_transfer_group()._worker
    return offload.mode, offload.copies_per_block, worker.vllm_config.cache_config.kv_cache_layout


def test_blocks_move_as_the_backend_allows_and_a_reload_is_identical(llm: LLM) -> None:
    # CPU_ATTN declares only LBHNC: the connector copies each layer's page of a block;
    # TRITON_ATTN (the GPU engine) takes a block-outermost layout: one copy a block.
    (found,) = llm.collective_rpc(_worker_path)
    assert found[:2] == expected_copy_path(), found
    assert found[2] in (("BLNHC", "BLHNC", "BHLNC") if on_gpu() else ("LBHNC",)), found
    check_reload_after_reset(llm, seed=1)


def test_a_prompt_extending_a_stored_prefix_loads_it_and_computes_the_rest(llm: LLM) -> None:
    check_extending_a_stored_prefix(llm, seed=2)


def test_a_block_aligned_prompt_reloads_all_but_its_last_block(llm: LLM) -> None:
    check_block_aligned_reload(llm, seed=3)
