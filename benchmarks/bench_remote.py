"""Remote store throughput on loopback against a raw pyzmq baseline with the same security.

For each security mode (none, shared secret, CURVE) and 1 and 4 client processes, every client
puts its pool of 2 MiB blocks to a store server process and gets them back into its pool; the
same clients then move the same bytes with a raw baseline: a DEALER sending the same zero-copy
frames in the same batches and window to a ROUTER process (same security) that keeps them up to
the store's capacity and sends them back zero-copy on get, received with recv_into. The store
adds its protocol, checksums (writer, store and reader) and its index on top.

Store and baseline trials alternate (which goes first alternates too), so load changes on the
machine hit both: GB/s figures are medians over the trials, the ratio is the median of each
store trial against the baseline trial next to it. All after warm-up trials that leave the
store full and evicting, its steady state.

    python benchmarks/bench_remote.py [--json PATH] [--trials 9] [--blocks 256]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
import zmq.auth

from kvconnector.bench.report import cpu_model
from transfer.keys import Namespace
from transfer.remote.store.client import (
    DEFAULT_GET_BATCH_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PUT_BATCH_BYTES,
    StoreClient,
    blocks_per_batch,
)
from transfer.remote.store.security import Security
from transfer.remote.store.testing import StoreProcess

BLOCK = 2 << 20
NS = Namespace("bench-remote", "bfloat16", 16, "2MiB blocks")
CLIENT_COUNTS = (1, 4)
# the store client's batching, copied by the baseline
PUT_BATCH_BLOCKS = blocks_per_batch(DEFAULT_PUT_BATCH_BYTES, BLOCK)
GET_BATCH_BLOCKS = blocks_per_batch(DEFAULT_GET_BATCH_BYTES, BLOCK)
TIMEOUT_S = 120.0
# Unmeasured trials first: connections, handshakes, and a store that is full and evicting, as a
# cache is in steady state. Until then the store's first touch of fresh memory (page faults on
# every new block the zmq IO thread receives into) costs more than the protocol does; after it,
# memory freed by evictions is reused.
WARMUP_TRIALS = 4


@dataclass(frozen=True)
class Setup:
    mode: str
    server: Security
    client: Security
    store_args: tuple[str, ...]


def securities(keys: Path) -> list[Setup]:
    """Each mode with throwaway keys; the store process gets the same settings as CLI flags."""
    secret = keys / "secret"
    secret.write_text(os.urandom(24).hex() + "\n")
    (keys / "clients").mkdir()
    server_public, server_pair = zmq.auth.create_certificates(keys, "server")
    _, client_pair = zmq.auth.create_certificates(keys / "clients", "client")
    return [
        Setup("none", Security.none(), Security.none(), ("--security", "none")),
        Setup("secret", Security.shared_secret(secret), Security.shared_secret(secret),
              ("--security", "secret", "--secret-file", str(secret))),
        Setup("curve", Security.curve_server(server_pair, keys / "clients"),
              Security.curve_client(client_pair, server_public),
              ("--security", "curve", "--curve-key-pair", str(server_pair), "--curve-clients",
               str(keys / "clients"))),
    ]


def raw_server(security: Security, capacity: int, endpoint_queue: Any) -> None:
    """The baseline ROUTER: keeps the newest `capacity` bytes of put frames (so its memory
    churns like the store's), answers gets with the newest of them, zero-copy."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    security.apply_server(context, router, "tcp://127.0.0.1:*")  # its ZAP thread lives as long
    router.bind("tcp://127.0.0.1:*")
    endpoint_queue.put(router.last_endpoint.decode())
    held: deque[zmq.Frame] = deque()
    while True:  # until the parent terminates this process
        identity, op, *blocks = router.recv_multipart(copy=False)
        if op.bytes == b"put":
            held.extend(blocks)
            while len(held) * BLOCK > capacity:
                held.popleft()
            router.send_multipart([identity, b"ok"])
        else:  # b"get:<count>"
            count = int(op.bytes[4:])
            router.send_multipart([identity, b"ok"], zmq.SNDMORE)
            for i in range(count):  # like the store: zero-copy frames, tracked
                router.send(held[i - count].buffer, zmq.SNDMORE if i < count - 1 else 0,
                            copy=False, track=True)


class RawClient:
    """The baseline DEALER: the store client's batches and window, no protocol or checksums."""

    def __init__(self, url: str, security: Security, rows: np.ndarray) -> None:
        self.rows = rows
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvtimeo = int(TIMEOUT_S * 1000)
        security.apply_client(self.sock, url)
        self.sock.connect(url)

    def put(self) -> None:
        trackers, in_flight = [], 0
        for batch in self._batches(PUT_BATCH_BLOCKS):
            if in_flight == DEFAULT_MAX_IN_FLIGHT:
                self.sock.recv()
                in_flight -= 1
            self.sock.send(b"put", zmq.SNDMORE)
            for i, row in enumerate(batch):
                more = zmq.SNDMORE if i < len(batch) - 1 else 0
                trackers.append(self.sock.send(row, more, copy=False, track=True))
            in_flight += 1
        for _ in range(in_flight):
            self.sock.recv()
        for tracker in trackers:
            tracker.wait(TIMEOUT_S)

    def get(self) -> None:
        pending: list[np.ndarray] = []
        for batch in self._batches(GET_BATCH_BLOCKS):
            if len(pending) == DEFAULT_MAX_IN_FLIGHT:
                self._receive_into(pending.pop(0))
            self.sock.send(b"get:%d" % len(batch))
            pending.append(batch)
        for batch in pending:
            self._receive_into(batch)

    def _batches(self, size: int) -> list[np.ndarray]:
        return [self.rows[s:s + size] for s in range(0, len(self.rows), size)]

    def _receive_into(self, batch: np.ndarray) -> None:
        self.sock.recv()
        for row in batch:
            if self.sock.recv_into(row) != BLOCK:
                raise RuntimeError("baseline frame of the wrong size")


def client_worker(index: int, store_url: str, raw_url: str, security: Security, blocks: int,
                  commands: Any, barrier: Any) -> None:
    """One client process: runs (system, op, trial) commands in step with the others."""
    rows = np.random.default_rng(index + 1).integers(0, 256, (blocks, BLOCK), dtype=np.uint8)
    store = StoreClient(store_url, security, namespace=NS, pool=torch.from_numpy(rows),
                        timeout_s=TIMEOUT_S)
    raw = RawClient(raw_url, security, rows)
    slots = list(range(blocks))
    while (command := commands.recv()) is not None:
        system, op, trial = command
        keys = NS.keys([b"c%d-t%d-b%d" % (index, trial, i) for i in range(blocks)])
        barrier.wait()
        start = time.monotonic()
        if system == "raw":
            getattr(raw, op)()
            ok = blocks
        else:
            result = store.put(keys, slots) if op == "put" else store.get(keys, slots)
            ok = sum(result.ok)
        commands.send((start, time.monotonic(), ok))
    store.close()
    raw.sock.close(linger=0)


def run_mode(setup: Setup, clients: int, blocks: int, trials: int,
             log: Path) -> list[dict[str, Any]]:
    """Put and get GB/s of the store and the baseline for one mode and client count."""
    ctx = mp.get_context("fork")  # workers inherit the imports; the parent holds no zmq state
    capacity = str(2 * clients * blocks * BLOCK)  # two trials' worth: the warm-up fills it
    store = StoreProcess(log, capacity=capacity, security_args=setup.store_args)
    endpoints = ctx.Queue()
    baseline = ctx.Process(target=raw_server, args=(setup.server, int(capacity), endpoints),
                           daemon=True)
    baseline.start()
    raw_url = endpoints.get(timeout=60)
    store_url = store.start()
    barrier = ctx.Barrier(clients)
    pipes, workers = [], []
    for index in range(clients):
        parent, child = ctx.Pipe()
        workers.append(ctx.Process(target=client_worker, daemon=True, args=(
            index, store_url, raw_url, setup.client, blocks, child, barrier)))
        workers[-1].start()
        pipes.append(parent)
    seconds: dict[tuple[str, str], list[float]] = {}
    try:
        for trial in range(WARMUP_TRIALS + trials):
            for op in ("put", "get"):
                # alternate which goes first, so neither always runs after the other
                for system in ("store", "raw")[::1 if trial % 2 else -1]:
                    for pipe in pipes:
                        pipe.send((system, op, trial))
                    replies = [pipe.recv() for pipe in pipes]
                    if any(ok != blocks for _, _, ok in replies):
                        raise RuntimeError(f"{system} {op} ({setup.mode}) lost blocks: "
                                           f"{[ok for _, _, ok in replies]}")
                    if trial >= WARMUP_TRIALS:
                        elapsed = max(e for _, e, _ in replies) - min(s for s, _, _ in replies)
                        seconds.setdefault((system, op), []).append(elapsed)
    finally:
        for pipe in pipes:
            pipe.send(None)
        for worker in workers:
            worker.join(60)
        baseline.terminate()
        baseline.join(60)
        store.stop()
    total = clients * blocks * BLOCK
    rows = []
    for op in ("put", "get"):
        store_s, raw_s = seconds[("store", op)], seconds[("raw", op)]
        store_gbps = total / statistics.median(store_s) / 1e9
        raw_gbps = total / statistics.median(raw_s) / 1e9
        # each store trial against the baseline trial run next to it, under the same load
        ratios = [r / s for s, r in zip(store_s, raw_s, strict=True)]
        rows.append({"security": setup.mode, "clients": clients, "op": op,
                     "store_gbps": store_gbps, "baseline_gbps": raw_gbps,
                     "ratio": statistics.median(ratios), "trial_ratios": ratios,
                     "bytes_per_trial": total,
                     "store_seconds": seconds[("store", op)],
                     "baseline_seconds": seconds[("raw", op)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trials", type=int, default=9, help="measured trials per figure")
    parser.add_argument("--blocks", type=int, default=256,
                        help="2 MiB blocks moved per trial, split over the clients (default 256)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.blocks < max(CLIENT_COUNTS):
        parser.error(f"need --trials >= 1 and --blocks >= {max(CLIENT_COUNTS)}")
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        for setup in securities(Path(tmp)):
            for clients in CLIENT_COUNTS:
                rows += run_mode(setup, clients, args.blocks // clients, args.trials,
                                 Path(tmp) / f"store-{setup.mode}-{clients}.log")
    # the trials' spread too: on a busy machine one trial's ratio can be far off the median
    print(f"{'security':<8} {'clients':>7} {'op':<4} {'store GB/s':>10} {'raw GB/s':>9} "
          f"{'ratio':>6} {'trials min-max':>14}")
    for row in rows:
        print(f"{row['security']:<8} {row['clients']:>7} {row['op']:<4} "
              f"{row['store_gbps']:>10.2f} {row['baseline_gbps']:>9.2f} {row['ratio']:>6.2f} "
              f"{min(row['trial_ratios']):>9.2f}-{max(row['trial_ratios']):.2f}")
    report = {
        "benchmark": "remote store vs raw pyzmq, loopback",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "processor": cpu_model(),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "block_bytes": BLOCK, "put_batch_blocks": PUT_BATCH_BLOCKS,
        "get_batch_blocks": GET_BATCH_BLOCKS, "in_flight": DEFAULT_MAX_IN_FLIGHT,
        "trials": args.trials, "warmup_trials": WARMUP_TRIALS,
        "seconds": round(time.monotonic() - started, 1), "rows": rows,
    }
    print(f"{report['seconds']} s; {report['host']['processor']}, {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
