"""Serving with and without the connector: time to first token and time per output token under a
prefix-repetition load, through vLLM's real engine, in the same run.

Each engine serves the same workload in its own process: vLLM's `AsyncLLM` (the engine `vllm
serve` runs: its engine core in a process of its own, requests streamed back token by token),
CONCURRENCY requests in flight at a time. Engines:
- `none`: no connector;
- `ours`: CrossLayerOffloadConnector with its CPU tier (`cpu_bytes`);
- `native`: vLLM's own OffloadingConnector (`cpu_bytes_to_use`), on CUDA only: it does not start
  on vLLM's CPU build, and the output says so there.
The workload (seeded, the same for every engine): NUM_PREFIXES random prefixes of PREFIX_LEN
tokens, NUM_PROMPTS prompts, each a prefix and a fresh SUFFIX_LEN-token suffix, in a shuffled
order; greedy, OUTPUT_LEN tokens each (ignore_eos). vLLM's own KV cache holds GPU_BLOCKS blocks,
fewer than the prefixes need, so a prefix that comes back has often left vLLM's cache: a
connector can load it. Before the workload each engine serves a warm-up round of other prompts
and empties its caches.

Per request: TTFT (submit -> first token), TPOT ((last token - first token) / (tokens - 1)) and
the gaps between tokens (ITL). Per engine: medians of TTFT (all prompts, and the prompts whose
prefix came before: "repeated"), of TPOT, the ITL percentiles; the ratios against `none`. The
engines run in PAIRS alternating sequences (none ours [native], then the reverse, ...), so a
drift in the machine's load hits each alike; the ratios are given per pair and pooled.

On vLLM's CPU build every engine runs with VLLM_CPU_NUM_OF_RESERVED_CPU=1, the core vLLM keeps
free of the model's threads without a connector (examples/vllm_cpu.py does the same): for any KV
connector vLLM reserves one more, and on two cores it then reserves none, so the model's threads
contend with the engine core's loop. `--vllm-reservation` leaves vLLM's choice (and shows that).

CPU (vLLM's CPU build, the engine tier's tiny random-weight Llama of tests/engine/tiny_llama.py):

    python benchmarks/bench_serving.py [--pairs 2] [--json PATH] [--plot PATH]

GPU (a Llama-shaped model with vLLM's dummy weights, TRITON_ATTN, VLLM_USE_FLASHINFER_SAMPLER=0,
CUDA graphs unless --eager; the pools: --pool-blocks blocks each, 16-token blocks by default):

    python benchmarks/bench_serving.py --device cuda --hidden 4096 --layers 32 --heads 32 \\
        --kv-heads 8 --prefix-len 4096 --suffix-len 256 --json out.json --plot out.png
    python benchmarks/bench_serving.py --device cuda --model-config path/to/config.json ...
"""

from __future__ import annotations

import argparse
import asyncio
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
ENGINES = ("none", "ours", "native")
RESERVED_CORES = "VLLM_CPU_NUM_OF_RESERVED_CPU"
NATIVE_ON_CPU = ("vLLM's native OffloadingConnector does not start on vLLM's CPU build: its "
                 "engine is left out of this run")
SETTLE_TIMEOUT_S = 300.0
WARMUP_PROMPTS = 4


# ---- the model ----------------------------------------------------------------------------------

