"""A remote block store shared by two engines: one stores a prompt's blocks, the other reuses them.

What it shows, all on loopback, in three processes besides this one's:
- the store: `python -m kvconnector.cli.store store serve` (the `kvconnector store serve` command
  without the torch import) on a free port, with shared-secret security (a random secret in a
  0600 file; both sides read it). It prints the address it bound; this script reads it from there;
- client A (an engine that computed a prompt): fills blocks of its host pool (a `HostPool` for a
  Llama-3.1-8B-like block-major layout: 2 MiB per block, all 32 layers) and `put`s them under
  namespaced keys made from chained block hashes of the prompt's tokens, as vLLM makes them;
- client B (another engine, its own pool): gets a longer prompt that starts with A's prompt,
  computes its keys, asks the store with `lookup` how long a prefix it holds, and `get`s that
  prefix straight into free slots of its pool; every byte is checked against what A stored;
- the store's counters (`stats`), then a SIGTERM and a bounded wait for the store to exit.

Run it:

    python examples/remote_shared_store.py

It prints one line, `remote_shared_store: OK ...`, and exits with code 1 when anything fails (a
child that errs, a wrong byte, a timeout). Every wait is bounded; nothing listens beyond
127.0.0.1.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvconnector import KVLayout
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, block_size=16,
                  dtype="bfloat16", order="BLNHC")
NAMESPACE = Namespace(model="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16",
                      block_size=LAYOUT.block_size, block_layout=LAYOUT.describe())
SHARED_BLOCKS = 12  # client A's prompt, in blocks: the prefix both prompts share
EXTRA_BLOCKS = 4  # client B's prompt goes on for this many blocks the store does not hold
POOL_SLOTS = 32
VOCAB = 128256
CAPACITY = "256MiB"
START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 30.0  # per store request
CHILD_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
_LISTENING = re.compile(r"listening on (tcp://\S+)")


def prompt_tokens(shared: int, extra: int) -> list[int]:
    """`shared` blocks of tokens every prompt starts with, then `extra` blocks of its own."""
    n = LAYOUT.block_size
    head = torch.randint(0, VOCAB, (shared * n,), generator=torch.Generator().manual_seed(1))
    tail = torch.randint(0, VOCAB, (extra * n,), generator=torch.Generator().manual_seed(2))
    return torch.cat([head, tail]).tolist()


def block_hashes(tokens: list[int]) -> list[bytes]:
    """Chained hashes of the full blocks: each covers its tokens and every block before it."""
    n, prev, out = LAYOUT.block_size, b"", []
    for start in range(0, len(tokens) - n + 1, n):
        prev = hashlib.sha256(prev + repr(tokens[start:start + n]).encode()).digest()
        out.append(prev)
    return out


def block_bytes_for(block_hash: bytes) -> torch.Tensor:
    """Stand-in for the KV a model computes for a block: bytes that follow from its hash."""
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:7], "little"))
    return torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8, generator=gen)


def client_a(url: str, secret_file: str, results: mp.Queue) -> None:
    """Compute a prompt's blocks into the pool and put them into the store."""
    try:
        hashes = block_hashes(prompt_tokens(SHARED_BLOCKS, 0))
        pool = HostPool.create(POOL_SLOTS, LAYOUT.block_bytes)
        slots = torch.randperm(POOL_SLOTS, generator=torch.Generator().manual_seed(3))
        slots = slots[:len(hashes)].tolist()  # wherever the engine's pool had room
        for slot, block_hash in zip(slots, hashes, strict=True):
            pool.slots[slot] = block_bytes_for(block_hash)
        with StoreClient(url, Security.shared_secret(secret_file), namespace=NAMESPACE,
                         pool=pool.slots, timeout_s=CLIENT_TIMEOUT_S) as client:
            start = time.perf_counter()
            result = client.put(NAMESPACE.keys(hashes), slots)
            seconds = time.perf_counter() - start
        if not result.all_ok:
            raise RuntimeError(f"put failed: {sorted(set(result.errors) - {''})}")
        pool.close()
        results.put({"client": "A", "blocks": len(hashes), "seconds": seconds})
    except Exception as exc:  # reported to the parent, which fails the run
        results.put({"client": "A", "error": f"{type(exc).__name__}: {exc}"})


