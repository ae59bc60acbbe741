"""Redis Cluster tier throughput against `redis-benchmark` moving values of the same size.

Starts a local 3-master Redis Cluster (kvconnector.servers.redis_cluster.LocalRedisCluster),
or uses one given by --url/--user/--password-file. For 1 and 4 clients, each client is a
process with its own RedisClusterBackend and its own pool of 2 MiB blocks (random bytes, its
own keys), and puts all its blocks, then gets them all back into other slots; the bytes are
compared after every get (a mismatch fails the run). Aggregate rate = all clients' bytes /
(last finish - first start), the clients released together by a barrier.

Baseline: `redis-benchmark --cluster -t set|get -d 2097192` (2 MiB + the 40 B value header: the
same bytes per value as ours) on the same cluster in the same run:
- -c = clients x masters: redis-benchmark pins each connection to one master, and each of our
  clients talks to every master (-c 1 would load one master only: a weaker baseline).
- -P: 1 and the depth of our pipelines, batch_bytes // value (4 MiB // 2 MiB+40 = 1 by default);
  every trial runs both and the row holds the stronger (higher median rate) per op.
- No -r: every connection then reuses one key per master (`key:{tag}:__rand_int__` literally);
  the SET run writes it, the GET run reads it back. With -r, GETs of keys no SET had written would
  answer nil and look fast. Each run is checked: after SET every master holds a full-size value
  under that key, and a GET run must make the masters send >= requests x value bytes (INFO
  total_net_output_bytes). See kvconnector.bench.redis_tier.RedisBenchmark.
- -n: sized in the warm-up so a run lasts >= TARGET_S. Its rate is the one at its last progress
  tick, not its final figure, which counts up to 250 ms of idle threads after the last value
  (kvconnector.bench.redis_tier.progress_rate).
- Its password goes on its command line (-a is its only way to take one): fine for the
  throwaway local cluster; with --url use a throwaway ACL user.

Trials alternate which goes first (ours, or redis-benchmark), so load changes on the machine hit
both. GB/s = values per second x 2 MiB (both sides move 2 MiB + 40 B per value); figures are
medians over the trials, the ratio the median of each of our trials against the baseline run next
to it. All after warm-up trials.

    python benchmarks/bench_redis.py [--json PATH] [--trials 9] [--blocks 512]
        [--url redis://USER@H:P,... --user USER --password-file FILE]
        [--batch-bytes N] [--workers N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from kvconnector.bench.redis_tier import RedisBenchmark
from kvconnector.bench.report import cpu_model
from transfer.keys import Namespace
from transfer.remote.redis.backend import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_WORKERS,
    RedisClusterBackend,
)
from transfer.remote.redis.values import HEADER_BYTES, RedisAuth

BLOCK = 2 << 20
VALUE = BLOCK + HEADER_BYTES
NS = Namespace("bench-redis", "bfloat16", 16, "2MiB blocks")
CLIENT_COUNTS = (1, 4)
TIMEOUT_S = 120.0
WARMUP_TRIALS = 2  # connections, slot maps, the masters' first allocations; sizes -n
TARGET_S = 1.5  # each redis-benchmark run at least this long


def client_worker(index: int, url: str, auth: RedisAuth, blocks: int, batch_bytes: int,
                  workers: int, commands: Any, barrier: Any) -> None:
    """One client process: runs (op, trial) commands in step with the others."""
    rng = np.random.default_rng(index + 1)
    rows = np.zeros((2 * blocks, BLOCK), np.uint8)
    rows[:blocks] = rng.integers(0, 256, (blocks, BLOCK), dtype=np.uint8)
    sent, landed = rows[:blocks], rows[blocks:]
    backend = RedisClusterBackend(url, auth, namespace=NS, pool=torch.from_numpy(rows),
                                  timeout_s=TIMEOUT_S, batch_bytes=batch_bytes, workers=workers)
    keys = NS.keys([b"c%d-b%d" % (index, i) for i in range(blocks)])
    put_slots, get_slots = list(range(blocks)), list(range(blocks, 2 * blocks))
    try:
        while (command := commands.recv()) is not None:
            op, trial = command
            if op == "put":
                sent[:, 0] = trial % 256  # this trial's bytes: a stale value cannot pass
            else:
                landed[:] = 0
            barrier.wait()
            start = time.monotonic()
            result = backend.put(keys, put_slots) if op == "put" else backend.get(keys,
                                                                                  get_slots)
            end = time.monotonic()
            error = next((e for e in result.errors if e), "")
            if op == "get" and result.all_ok and not np.array_equal(landed, sent):
                error = "get returned other bytes than were put"
            commands.send((start, end, error))
    finally:
        backend.delete(keys)
        backend.close()


def run_clients(url: str, auth: RedisAuth, tool: RedisBenchmark, clients: int, blocks: int,
                trials: int, batch_bytes: int, workers: int) -> dict[str, Any]:
    """Our put/get and redis-benchmark's SET/GET at -P 1 and at our depth, for one client count."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited sockets or threads
    masters = tool.masters
    depth = max(1, batch_bytes // VALUE)
    pipelines = sorted({1, depth})
    barrier = ctx.Barrier(clients)
    pipes, procs = [], []
    for index in range(clients):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=client_worker, daemon=True, args=(
            index, url, auth, blocks, batch_bytes, workers, child, barrier)))
        procs[-1].start()
        child.close()  # a client that dies then reads as EOFError here, not a hang
        pipes.append(parent)
    total = clients * blocks
    requests = {(op, p): max(total, 64 * masters) for op in ("set", "get") for p in pipelines}
    ours: dict[str, list[float]] = {"put": [], "get": []}  # values per second
    theirs: dict[tuple[str, int], list[float]] = {key: [] for key in requests}
    try:
        for trial in range(WARMUP_TRIALS + trials):
            for op, rb_op in (("put", "set"), ("get", "get")):
                order = ("ours", "theirs") if trial % 2 == 0 else ("theirs", "ours")
                for system in order:
                    if system == "ours":
                        for pipe in pipes:
                            pipe.send((op, trial))
                        replies = [pipe.recv() for pipe in pipes]
                        errors = [e for _, _, e in replies if e]
                        if errors:
                            raise RuntimeError(f"{clients} clients, {op}: {errors[0]}")
                        elapsed = max(e for _, e, _ in replies) - min(s for s, _, _ in replies)
                        rates = [total / elapsed]
                        keys: list[Any] = [op]
                    else:
                        rates, keys = [], []
                        for p in pipelines:
                            run = tool.run(rb_op, VALUE, requests[(rb_op, p)],
                                           clients * masters, p)
                            requests[(rb_op, p)] = run.requests
                            if trial < WARMUP_TRIALS:  # size -n for >= TARGET_S a run
                                requests[(rb_op, p)] = max(run.requests,
                                                           int(run.values_per_s * TARGET_S))
                            rates.append(run.values_per_s)
                            keys.append((rb_op, p))
                    if trial >= WARMUP_TRIALS:
                        for key, rate in zip(keys, rates, strict=True):
                            (ours if system == "ours" else theirs)[key].append(rate)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # that client is gone already
                pipe.send(None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():  # stuck at the barrier after another client failed
                proc.terminate()
    row: dict[str, Any] = {"clients": clients, "blocks_per_trial": total,
                           "bytes_per_trial": total * BLOCK, "masters": masters}
    for op, rb_op in (("put", "set"), ("get", "get")):
        best = max(pipelines, key=lambda p: statistics.median(theirs[(rb_op, p)]))
        base = theirs[(rb_op, best)]
        row[op] = {
            "gbps": statistics.median(ours[op]) * BLOCK / 1e9,
            "baseline_gbps": statistics.median(base) * BLOCK / 1e9,
            # each of our trials against the baseline run next to it, under the same load
            "ratio": statistics.median(o / b for o, b in zip(ours[op], base, strict=True)),
            "values_per_s": ours[op],
            "baseline": {"c": clients * masters, "P": best, "d": VALUE,
                         "n": requests[(rb_op, best)]},
            "baseline_by_pipeline": {
                str(p): {"gbps": statistics.median(theirs[(rb_op, p)]) * BLOCK / 1e9,
                         "values_per_s": theirs[(rb_op, p)], "n": requests[(rb_op, p)]}
                for p in pipelines},
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trials", type=int, default=9, help="measured trials per figure")
    parser.add_argument("--blocks", type=int, default=512,
                        help="2 MiB blocks moved per trial, split over the clients (default 512)")
    parser.add_argument("--url", help="an existing cluster (default: start a local one)")
    parser.add_argument("--user", help="its ACL user (if not in --url)")
    parser.add_argument("--password-file", type=Path,
                        help="its password (else $KVCONNECTOR_REDIS_PASSWORD)")
    parser.add_argument("--ca-file", type=Path, help="CA of its nodes (rediss://)")
    parser.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES,
                        help=f"our pipelines' bytes (default {DEFAULT_BATCH_BYTES})")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help=f"our node threads per client (default {DEFAULT_WORKERS})")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.blocks < max(CLIENT_COUNTS):
        parser.error(f"need --trials >= 1 and --blocks >= {max(CLIENT_COUNTS)}")
    started = time.monotonic()
    cluster = None
    if args.url is None:
        from kvconnector.servers.redis_cluster import LocalRedisCluster

        cluster = LocalRedisCluster()
        url, auth = cluster.url, RedisAuth.from_sources(cluster.user, cluster.password_file)
    else:
        url = args.url
        auth = RedisAuth.from_sources(args.user, args.password_file, args.ca_file)
    rows = []
    tool = RedisBenchmark(url, auth)
    try:
        for clients in CLIENT_COUNTS:
            rows.append(run_clients(url, auth, tool, clients, args.blocks // clients,
                                    args.trials, args.batch_bytes, args.workers))
    finally:
        tool.cleanup()
        if cluster is not None:
            cluster.stop()
    report = {
        "benchmark": "redis cluster tier vs redis-benchmark, loopback" if cluster else
                     "redis cluster tier vs redis-benchmark",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "processor": cpu_model(),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "redis-py": redis.__version__, "redis-benchmark": _tool_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "block_bytes": BLOCK, "value_bytes": VALUE, "batch_bytes": args.batch_bytes,
        "workers": args.workers, "trials": args.trials, "warmup_trials": WARMUP_TRIALS,
        "seconds": round(time.monotonic() - started, 1), "rows": rows,
    }
    print(f"{'clients':>7} {'put GB/s':>8} {'SET GB/s':>8} {'ratio':>6} {'get GB/s':>8} "
          f"{'GET GB/s':>8} {'ratio':>6}  baseline -c/-P (set; get)")
    for row in rows:
        put, get = row["put"], row["get"]
        print(f"{row['clients']:>7} {put['gbps']:>8.2f} {put['baseline_gbps']:>8.2f} "
              f"{put['ratio']:>6.2f} {get['gbps']:>8.2f} {get['baseline_gbps']:>8.2f} "
              f"{get['ratio']:>6.2f}  {put['baseline']['c']}/{put['baseline']['P']}; "
              f"{get['baseline']['c']}/{get['baseline']['P']}")
    print(f"{report['seconds']} s; {report['host']['processor']}, {os.cpu_count()} CPUs; "
          f"batch_bytes {args.batch_bytes}, workers {args.workers}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _tool_version() -> str:
    import subprocess

    try:
        return subprocess.run(["redis-benchmark", "--version"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
