"""Time to first token of long prompts in vLLM's real GPU engine (bench_engine.py on CUDA).

In one run, for each model shape and prompt length, the time to first token (TTFT: the wall time
of a 1-token greedy generation, the engine doing nothing else) of:
- `computed`: a fresh prompt, computed by an engine without a connector;
- `gpu hit`: the same prompt again, from vLLM's own GPU prefix cache (the best any reload can do);
- `ours`: the prompt again after `reset_prefix_cache()`, its full blocks loaded by this connector
  from its pinned CPU pool (all but the block holding the last token, which vLLM computes);
- `native`: the same through vLLM's own `OffloadingConnector` (its CPU tier, `cpu_bytes_to_use`).
Each engine runs in its own process (engine core and worker in it: the bench steps the engine
until every store is reported before the GPU hit and before it resets vLLM's cache), one after
the other, over the same prompts; each engine also records its own computed and GPU-hit times.
Medians over the prompts.

The PCIe floor of a reload is the GPU hit's time (the engine without a connector) plus the bytes
loaded over the same run's host-to-device ceiling (one pinned 1 GiB copy, measured before the
engines start): a reload costs at least the hit's work and its bytes' time on the link.
`ours-hit/pcie` is (ours - hit) / (bytes / ceiling).

Models: config.json only, `load_format="dummy"` weights (timing only: the first step of every
reload is still compared with the GPU hit's, token and logprob, and a mismatch is reported).
Shapes: `llama-8b` (Llama-3.1-8B: 32 layers, 8 KV heads of 128: 2 MiB blocks of 16 tokens) and
`llama-70b-tp8` (one rank of Llama-3.1-70B at TP 8: 80 layers, 1 KV head of 128: 640 KiB blocks),
TRITON_ATTN, eager (`--graphs` for CUDA graphs + torch.compile).

    python benchmarks/bench_engine.py [--shapes llama-8b,llama-70b-tp8] [--lengths 4096,...]
        [--prompts 3] [--json PATH] [--plot PATH]
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
BLOCK_SIZE = 16
ENGINES = ("none", "ours", "native")
CPU_POOL_BYTES = 12 << 30  # each connector's CPU tier: the longest prompt thrice over
SETTLE_TIMEOUT_S = 120.0
SHAPES: dict[str, dict[str, int]] = {
    "llama-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # one TP-8 rank of Llama-3.1-70B: the rank's heads and KV heads, its share of the MLP
    "llama-70b-tp8": dict(num_hidden_layers=80, hidden_size=1024, intermediate_size=3584,
                          num_attention_heads=8, num_key_value_heads=1, head_dim=128),
}
VOCAB_SIZE = 128256


def token_bytes(shape: dict[str, int]) -> int:
    """KV bytes of one token (every layer, K and V, bfloat16)."""
    return shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2


def write_model(path: Path, shape: dict[str, int], max_len: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB_SIZE,
                  max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=500000.0,
                  torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, hidden_act="silu", **shape)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


# --- one engine (a child process) -----------------------------------------------------------

def start_engine(model: str, engine: str, max_len: int, graphs: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if engine == "ours":
        transfer = KVTransferConfig(
            kv_connector="CrossLayerOffloadConnector", kv_connector_module_path="kvconnector.vllm",
            kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": CPU_POOL_BYTES})
    elif engine == "native":
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"cpu_bytes_to_use": CPU_POOL_BYTES})
    return LLM(model=model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
               enforce_eager=not graphs, attention_backend="TRITON_ATTN", block_size=BLOCK_SIZE,
               max_model_len=max_len, gpu_memory_utilization=0.85, seed=0,
               enable_prefix_caching=True, kv_transfer_config=transfer,
               disable_log_stats=engine != "ours")  # ours: its load_seconds counter is read


def load_seconds(llm) -> float:
    """The connector's own measure of its loads so far (submit to completion, summed)."""
    from vllm.v1.metrics.reader import Counter

    return sum(m.value for m in llm.get_metrics()
               if isinstance(m, Counter) and m.name == "vllm:kvconnector_load_seconds")


def timed(llm, prompt: list[int]) -> tuple[float, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, ignore_eos=True,
                            detokenize=False)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start, out


