"""A Redis Cluster shared by two engines: one stores a prompt's blocks, the other reuses them.

What it shows, all on loopback:
- a real 3-master Redis Cluster of Debian's redis-server (kvconnector.servers.redis_cluster
  starts it: an ACL user with a random password in a 0600 file, `maxmemory-policy allkeys-lru`,
  `cluster-require-full-coverage no`);
- engine A (its own process and host pool, 2 MiB blocks like Llama-3.1-8B's block-major layout)
  puts a prompt's blocks under namespaced keys made from chained block hashes, through
  `open_backend(url, RedisAuth)`: the same interface as our own store, chosen by the URL;
- engine B (another process, its own pool) asks for the longest stored prefix of a longer prompt
  that starts with A's, and gets it into free slots of its pool; every byte is checked;
- which master holds which block (they spread over all three), then the cluster is stopped.

Run it (needs redis-server on PATH and redis-py: `pip install -e '.[redis]'`):

    python examples/redis_shared_cluster.py

It prints one line, `redis_shared_cluster: OK ...`, and exits with code 1 when anything fails.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import sys
from collections import Counter
from typing import Any

import torch

from kvconnector.servers.redis_cluster import LocalRedisCluster
from transfer.keys import Namespace
from transfer.remote.factory import open_backend
from transfer.remote.redis.values import RedisAuth, redis_key

BLOCK_TOKENS = 16
BLOCK_BYTES = 2 << 20
NAMESPACE = Namespace(model="example/llama-3.1-8b", dtype="bfloat16", block_size=BLOCK_TOKENS,
                      block_layout="BLNHC", salt="redis-example")
SHARED_BLOCKS, EXTRA_BLOCKS = 12, 4
TIMEOUT_S = 60


def prompt_tokens(blocks: int) -> list[int]:
    return [(7 * i + 3) % 32000 for i in range(blocks * BLOCK_TOKENS)]


def block_keys(tokens: list[int]) -> list[bytes]:
    """Chained hashes of full blocks, as vLLM makes them, under the namespace."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        chunk = str(tokens[start:start + BLOCK_TOKENS]).encode()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return NAMESPACE.keys(hashes)


def block_content(key: bytes) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int.from_bytes(key[-8:], "little"))
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


def engine_a(url: str, auth: RedisAuth, results: Any) -> None:
    keys = block_keys(prompt_tokens(SHARED_BLOCKS))
    pool = torch.empty(len(keys), BLOCK_BYTES, dtype=torch.uint8)
    for slot, key in enumerate(keys):
        pool[slot] = block_content(key)
    with open_backend(url, auth, namespace=NAMESPACE, pool=pool, timeout_s=TIMEOUT_S) as client:
        put = client.put(keys, range(len(keys)))
    results.put({"put_ok": sum(put.ok), "errors": [e for e in put.errors if e]})


def engine_b(url: str, auth: RedisAuth, results: Any) -> None:
    keys = block_keys(prompt_tokens(SHARED_BLOCKS + EXTRA_BLOCKS))
    pool = torch.full((32, BLOCK_BYTES), 0xA5, dtype=torch.uint8)  # poisoned free slots
    with open_backend(url, auth, namespace=NAMESPACE, pool=pool, timeout_s=TIMEOUT_S) as client:
        prefix = client.lookup(keys)
        slots = list(range(5, 5 + prefix))
        got = client.get(keys[:prefix], slots)
    wrong = [i for i, (key, slot) in enumerate(zip(keys[:prefix], slots, strict=True))
             if not torch.equal(pool[slot], block_content(key))]
    results.put({"prefix": prefix, "get_ok": sum(got.ok), "wrong": wrong,
                 "errors": [e for e in got.errors if e]})


def run(ctx: Any, target: Any, url: str, auth: RedisAuth) -> dict[str, Any]:
    results = ctx.Queue()
    process = ctx.Process(target=target, args=(url, auth, results))
    process.start()
    try:
        return results.get(timeout=TIMEOUT_S)
    finally:
        process.join(TIMEOUT_S)


def main() -> int:
    ctx = mp.get_context("spawn")
    with LocalRedisCluster(masters=3, maxmemory=256 << 20) as cluster:
        auth = RedisAuth.from_sources(cluster.user, cluster.password_file)
        a = run(ctx, engine_a, cluster.url, auth)
        b = run(ctx, engine_b, cluster.url, auth)
        masters = Counter(cluster.master_index_for_key(redis_key(k))
                          for k in block_keys(prompt_tokens(SHARED_BLOCKS)))
    ok = (a["put_ok"] == SHARED_BLOCKS and b["prefix"] == SHARED_BLOCKS
          and b["get_ok"] == SHARED_BLOCKS and not b["wrong"] and len(masters) == 3)
    if not ok:
        print(f"redis_shared_cluster: FAILED engine A {a}, engine B {b}, masters {masters}")
        return 1
    print(f"redis_shared_cluster: OK engine A put {a['put_ok']} blocks of 2 MiB; engine B found "
          f"a {b['prefix']}-block prefix of its {SHARED_BLOCKS + EXTRA_BLOCKS} and got it, every "
          f"byte checked; blocks per master {sorted(masters.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
