"""Remote store throughput on loopback against raw pyzmq streams with the same security.

For each security mode (none, shared secret, CURVE), 1 and 4 client processes and each number of
connections per client, every client puts its pool of 2 MiB blocks to a store server process
and gets them back into its pool; the same clients then move the same bytes with the raw
baseline (kvconnector.servers.baseline): the same number of DEALER connections per client,
each with a lane thread and an IO thread, sending the same zero-copy frames in the same
requests, dealt the same way, with the same window, to a ROUTER process with the same security
and IO threads that keeps them up to the store's capacity and sends them back zero-copy on get,
received with recv_into. The store adds its protocol, checksums (writer, store and reader) and
its index on top. Where `iperf3` is installed, as many iperf3 streams as all clients'
connections (one process each) on loopback are recorded too, as the TCP ceiling.

Store and baseline trials alternate (which goes first alternates too), so load changes on the
machine hit both: GB/s figures are medians over the trials, the ratio is the median of each
store trial against the baseline trial next to it. All after warm-up trials that leave the
store full and evicting, its steady state.

    python benchmarks/bench_remote.py [--json PATH] [--trials 9] [--blocks 256]
        [--connections 1,4] [--security none,secret,curve] [--clients 1,4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
import zmq.auth

from kvconnector.bench.report import cpu_model
from kvconnector.cli.units import parse_size
from kvconnector.servers.baseline import RawServerProcess, RawStreams, security_args
from kvconnector.servers.store import StoreProcess
from transfer.keys import Namespace
from transfer.remote.store.client import (
    DEFAULT_GET_BATCH_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PUT_BATCH_BYTES,
    StoreClient,
    blocks_per_batch,
)
from transfer.remote.store.lanes import default_connections
from transfer.remote.store.security import Security
from transfer.remote.store.server import DEFAULT_IO_THREADS
from transfer.remote.store.workers import DEFAULT_WORKERS

BLOCK = 2 << 20
NS = Namespace("bench-remote", "bfloat16", 16, "2MiB blocks")
# the store client's batching, copied by the baseline
PUT_BATCH_BLOCKS = blocks_per_batch(DEFAULT_PUT_BATCH_BYTES, BLOCK)
GET_BATCH_BLOCKS = blocks_per_batch(DEFAULT_GET_BATCH_BYTES, BLOCK)
TIMEOUT_S = 120.0
# Unmeasured trials first: connections, handshakes, and a store that is full and evicting, as a
# cache is in steady state. Until then the store's first touch of fresh memory (page faults on
# every new block the zmq IO thread receives into) costs more than the protocol does; after it,
# memory freed by evictions is reused.
WARMUP_TRIALS = 4
IPERF3_PORT = 5299
BASELINE = ("raw pyzmq: per client the same number of DEALER connections as the store client "
            "(a lane thread and a zmq IO thread each), the same zero-copy frames in the same "
            "requests, dealt the same way, same window per connection; one-word headers, no "
            "checksums, no index; a ROUTER process with the same security and IO threads "
            "keeping the newest frames up to the store's capacity and answering gets with them "
            "zero-copy (kvconnector/servers/baseline.py); trials alternate with the store's")


@dataclass(frozen=True)
class Setup:
    mode: str
    server: Security
    client: Security


def securities(keys: Path, modes: list[str]) -> list[Setup]:
    """Each mode with throwaway keys."""
    secret = keys / "secret"
    secret.write_text(os.urandom(24).hex() + "\n")
    (keys / "clients").mkdir()
    server_public, server_pair = zmq.auth.create_certificates(keys, "server")
    _, client_pair = zmq.auth.create_certificates(keys / "clients", "client")
    setups = {
        "none": Setup("none", Security.none(), Security.none()),
        "secret": Setup("secret", Security.shared_secret(secret), Security.shared_secret(secret)),
        "curve": Setup("curve", Security.curve_server(server_pair, keys / "clients"),
                       Security.curve_client(client_pair, server_public)),
    }
    return [setups[mode] for mode in modes]


def client_worker(index: int, store_url: str, raw_url: str, security: Security, blocks: int,
                  connections: int, put_batch_blocks: int, commands: Any, barrier: Any) -> None:
    """One client process: runs (system, op, trial) commands in step with the others."""
    rows = np.random.default_rng(index + 1).integers(0, 256, (blocks, BLOCK), dtype=np.uint8)
    store = StoreClient(store_url, security, namespace=NS, pool=torch.from_numpy(rows),
                        timeout_s=TIMEOUT_S, connections=connections,
                        put_batch_bytes=put_batch_blocks * BLOCK)
    raw = RawStreams(raw_url, security, rows, connections=connections,
                     put_batch_blocks=put_batch_blocks, get_batch_blocks=GET_BATCH_BLOCKS,
                     max_in_flight=DEFAULT_MAX_IN_FLIGHT, timeout_s=TIMEOUT_S)
    slots = list(range(blocks))
    while (command := commands.recv()) is not None:
        system, op, trial = command
        keys = NS.keys([b"c%d-t%d-b%d" % (index, trial, i) for i in range(blocks)])
        barrier.wait()
        start, cpu = time.monotonic(), time.process_time()
        try:
            if system == "raw":
                getattr(raw, op)(slots)
                ok, error = blocks, ""
            else:
                result = store.put(keys, slots) if op == "put" else store.get(keys, slots)
                ok = sum(result.ok)
                error = "" if result.all_ok else result.errors[result.ok.index(False)]
        except Exception as exc:  # the parent reports it instead of waiting for this worker
            ok, error = 0, f"{type(exc).__name__}: {exc}"
        end = time.monotonic()  # CPU: every thread of this client process, zmq's IO threads too
        commands.send((start, end, ok, error, time.process_time() - cpu))
    store.close()
    raw.close()


def iperf3_gbps(streams: int) -> float | None:
    """`streams` iperf3 client/server pairs at once over loopback, GB/s summed; None where
    iperf3 is not installed. One process per stream: iperf3 before 3.16 (Debian 12 has 3.12)
    runs all of `-P N`'s streams on one thread, which is no ceiling for N streams."""
    if shutil.which("iperf3") is None:
        return None
    ports = range(IPERF3_PORT, IPERF3_PORT + streams)
    servers = [subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for port in ports]
    try:
        time.sleep(0.5)
        clients = [subprocess.Popen(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "3",
                                     "-J"], stdout=subprocess.PIPE, text=True)
                   for port in ports]
        outputs = [client.communicate(timeout=60)[0] for client in clients]
        return sum(json.loads(out)["end"]["sum_received"]["bits_per_second"]
                   for out in outputs) / 8e9
    finally:
        for server in servers:
            server.kill()
            server.wait()


