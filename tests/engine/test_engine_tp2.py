"""vLLM's real engine at TP 2: two worker processes (on CPU one core each, on a GPU machine one GPU
each) under an engine core in its own process, as `vllm serve` and a default `LLM` run it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from engine_checks import check_reload_after_reset
from engine_support import block_bytes, expected_copy_path, on_gpu, running_llm

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine


def _two_gpus_if_on_gpu() -> None:
    import torch

    if on_gpu() and torch.cuda.device_count() < 2:
        pytest.skip("TP 2 in the GPU engine needs two GPUs")


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[LLM]:
    _two_gpus_if_on_gpu()
    with running_llm(tiny_model, {"cpu_bytes": 256 * block_bytes(2)}, tensor_parallel_size=2,
                     in_process=False) as engine:
        yield engine


def _rank_path(worker: object) -> tuple[int, str, int, int]:  # runs on each worker
    import os

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    offload = get_kv_transfer_group()._worker
    return os.getpid(), offload.mode, offload.copies_per_block, offload.block_bytes


def test_two_workers_in_their_own_processes_offload_their_halves_and_reload_identically(
        llm: LLM) -> None:
    import os

    ranks = llm.collective_rpc(_rank_path)
    pids = {pid for pid, *_ in ranks}
    assert len(pids) == 2 and os.getpid() not in pids, ranks
    assert [path for _, *path in ranks] == [[*expected_copy_path(), block_bytes(2)]] * 2
    check_reload_after_reset(llm, seed=11, tensor_parallel_size=2)