def drain(llm, reset: bool = False) -> None:
    """Step the engine until the connector has no store in flight (a store's copies would share
    the PCIe link and the GPU with the next timed request); with `reset`, then empty vLLM's
    prefix cache (vLLM refuses while a block is still held)."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while (connector is not None and connector.has_pending_push_work()) or \
            (reset and not llm.reset_prefix_cache()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"stores still in flight after {SETTLE_TIMEOUT_S} s")
        llm.llm_engine.step()
        time.sleep(0.001)


def settle(llm) -> None:
    drain(llm, reset=True)


def first_step(out) -> tuple[int, float]:
    completion = out.outputs[0]
    token = completion.token_ids[0]
    return token, completion.logprobs[0][token].logprob


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here: it can be stepped
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = start_engine(args.model, args.engine, max(lengths) + BLOCK_SIZE, args.graphs)
    rows: list[dict[str, Any]] = []
    try:
        for warm in (BLOCK_SIZE * 64, max(lengths)):  # first-call allocations, the long path
            prompt = prompt_ids(-warm, warm)
            timed(llm, prompt)
            settle(llm)
            if args.engine != "none":
                timed(llm, prompt)
                settle(llm)
        for length in lengths:
            for index in range(args.prompts):
                prompt = prompt_ids(length * 100 + index, length)
                computed_s, computed = timed(llm, prompt)
                drain(llm)
                hit_s, hit = timed(llm, prompt)
                row = dict(tokens=length, prompt=index, computed_s=computed_s, hit_s=hit_s,
                           hit_tokens=hit.num_cached_tokens or 0,
                           computed_tokens=computed.num_cached_tokens or 0)
                settle(llm)
                if args.engine != "none":
                    before = load_seconds(llm) if args.engine == "ours" else 0.0
                    reload_s, loaded = timed(llm, prompt)
                    if args.engine == "ours":
                        row["connector_load_s"] = load_seconds(llm) - before
                    row.update(reload_s=reload_s, reload_tokens=loaded.num_cached_tokens or 0,
                               reload_as_hit=first_step(loaded) == first_step(hit))
                    settle(llm)
                rows.append(row)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"engine": args.engine, "rows": rows}


# --- the run (the parent) -------------------------------------------------------------------

def h2d_ceiling_gbps() -> float:
    import torch

    from kvconnector.bench.ceilings import measure

    arena = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    ceilings = measure(arena, torch.empty(2 << 30, dtype=torch.uint8), repeats=5)
    del arena
    torch.cuda.empty_cache()
    return ceilings.h2d_gbps


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(shape: dict[str, int], runs: dict[str, list[dict[str, Any]]],
              ceiling_gbps: float) -> list[dict[str, Any]]:
    table = []
    lengths = sorted({row["tokens"] for rows in runs.values() for row in rows})
    for length in lengths:
        pick = {e: [r for r in rows if r["tokens"] == length] for e, rows in runs.items()}
        computed = median([r["computed_s"] for r in pick.get("none", [])])
        hit = median([r["hit_s"] for r in pick.get("none", [])])
        line: dict[str, Any] = dict(tokens=length, computed_s=computed, gpu_hit_s=hit)
        for engine in ("ours", "native"):
            rows = pick.get(engine, [])
            line[f"{engine}_s"] = median([r["reload_s"] for r in rows])
            line[f"{engine}_tokens"] = min((r["reload_tokens"] for r in rows), default=None)
            line[f"{engine}_as_hit"] = all(r["reload_as_hit"] for r in rows) if rows else None
            line[f"{engine}_own_hit_s"] = median([r["hit_s"] for r in rows])  # for the record
        loaded = (length - 1) // BLOCK_SIZE * BLOCK_SIZE * token_bytes(shape)
        line["loaded_bytes"] = loaded
        line["pcie_s"] = loaded / (ceiling_gbps * 1e9)
        if line["ours_s"] is not None and hit is not None:
            line["floor_s"] = hit + line["pcie_s"]
            line["ours_over_floor"] = (line["ours_s"] - hit) / line["pcie_s"]
        if line["ours_s"] and line["native_s"]:
            line["ours_vs_native"] = line["ours_s"] / line["native_s"]
        table.append(line)
    return table


def print_table(name: str, table: list[dict[str, Any]]) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1e3:8.1f}"  # noqa: E731
    ratio = lambda v: "-" if v is None else f"{v:5.2f}"  # noqa: E731
    print(f"\n{name}: time to first token, ms (median)")
    print(f"{'tokens':>7} {'computed':>9} {'gpu hit':>8} {'ours':>8} {'native':>8} "
          f"{'floor':>8} {'ours-hit/pcie':>13} {'ours/native':>11} {'same 1st step':>13}")
    for line in table:
        same = "yes" if line["ours_as_hit"] and line["native_as_hit"] else "NO"
        print(f"{line['tokens']:7d} {ms(line['computed_s']):>9} {ms(line['gpu_hit_s']):>8} "
              f"{ms(line['ours_s']):>8} {ms(line['native_s']):>8} {ms(line.get('floor_s')):>8} "
              f"{ratio(line.get('ours_over_floor')):>13} {ratio(line.get('ours_vs_native')):>11} "
              f"{same:>13}")


def plot(path: str, report: dict[str, Any]) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (name, result) in zip(axes[0], shapes.items(), strict=True):
        table = result["table"]
        tokens = [line["tokens"] for line in table]
        for key, label in (("computed_s", "computed"), ("native_s", "vLLM native offloading"),
                           ("ours_s", "kvconnector"), ("floor_s", "PCIe floor"),
                           ("gpu_hit_s", "vLLM GPU prefix-cache hit")):
            values = [line.get(key) for line in table]
            if all(v is not None for v in values):
                ax.plot(tokens, [v * 1e3 for v in values], marker="o", label=label,
                        linestyle="--" if key == "floor_s" else "-")
        ax.set(title=f"{name}: time to first token", xlabel="prompt tokens", ylabel="ms",
               xscale="log", yscale="log")
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['gpu']}, vLLM {report['vllm']}, {report['date']}")
    fig.tight_layout()
    tmp = Path(path).with_suffix(".part.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def parent(args: argparse.Namespace) -> int:
    import torch
    import vllm

    shapes = args.shapes.split(",")
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"bench_engine: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    ceiling = h2d_ceiling_gbps()
    print(f"bench_engine: host-to-device ceiling {ceiling:.1f} GB/s", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "command": "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:]),
        "block_size": BLOCK_SIZE, "cuda_graphs": args.graphs, "prompts": args.prompts,
        "h2d_ceiling_gbps": ceiling, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-engine-gpu-") as scratch:
        tmp = Path(scratch)
        max_len = max(int(n) for n in args.lengths.split(",")) + BLOCK_SIZE
        for name in shapes:
            model = write_model(tmp / name, SHAPES[name], max_len)
            runs: dict[str, list[dict[str, Any]]] = {}
            for engine in ENGINES:
                out = tmp / f"{name}-{engine}.json"
                command = [sys.executable, __file__, "--engine", engine, "--model", model,
                           "--out", str(out), "--lengths", args.lengths,
                           "--prompts", str(args.prompts)] + (["--graphs"] if args.graphs else [])
                print(f"bench_engine: {name}, {engine} engine ...", file=sys.stderr, flush=True)
                started = time.monotonic()
                log = tmp / f"{name}-{engine}.log"
                with open(log, "w") as sink:
                    done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp)
                if done.returncode:
                    tail = log.read_text().splitlines()[-30:]
                    raise SystemExit(f"bench_engine: the {engine} engine failed:\n" +
                                     "\n".join(tail))
                runs[engine] = json.loads(out.read_text())["rows"]
                print(f"bench_engine: {name}, {engine} engine: {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)
            table = summarize(SHAPES[name], runs, ceiling)
            report["shapes"][name] = {"shape": SHAPES[name], "block_bytes":
                                      BLOCK_SIZE * token_bytes(SHAPES[name]),
                                      "table": table, "runs": runs}
            print_table(name, table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(args.plot, report)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="llama-8b,llama-70b-tp8",
                        help=f"model shapes, comma separated ({', '.join(SHAPES)})")
    parser.add_argument("--lengths", default="4096,8192,16384,32768",
                        help="prompt lengths in tokens, comma separated")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per length per engine")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA graphs + torch.compile (default: eager)")
    parser.add_argument("--plot", help="write a plot (PNG) here")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        Path(args.out).write_text(json.dumps(run_engine(args)))
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