def _trials(setup: Setup, clients: int, connections: int, blocks: int, trials: int,
            store_url: str, raw_url: str,
            put_batch_blocks: int) -> tuple[dict[tuple[str, str], list[float]],
                                            dict[tuple[str, str], list[float]]]:
    """Seconds of each measured trial per (system, op), from `clients` client processes, and
    the CPU seconds the client processes spent in each."""
    ctx = mp.get_context("fork")  # workers inherit the imports; the parent holds no zmq state
    barrier = ctx.Barrier(clients)
    pipes, workers = [], []
    for index in range(clients):
        parent, child = ctx.Pipe()
        workers.append(ctx.Process(target=client_worker, daemon=True, args=(
            index, store_url, raw_url, setup.client, blocks, connections, put_batch_blocks,
            child, barrier)))
        workers[-1].start()
        pipes.append(parent)
    seconds: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    try:
        for trial in range(WARMUP_TRIALS + trials):
            for op in ("put", "get"):
                # alternate which goes first, so neither always runs after the other
                for system in ("store", "raw")[::1 if trial % 2 else -1]:
                    for pipe in pipes:
                        pipe.send((system, op, trial))
                    replies = [_reply(pipe) for pipe in pipes]
                    if any(ok != blocks for _, _, ok, _, _ in replies):
                        raise RuntimeError(f"{system} {op} ({setup.mode}) lost blocks: "
                                           f"{[(ok, error) for _, _, ok, error, _ in replies]}")
                    if trial >= WARMUP_TRIALS:
                        elapsed = (max(e for _, e, _, _, _ in replies)
                                   - min(s for s, _, _, _, _ in replies))
                        seconds.setdefault((system, op), []).append(elapsed)
                        cpu.setdefault((system, op), []).append(sum(r[4] for r in replies))
    finally:
        for pipe in pipes:
            pipe.send(None)
        for worker in workers:
            worker.join(60)
            if worker.is_alive():
                worker.kill()
    return seconds, cpu


def run_mode(setup: Setup, clients: int, connections: int, blocks: int, trials: int,
             log: Path, workers: int,
             put_batch_blocks: int = PUT_BATCH_BLOCKS) -> list[dict[str, Any]]:
    """Put and get GB/s of the store (of `workers` processes) and the baseline for one mode,
    client and connection count."""
    capacity = 2 * clients * blocks * BLOCK  # two trials' worth: the warm-up fills it
    io_threads = ("--io-threads", str(DEFAULT_IO_THREADS), "--workers", str(workers))
    store = StoreProcess(log, capacity=str(capacity),
                         security_args=tuple(security_args(setup.server)), extra_args=io_threads)
    with RawServerProcess(setup.server, capacity, DEFAULT_IO_THREADS) as baseline, store:
        seconds, cpu = _trials(setup, clients, connections, blocks, trials, store.url, baseline.url,
                          put_batch_blocks)
    total = clients * blocks * BLOCK
    rows = []
    for op in ("put", "get"):
        store_s, raw_s = seconds[("store", op)], seconds[("raw", op)]
        # each store trial against the baseline trial run next to it, under the same load
        ratios = [r / s for s, r in zip(store_s, raw_s, strict=True)]
        rows.append({"security": setup.mode, "clients": clients, "connections": connections,
                     "workers": workers, "put_batch_blocks": put_batch_blocks, "op": op,
                     "store_gbps": total / statistics.median(store_s) / 1e9,
                     "baseline_gbps": total / statistics.median(raw_s) / 1e9,
                     "ratio": statistics.median(ratios), "trial_ratios": ratios,
                     "bytes_per_trial": total, "store_seconds": store_s,
                     "baseline_seconds": raw_s,
                     # what the client processes spent (all their threads), per GiB moved
                     "store_client_cpu_s_per_gib": statistics.median(cpu[("store", op)])
                     / (total / 2**30),
                     "baseline_client_cpu_s_per_gib": statistics.median(cpu[("raw", op)])
                     / (total / 2**30)})
    return rows


