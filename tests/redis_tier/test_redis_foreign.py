"""Values under our block keys that are not ours (issue 24): whatever someone else wrote there,
and huge values. Lookups and exists count none of them as held; a get refuses each with a
per-block error before any byte reaches its slot, and never holds a huge value in memory, on
the direct path or after a moved slot (real redis-server processes, tests/conftest.py).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import pytest

pytest.importorskip("redis")

import torch  # noqa: E402

from kvconnector.servers.redis_cluster import LocalRedisCluster  # noqa: E402
from transfer.remote.backend import BlockStatus  # noqa: E402
from transfer.remote.redis.backend import RedisClusterBackend  # noqa: E402
from transfer.remote.redis.values import RedisAuth, redis_key  # noqa: E402

pytestmark = pytest.mark.redis

NS = bytes(range(16))
OTHER_NS = bytes(range(100, 116))
BLOCK = 64 << 10
HUGE = 96 << 20  # a value far past any block's
HELD_BOUND = 8 << 20  # what a get may allocate in Python for its blocks (a few values' worth)
POISON = 0xA5


def _pool(blocks: int, block: int = BLOCK, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks, block), dtype=torch.uint8, generator=generator)


def _keys(count: int, start: int = 0, namespace: bytes = NS) -> list[bytes]:
    return [namespace + f"foreign-{i:06d}".encode() for i in range(start, start + count)]


def _backend(cluster: LocalRedisCluster, pool: torch.Tensor | None,
             namespace: bytes = NS) -> RedisClusterBackend:
    auth = RedisAuth.from_sources(cluster.user, cluster.password_file, cluster.ca_file)
    return RedisClusterBackend(cluster.url, auth, namespace=namespace, pool=pool)


def _peak_allocated(call: Callable[[], object]) -> tuple[object, int]:
    """`call()` and the most Python memory it held at once (tracemalloc sees every bytes
    object redis-py or hiredis would make of a reply)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - before


def test_values_not_ours_are_never_held_nor_landed(redis_cluster: LocalRedisCluster) -> None:
    source = _pool(8, seed=1)
    target = torch.full_like(source, POISON)
    names = _keys(8)
    admin = redis_cluster.admin()
    with _backend(redis_cluster, source) as writer, \
            _backend(redis_cluster, _pool(1, seed=2), namespace=OTHER_NS) as other, \
            _backend(redis_cluster, _pool(1, block=2 * BLOCK, seed=3)) as wider:
        assert writer.put(names, range(8)).all_ok
        foreign = _keys(1, namespace=OTHER_NS)
        assert other.put(foreign, [0]).all_ok
        admin.set(redis_key(names[2]), b"not a block at all")
        admin.set(redis_key(names[3]), admin.get(redis_key(foreign[0])))  # another namespace
        admin.delete(redis_key(names[4]))
        admin.rpush(redis_key(names[4]), b"not a string")
        admin.setrange(redis_key(names[5]), HUGE, b"!")  # huge: our header, then zeros
        assert wider.put(names[6:7], [0]).all_ok  # a block of another size, same namespace
        other.delete(foreign)
    with _backend(redis_cluster, target) as reader:
        assert reader.exists(names) == [True, True, False, False, False, False, False, True]
        assert reader.lookup(names) == 2
        got, peak = _peak_allocated(lambda: reader.get(names, range(8)))
        assert got.statuses == (BlockStatus.OK, BlockStatus.OK, BlockStatus.CORRUPT,
                                BlockStatus.CORRUPT, BlockStatus.FAILED, BlockStatus.SIZE,
                                BlockStatus.SIZE, BlockStatus.OK)
        assert "header" in got.errors[2] and "namespace" in got.errors[3]
        assert "WRONGTYPE" in got.errors[4] and f"{HUGE + 1} B" in got.errors[5]
        assert peak < HELD_BOUND, f"a get held {peak} B of Python memory"
        for slot, ok in enumerate(got.ok):
            expected = source[slot] if ok else torch.full_like(source[slot], POISON)
            assert torch.equal(target[slot], expected), slot
        reader.delete(names)
    admin.close()


def test_a_huge_value_behind_a_moved_slot_is_refused_without_being_held(
        redis_cluster_factory: Callable[..., LocalRedisCluster]) -> None:
    cluster = redis_cluster_factory()
    source = _pool(1, seed=4)
    target = torch.full_like(source, POISON)
    name = _keys(1, start=900)
    key = redis_key(name[0])
    with _backend(cluster, source) as writer, _backend(cluster, target) as reader:
        assert writer.put(name, [0]).all_ok
        assert reader.lookup(name) == 1  # the reader has read the slot map
        old = cluster.master_index_for_key(key)
        new = (old + 1) % 3
        nodes = [cluster.node_client(i) for i in range(3)]
        ids = [c.execute_command("CLUSTER", "MYID") for c in nodes]
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        slot = nodes[old].execute_command("CLUSTER", "KEYSLOT", key)
        host, port = cluster.nodes[new]
        nodes[new].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[old])
        nodes[old].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[new])
        nodes[old].execute_command("MIGRATE", host, port, "", 0, 5000, "AUTH2", cluster.user,
                                   cluster.password, "KEYS", key)
        for client in nodes:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[new])
        deadline = time.monotonic() + 5
        while cluster.master_index_for_key(key) != new and time.monotonic() < deadline:
            time.sleep(0.05)
        nodes[new].setrange(key, HUGE, b"!")  # the reader still asks the old node first
        got, peak = _peak_allocated(lambda: reader.get(name, [0]))
        assert got.statuses == (BlockStatus.SIZE,), got.errors
        assert peak < HELD_BOUND, f"a get held {peak} B of Python memory"
        assert bool((target == POISON).all())
        for client in nodes:
            client.close()
