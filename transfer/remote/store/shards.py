"""Which of a store's workers holds a key, and how answers from several workers combine.

A store may run several worker processes (`kvconnector store serve --workers N`), each its own
index, capacity share and port: one Python thread serves all of a process's requests, and with
many connections that thread, not the network, was the limit (docs/benchmarks.md, "Several
workers"). Keys are split by hash, so every client sends a key to the same worker without
asking: worker `shard_of(key, N)`. The first worker listens on the store's address and its
`ping` reply names every worker's port; a worker refuses keys that are not its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from transfer.remote.store.protocol import ProtocolError, quoted
from transfer.remote.store.security import tcp_host

# stats fields that are the same on every worker (the others are summed)
_SHARED_STATS = frozenset({"protocol", "security", "max_block_bytes", "max_batch_blocks",
                           "workers"})


def shard_of(key: bytes, shards: int) -> int:
    """The worker (0..shards-1) that holds `key`."""
    return 0 if shards == 1 else xxhash.xxh3_64_intdigest(key) % shards


def split(keys: Sequence[bytes], shards: int) -> list[list[int]]:
    """The positions of `keys` per worker, each list in the keys' order."""
    positions: list[list[int]] = [[] for _ in range(shards)]
    if shards == 1:
        positions[0] = list(range(len(keys)))
        return positions
    for index, key in enumerate(keys):
        positions[xxhash.xxh3_64_intdigest(key) % shards].append(index)
    return positions


def worker_urls(url: str, ports: Any) -> list[str]:
    """The workers' addresses from the first worker's `ping` reply (`shards`: their ports, the
    first worker's own first; None: a store of one worker). The first is `url` itself, so a
    store of one worker can sit behind a relay."""
    if ports is None:
        return [url]
    if (not isinstance(ports, list) or len(ports) < 2
            or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
                       for p in ports)):
        raise ProtocolError(f"ping reply shards must be a list of 2 or more ports, "
                            f"got {quoted(ports)}")
    host = tcp_host(url)
    host = f"[{host}]" if ":" in host else host
    return [url, *(f"tcp://{host}:{port}" for port in ports[1:])]


def sum_stats(per_worker: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One store's stats from its workers': counters and sizes summed (capacity included)."""
    total = dict(per_worker[0])
    total.pop("worker", None)
    for stats in per_worker[1:]:
        for name, value in stats.items():
            if name not in _SHARED_STATS and name != "worker" and isinstance(value, int):
                total[name] = total.get(name, 0) + value
    return total