def model_shape(config: dict[str, Any]) -> dict[str, int]:
    """Layers, KV heads and head size of a Llama-style config.json."""
    heads = int(config["num_attention_heads"])
    return {"layers": int(config["num_hidden_layers"]),
            "kv_heads": int(config.get("num_key_value_heads", heads)),
            "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads)}


def block_bytes(config: dict[str, Any], block_size: int) -> int:
    """Bytes of one KV block (every layer, K and V, 16-bit)."""
    shape = model_shape(config)
    return block_size * shape["kv_heads"] * shape["head_dim"] * 2 * 2 * shape["layers"]


def write_model(args: argparse.Namespace, directory: Path) -> tuple[str, dict[str, Any], bool]:
    """The model directory, its config, and whether its weights are vLLM's dummy ones: the
    tiny random-weight Llama by default; a config.json given (--model-config) or a Llama shape
    (--hidden/--layers) with dummy weights."""
    if args.model_config is None and args.hidden is None:
        sys.path.insert(0, str(REPO / "tests" / "engine"))
        from tiny_llama import write_tiny_llama

        model = write_tiny_llama(directory / "tiny-llama")
        return model, json.loads((Path(model) / "config.json").read_text()), False
    if args.model_config is not None:
        source = Path(args.model_config)
        config = json.loads((source / "config.json" if source.is_dir() else source).read_text())
    else:
        heads = args.heads or max(1, args.hidden // 128)
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": heads, "num_key_value_heads": args.kv_heads or heads,
            "head_dim": args.hidden // heads, "intermediate_size": args.intermediate or
            int(args.hidden * 3.5), "vocab_size": args.vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}
    model = directory / "dummy-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return str(model), config, True


# ---- the workload -------------------------------------------------------------------------------

def workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The prompts in serving order: each its prefix index, tokens, and whether its prefix was
    served before in this order (`repeated`)."""
    rng = random.Random(args.seed)
    word = lambda: rng.randrange(3, vocab)  # noqa: E731 (ids 0-2: the specials)
    prefixes = [[word() for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    order = [i % args.num_prefixes for i in range(args.num_prompts)]
    rng.shuffle(order)
    seen: set[int] = set()
    prompts = []
    for prefix in order:
        suffix = [word() for _ in range(args.suffix_len)]
        prompts.append({"prefix": prefix, "tokens": prefixes[prefix] + suffix,
                        "repeated": prefix in seen})
        seen.add(prefix)
    return prompts


# ---- one engine (a child process) ---------------------------------------------------------------

def engine_args(args: argparse.Namespace, engine: str, model: str, dummy: bool,
                config: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    max_len = args.prefix_len + args.suffix_len + args.output_len + args.block_size
    pool_bytes = args.pool_blocks * block_bytes(config, args.block_size)
    settings: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", block_size=args.block_size,
        max_model_len=max_len, seed=0, enable_prefix_caching=True,
        kv_cache_memory_bytes=args.gpu_blocks * block_bytes(config, args.block_size),
        max_num_seqs=max(args.concurrency, 4), disable_log_stats=True)
    if max_len > int(config.get("max_position_embeddings", max_len)):
        settings["hf_overrides"] = {"max_position_embeddings": max_len}
    if dummy:
        settings["load_format"] = "dummy"
    if args.device == "cuda":
        settings["attention_backend"] = "TRITON_ATTN"
        settings["enforce_eager"] = args.eager
    else:
        settings["enforce_eager"] = True
    if engine == "ours":
        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CrossLayerOffloadConnector", kv_connector_module_path="kvconnector.vllm",
            kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": pool_bytes})
    elif engine == "native":
        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": pool_bytes})
    return AsyncEngineArgs(**settings)


async def serve(llm: Any, prompts: list[dict[str, Any]], concurrency: int, output_len: int,
                tag: str) -> list[dict[str, Any]]:
    """Serve `prompts` with at most `concurrency` in flight, each streamed token by token; one
    record per prompt, in the workload's order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(concurrency)
    records: list[dict[str, Any]] = [{} for _ in prompts]

    async def one(index: int) -> None:
        async with gate:
            times: list[float] = []
            cached = 0
            start = time.perf_counter()
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompts[index]["tokens"]),
                                          params, request_id=f"{tag}-{index}"):
                now = time.perf_counter()
                times += [now] * len(out.outputs[0].token_ids)  # a delta may bring several
                if out.finished:
                    cached = out.num_cached_tokens or 0
            if len(times) != output_len:
                raise RuntimeError(f"request {index}: {len(times)} tokens of {output_len}")
            gaps = [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)]
            records[index] = {"ttft_s": times[0] - start, "itl_s": gaps,
                              "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1),
                              "cached_tokens": cached, "repeated": prompts[index]["repeated"]}

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records