def _print_row(row: dict[str, Any]) -> None:
    iperf = "-" if row["iperf3_gbps"] is None else f"{row['iperf3_gbps']:.2f}"
    print(f"{row['security']:<8} {row['clients']:>7} {row['connections']:>5} "
          f"{row['workers']:>7} {row['op']:<4} "
          f"{row['store_gbps']:>10.2f} {row['baseline_gbps']:>9.2f} {row['ratio']:>6.2f} "
          f"{min(row['trial_ratios']):>9.2f}-{max(row['trial_ratios']):.2f} {iperf:>7} "
          f"{row['store_client_cpu_s_per_gib']:>6.3f} {row['baseline_client_cpu_s_per_gib']:>6.3f}",
          flush=True)


def _reply(pipe: Any) -> tuple[float, float, int, str]:
    """A worker's answer; RuntimeError rather than a hang if the worker died."""
    if not pipe.poll(2 * TIMEOUT_S):
        raise RuntimeError(f"a client process gave no answer in {2 * TIMEOUT_S:.0f} s")
    return pipe.recv()


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas: {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    if not set(modes) <= {"none", "secret", "curve"}:
        raise argparse.ArgumentTypeError(f"security modes are none, secret, curve: {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trials", type=int, default=9, help="measured trials per figure")
    parser.add_argument("--blocks", type=int, default=256,
                        help="2 MiB blocks moved per trial, split over the clients (default 256)")
    parser.add_argument("--connections", type=_ints, default=[default_connections()],
                        help="connections per client, e.g. 1,4 (default: the store client's, "
                             f"here {default_connections()})")
    parser.add_argument("--clients", type=_ints, default=[1, 4], help="client processes")
    parser.add_argument("--put-batch", type=parse_size, default=PUT_BATCH_BLOCKS * BLOCK,
                        help="bytes of blocks per put request, store and baseline alike "
                             f"(default: the client's, {PUT_BATCH_BLOCKS * BLOCK >> 20}MiB)")
    parser.add_argument("--workers", type=_ints, default=[DEFAULT_WORKERS],
                        help="store worker processes, e.g. 1,4 (default: the store's, here "
                             f"{DEFAULT_WORKERS})")
    parser.add_argument("--security", type=_modes, default=["none", "secret", "curve"])
    args = parser.parse_args(argv)
    if args.trials < 1 or args.blocks < max(args.clients) or args.put_batch < BLOCK:
        parser.error(f"need --trials >= 1, --blocks >= {max(args.clients)} and --put-batch "
                     f">= {BLOCK >> 20}MiB")
    started = time.monotonic()
    rows = []
    ceilings = {}
    # the trials' spread too: on a busy machine one trial's ratio can be far off the median
    print(f"{'security':<8} {'clients':>7} {'conns':>5} {'workers':>7} {'op':<4} "
          f"{'store GB/s':>10} "
          f"{'raw GB/s':>9} {'ratio':>6} {'trials min-max':>14} {'iperf3':>7} "
          f"{'client CPU s/GiB store':>6} {'raw':>6}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        for clients in args.clients:
            for connections in args.connections:
                ceilings[clients * connections] = iperf3_gbps(clients * connections)
        for setup in securities(Path(tmp), args.security):
            for clients in args.clients:
                for connections, workers in itertools.product(args.connections, args.workers):
                    measured = run_mode(setup, clients, connections, args.blocks // clients,
                                        args.trials, Path(tmp) / f"store-{setup.mode}.log",
                                        workers, args.put_batch // BLOCK)
                    for row in measured:  # as they come: a long run shows its progress
                        row["iperf3_gbps"] = ceilings[clients * connections]
                        _print_row(row)
                    rows += measured
    report = {
        "benchmark": "remote store vs raw pyzmq streams, loopback",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "processor": cpu_model(),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "baseline": BASELINE, "block_bytes": BLOCK, "put_batch_blocks": args.put_batch // BLOCK,
        "get_batch_blocks": GET_BATCH_BLOCKS, "in_flight_per_connection": DEFAULT_MAX_IN_FLIGHT,
        "server_io_threads": DEFAULT_IO_THREADS, "trials": args.trials,
        "warmup_trials": WARMUP_TRIALS, "seconds": round(time.monotonic() - started, 1),
        "rows": rows,
    }
    print(f"{report['seconds']} s; {report['host']['processor']}, {os.cpu_count()} CPUs, "
          f"store and baseline server {DEFAULT_IO_THREADS} IO threads")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