def client_b(url: str, secret_file: str, results: mp.Queue) -> None:
    """Find how much of a longer prompt the store holds, get it into this pool, check it."""
    try:
        hashes = block_hashes(prompt_tokens(SHARED_BLOCKS, EXTRA_BLOCKS))
        keys = NAMESPACE.keys(hashes)
        pool = HostPool.create(POOL_SLOTS, LAYOUT.block_bytes)
        with StoreClient(url, Security.shared_secret(secret_file), namespace=NAMESPACE,
                         pool=pool.slots, timeout_s=CLIENT_TIMEOUT_S) as client:
            found = client.lookup(keys)
            if found != SHARED_BLOCKS:
                raise RuntimeError(f"lookup found a {found}-block prefix, expected "
                                   f"{SHARED_BLOCKS}")
            slots = list(range(POOL_SLOTS - found, POOL_SLOTS))  # this pool's free slots
            start = time.perf_counter()
            result = client.get(keys[:found], slots)
            seconds = time.perf_counter() - start
        if not result.all_ok:
            raise RuntimeError(f"get failed: {sorted(set(result.errors) - {''})}")
        wrong = [i for i, (slot, block_hash) in enumerate(zip(slots, hashes, strict=False))
                 if not torch.equal(pool.slots[slot], block_bytes_for(block_hash))]
        pool.close()
        if wrong:
            raise RuntimeError(f"blocks {wrong} hold other bytes than client A stored")
        results.put({"client": "B", "blocks": found, "prompt_blocks": len(keys),
                     "seconds": seconds})
    except Exception as exc:  # reported to the parent, which fails the run
        results.put({"client": "B", "error": f"{type(exc).__name__}: {exc}"})


def run_client(ctx: Any, target: Any, url: str, secret_file: Path) -> dict[str, Any]:
    """Run one client process to its end (bounded) and return what it reported."""
    results = ctx.Queue()
    process = ctx.Process(target=target, args=(url, str(secret_file), results))
    process.start()
    try:
        report = results.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        report = {"error": f"no report within {CHILD_TIMEOUT_S} s"}
    process.join(STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join(STOP_TIMEOUT_S)
    if "error" not in report and process.exitcode != 0:
        report = {"error": f"exited with code {process.exitcode}"}
    return report


def start_store(secret_file: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start the store on a free loopback port; returns the process and the URL it bound."""
    command = [sys.executable, "-m", "kvconnector.cli.store", "store", "serve",
               "--listen", "tcp://127.0.0.1:*", "--capacity", CAPACITY,
               "--security", "secret", "--secret-file", str(secret_file)]
    with log_path.open("wb") as log:
        store = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and store.poll() is None:
        if select.select([store.stdout], [], [], 0.2)[0]:
            match = _LISTENING.search(store.stdout.readline().decode())
            if match:
                return store, match.group(1)
    stop_store(store)
    raise RuntimeError(f"the store did not start: {' '.join(command)}\n"
                       f"{log_path.read_text(errors='replace')[-2000:]}")


def stop_store(store: subprocess.Popen[bytes]) -> int:
    """SIGTERM, a bounded wait, then SIGKILL; returns the exit code."""
    if store.poll() is None:
        store.send_signal(signal.SIGTERM)
        try:
            store.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            store.kill()
            store.wait(STOP_TIMEOUT_S)
    store.stdout.close()
    return store.returncode


def main() -> int:
    ctx = mp.get_context("spawn")  # fresh interpreters, as two engines would be
    with tempfile.TemporaryDirectory(prefix="kvconnector-example-") as tmp:
        secret_file = Path(tmp) / "store.secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32) + "\n")
        store, url = start_store(secret_file, Path(tmp) / "store.log")
        try:
            a = run_client(ctx, client_a, url, secret_file)
            b = run_client(ctx, client_b, url, secret_file) if "error" not in a else {}
            with StoreClient(url, Security.shared_secret(secret_file),
                             timeout_s=CLIENT_TIMEOUT_S) as client:
                stats = client.stats()
        finally:
            code = stop_store(store)
    for report in (a, b):
        if "error" in report:
            print(f"remote_shared_store: FAILED in client {report.get('client', '?')}: "
                  f"{report['error']}")
            return 1
    if code != 0:
        print(f"remote_shared_store: FAILED: the store exited with code {code}")
        return 1
    mib = LAYOUT.block_bytes / 2**20
    put_rate = a["blocks"] * LAYOUT.block_bytes / a["seconds"] / 1e9
    get_rate = b["blocks"] * LAYOUT.block_bytes / b["seconds"] / 1e9
    print(f"remote_shared_store: OK store at {url} (security {stats['security']}); client A put "
          f"{a['blocks']} blocks x {mib:.2f} MiB ({put_rate:.2f} GB/s); client B's lookup found "
          f"{b['blocks']} of its {b['prompt_blocks']} blocks, got them into its own pool "
          f"({get_rate:.2f} GB/s), every byte checked; store: {stats['blocks']} blocks, "
          f"{stats['put_blocks']} put, {stats['get_blocks']} got")
    return 0


if __name__ == "__main__":
    sys.exit(main())