async def settle(llm: Any, reset_connector: bool) -> None:
    """Empty vLLM's prefix cache (and the connector's tiers) once no store is in flight: vLLM
    refuses while a block is held, and a connector holds a finished request's blocks until
    their stores complete."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not await llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM still holds blocks after {SETTLE_TIMEOUT_S} s")
        await asyncio.sleep(0.05)


async def run_engine(args: argparse.Namespace, engine: str, model: str, dummy: bool,
                     config: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = workload(args, int(config["vocab_size"]))
    warmup = workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 1,
                                            "num_prompts": WARMUP_PROMPTS}),
                      int(config["vocab_size"]))
    llm = AsyncLLM.from_engine_args(engine_args(args, engine, model, dummy, config))
    try:
        await serve(llm, warmup, args.concurrency, args.output_len, "warmup")
        await settle(llm, reset_connector=True)
        load = os.getloadavg()[0]
        cpu = time.process_time()
        start = time.perf_counter()
        records = await serve(llm, prompts, args.concurrency, args.output_len, "run")
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        await settle(llm, reset_connector=False)
    finally:
        llm.shutdown()
    return {"engine": engine, "records": records, "wall_s": wall, "client_cpu_s": cpu,
            "load_average_1min": [load, os.getloadavg()[0]]}


def child(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    result = asyncio.run(run_engine(args, args.engine, args.model, args.dummy, config))
    Path(args.out).write_text(json.dumps(result))
    return 0


# ---- the run (the parent) -----------------------------------------------------------------------

def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures over its runs' records (pooled)."""
    records = [r for run in runs for r in run["records"]]
    repeated = [r for r in records if r["repeated"]]
    itl = [gap for r in records for gap in r["itl_s"]]
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    return {
        "requests": len(records),
        "ttft_median_ms": ms(median([r["ttft_s"] for r in records])),
        "ttft_repeated_median_ms": ms(median([r["ttft_s"] for r in repeated])),
        "ttft_first_seen_median_ms": ms(median([r["ttft_s"] for r in records
                                                if not r["repeated"]])),
        "tpot_median_ms": ms(median([r["tpot_s"] for r in records])),
        "itl_p50_ms": ms(percentile(itl, 0.5)), "itl_p90_ms": ms(percentile(itl, 0.9)),
        "itl_p99_ms": ms(percentile(itl, 0.99)),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
    }


