"""The connector's scheduler-side step time with KV events on and off, a thousand blocks a step.

What one engine step costs the scheduler side of the connector: the core plans the step's
stores (`plan_step_stores`, a private pool of `--slots` blocks, LRU, so most steps evict as
many blocks as they store), hands them out (`build_step`), completes the last step's jobs as
every worker reported them (`complete`), and, with events on, the adapter's `take_events`:
the blocks described when planned (token ids, parent, extra keys, from vLLM's own `Request`
objects), the core's changes turned into vLLM's `BlockStored` / `BlockRemoved`. Each step
stores `--requests` new prompts of `--blocks` blocks each (8 x 128 = 1024 blocks by default).
No worker, no copy: the copies do not run on the scheduler's path.

Each step's time is the CPU time of the thread that runs it (`time.thread_time`): what the
step costs the scheduler's thread, which a machine shared with other work does not stretch the
way it stretches wall time. Runs alternate (off, on, off, on, ...) so drift hits both alike;
prints the median step time of each, their ratio and each run's ratio.

    python benchmarks/bench_events.py [--steps 16] [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from kvconnector.offload.jobs import JobReport
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.vllm.events import ConnectorEvents
from transfer.keys import Namespace

BLOCK_SIZE = 16


def make_requests(step: int, count: int, blocks: int) -> list[Request]:
    rng = random.Random(step)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    return [Request(f"s{step}-r{i}", [rng.randrange(1, 30000) for _ in range(blocks * BLOCK_SIZE
                                                                           + 1)],
                    SamplingParams(max_tokens=1), None, block_hasher=hasher)
            for i in range(count)]


def run(events: bool, steps: int, count: int, blocks: int, slots: int) -> list[float]:
    """CPU seconds of each step after the first (the pool fills, then evicts every step)."""
    core = OffloadScheduler(Namespace("bench", "bfloat16", BLOCK_SIZE, "bench"), slots,
                            BLOCK_SIZE, num_workers=1)
    publisher = None
    if events:
        spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128,
                                 dtype=torch.bfloat16)
        config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
        publisher = ConnectorEvents(SimpleNamespace(), config, core, [], None)  # type: ignore
    waves = [make_requests(step, count, blocks) for step in range(steps)]  # built untimed
    times, published, last = [], 0, None
    for requests in waves:
        start = time.thread_time()
        if publisher is not None:
            for request in requests:
                publisher.track(request)
        core.plan_step_stores([(r.request_id, r.block_hashes, list(range(blocks)),
                                blocks * BLOCK_SIZE) for r in requests])
        step = core.build_step()
        if last is not None:  # the previous step's stores, reported by the one worker
            core.complete(JobReport(done={job.job_id: 1 for job in last.stores}))
        for request in requests:
            core.request_finished(request.request_id, request.block_hashes,
                                  list(range(blocks)), blocks * BLOCK_SIZE)
            if publisher is not None:
                publisher.forget(request.request_id)
        if publisher is not None:
            published += len(publisher.take_events())
        times.append(time.thread_time() - start)
        last = step
    if publisher is not None:
        assert published > 0
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=128, help="blocks of each prompt")
    parser.add_argument("--slots", type=int, default=4096, help="the pool's blocks")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    init_none_hash(sha256)
    samples: dict[str, list[float]] = {"off": [], "on": []}
    pairs = []  # each run's on/off ratio of medians
    load = [os.getloadavg()[0]]
    for _ in range(args.runs):
        medians = {}
        for name in ("off", "on"):
            times = run(name == "on", args.steps, args.requests, args.blocks, args.slots)
            samples[name] += times
            medians[name] = statistics.median(times)
        pairs.append(round(medians["on"] / medians["off"], 3))
    load.append(os.getloadavg()[0])
    off, on = (statistics.median(samples[name]) for name in ("off", "on"))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.processor() or platform.machine(),
              "blocks_per_step": args.requests * args.blocks, "steps": len(samples["on"]),
              "step_ms_off": round(off * 1e3, 3), "step_ms_on": round(on * 1e3, 3),
              "ratio_on_off": round(on / off, 3), "ratio_per_run": pairs,
              "load_average_before_after": load,
              "events_us_per_block": round((on - off) * 1e6 / (args.requests * args.blocks), 2)}
    print(f"{result['blocks_per_step']} blocks a step, {result['steps']} steps each: "
          f"events off {result['step_ms_off']} ms, on {result['step_ms_on']} ms (median), "
          f"on/off {result['ratio_on_off']} (runs {min(pairs)}-{max(pairs)}), "
          f"{result['events_us_per_block']} us a block; load {load[0]:.1f}-{load[1]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