def ratios(figures: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    out = {}
    for key in ("ttft_median_ms", "ttft_repeated_median_ms", "tpot_median_ms", "itl_p90_ms"):
        value, reference = figures.get(key), base.get(key)
        out[key.removesuffix("_ms") + "_vs_none"] = \
            round(value / reference, 3) if value and reference else None
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Pooled figures and ratios per engine, and the ratios of each pair."""
    pooled = {engine: engine_figures(engine_runs) for engine, engine_runs in runs.items()}
    for figures in pooled.values():
        figures.update(ratios(figures, pooled["none"]))
    pairs = []
    for index in range(len(runs["none"])):
        base = engine_figures([runs["none"][index]])
        pairs.append({engine: ratios(engine_figures([engine_runs[index]]), base)
                      for engine, engine_runs in runs.items() if engine != "none"})
    return {"pooled": pooled, "pairs": pairs}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = report["summary"]["pooled"]
    engines = list(pooled)
    fig, (ttft, tpot, itl) = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, title in ((ttft, "ttft_repeated_median_ms", "median TTFT, repeated prefix"),
                             (tpot, "tpot_median_ms", "median TPOT")):
        values = [pooled[e][key] or 0.0 for e in engines]
        bars = axis.bar(engines, values)
        for bar, engine in zip(bars, engines, strict=True):
            ratio = pooled[engine].get(key.removesuffix("_ms") + "_vs_none")
            axis.annotate(f"{ratio:.2f}x" if ratio else "", (bar.get_x() + bar.get_width() / 2,
                                                            bar.get_height()), ha="center",
                          va="bottom")
        axis.set_title(title)
        axis.set_ylabel("ms")
    for engine, engine_runs in report["runs"].items():
        gaps = sorted(g * 1e3 for run in engine_runs for r in run["records"] for g in r["itl_s"])
        if gaps:
            itl.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=engine)
    itl.set_xscale("log")
    itl.set_xlabel("inter-token gap, ms")
    itl.set_title("ITL, cumulative share")
    itl.legend()
    fig.suptitle(f"{report['device']}, {report['model']}, concurrency {report['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parent(args: argparse.Namespace) -> int:
    engines = ["none", "ours"] + (["native"] if args.device == "cuda" else [])
    notes = [] if args.device == "cuda" else [NATIVE_ON_CPU]
    for note in notes:
        print(f"bench_serving: {note}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
        tmp = Path(scratch)
        model, config, dummy = write_model(args, tmp)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        if args.device == "cuda":
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        elif not args.vllm_reservation:  # every engine the cores vLLM gives one without a
            env[RESERVED_CORES] = "1"  # connector (see module doc)
        passthrough = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
            "device", "block_size", "gpu_blocks", "pool_blocks", "prefix_len", "suffix_len",
            "num_prefixes", "num_prompts", "output_len", "concurrency", "seed")]
        passthrough += ["--eager"] if args.eager else []
        for pair in range(args.pairs):
            for engine in engines if pair % 2 == 0 else engines[::-1]:
                out = tmp / f"{pair}-{engine}.json"
                command = [sys.executable, __file__, "--engine", engine, "--model", model,
                           "--out", str(out), *passthrough] + (["--dummy"] if dummy else [])
                print(f"bench_serving: pair {pair + 1}/{args.pairs}, {engine} ...",
                      file=sys.stderr, flush=True)
                subprocess.run(command, env=env, check=True, cwd=tmp)
                runs[engine].append(json.loads(out.read_text()))
                figures = engine_figures(runs[engine][-1:])  # as it goes: a cut run keeps these
                print(f"bench_serving: pair {pair + 1}, {engine}: median TTFT (ms) "
                      f"{figures['ttft_median_ms']}, TPOT (ms) {figures['tpot_median_ms']}",
                      file=sys.stderr, flush=True)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "device": args.device, "command": "python benchmarks/bench_serving.py " +
        " ".join(sys.argv[1:]), "notes": notes,
        "model": "tiny random-weight Llama" if not dummy else "dummy weights",
        "model_shape": model_shape(config), "block_size": args.block_size,
        "block_bytes": block_bytes(config, args.block_size), "gpu_blocks": args.gpu_blocks,
        "pool_blocks": args.pool_blocks, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "num_prefixes": args.num_prefixes,
        "num_prompts": args.num_prompts, "output_len": args.output_len,
        "concurrency": args.concurrency, "pairs": args.pairs,
        "cpu_reserved_cores": env.get(RESERVED_CORES, "vLLM's default") if args.device == "cpu"
        else None,
        "summary": summarize(runs), "runs": runs,
    }
    for engine, figures in report["summary"]["pooled"].items():
        print(f"{engine:7s} {json.dumps(figures)}")
    for index, pair in enumerate(report["summary"]["pairs"]):
        print(f"pair {index + 1}: {json.dumps(pair)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        try:
            plot(report, args.plot)
        except ImportError as exc:  # the engine tier's venv has no matplotlib
            print(f"bench_serving: no plot ({exc}); the figures are above"
                  f"{' and in ' + args.json if args.json else ''}", file=sys.stderr)
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="draw the figures here (a PNG; needs matplotlib)")
    parser.add_argument("--pairs", type=int, default=2, help="engine sequences, alternately "
                        "forward and backward")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda where torch sees one")
    parser.add_argument("--model-config", help="a Llama-style config.json (or its directory), "
                        "run with vLLM's dummy weights")
    parser.add_argument("--hidden", type=int, help="a Llama shape with dummy weights: hidden size")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, help="default: hidden / 128")
    parser.add_argument("--kv-heads", type=int, help="default: heads")
    parser.add_argument("--intermediate", type=int, help="default: 3.5 x hidden")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--eager", action="store_true", help="CUDA: no CUDA graphs")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default: 32 on CPU, 16 on CUDA)")
    parser.add_argument("--gpu-blocks", type=int, default=None,
                        help="vLLM's own KV cache, in blocks: fewer than the prefixes need "
                        "(default: 1.6 x concurrency prompts' blocks, rounded up to 16)")
    parser.add_argument("--pool-blocks", type=int, default=4096,
                        help="the connectors' CPU pool, in blocks")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-reservation", action="store_true",
                        help=f"CPU: leave {RESERVED_CORES} unset, so vLLM reserves one more core "
                        "for an engine with a connector than for one without")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.block_size is None:
        args.block_size = 32 if args.device == "cpu" else 16
    if args.gpu_blocks is None:  # room for the requests in flight, and a few prefixes more
        prompt_blocks = -(-(args.prefix_len + args.suffix_len + args.output_len)
                          // args.block_size)
        args.gpu_blocks = -(-int(1.6 * args.concurrency * prompt_blocks) // 16) * 16
    return child(args) if args.engine else parent(args)


if __name__ == "__main__":
    sys.exit(main())
