"""RedisClusterBackend against a real 3-master Redis Cluster (tests/conftest.py fixtures).

Destination slots are poisoned before every get and compared byte for byte after: a slot holds
the block exactly where its status is OK, and keeps the poison everywhere else.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("redis")

import torch  # noqa: E402

from kvconnector.servers.redis_cluster import LocalRedisCluster  # noqa: E402
from transfer.remote.async_client import AsyncRemoteClient  # noqa: E402
from transfer.remote.backend import BlockStatus  # noqa: E402
from transfer.remote.factory import open_backend  # noqa: E402
from transfer.remote.redis.backend import RedisClusterBackend  # noqa: E402
from transfer.remote.redis.values import HEADER_BYTES, RedisAuth, redis_key  # noqa: E402
from transfer.remote.store.connection import StoreError  # noqa: E402

pytestmark = pytest.mark.redis

Factory = Callable[..., LocalRedisCluster]
NS = bytes(range(16))
OTHER_NS = bytes(range(100, 116))
BLOCK = 256 << 10
POISON = 0xA5


def pool(blocks: int, seed: int = 0, block: int = BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks, block), dtype=torch.uint8, generator=generator)


def keys(count: int, start: int = 0, namespace: bytes = NS) -> list[bytes]:
    return [namespace + f"block-{i:06d}".encode() for i in range(start, start + count)]


def auth(cluster: LocalRedisCluster, **changes: object) -> RedisAuth:
    base = RedisAuth.from_sources(cluster.user, cluster.password_file, cluster.ca_file)
    return RedisAuth(**{"user": base.user, "password": base.password, "ca_file": base.ca_file,
                        **changes})


def backend(cluster: LocalRedisCluster, target: torch.Tensor | None = None,
            namespace: bytes = NS, **options: object) -> RedisClusterBackend:
    return RedisClusterBackend(cluster.url, auth(cluster), namespace=namespace, pool=target,
                               **options)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process SIGSTOPped (a stalled node: its sockets stay open, nothing answers)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_slots(target: torch.Tensor, source: torch.Tensor, ok: tuple[bool, ...]) -> None:
    for slot, good in enumerate(ok):
        if good:
            assert torch.equal(target[slot], source[slot]), slot
        else:
            assert bool((target[slot] == POISON).all()), slot


def masters_of(cluster: LocalRedisCluster, block_keys: list[bytes]) -> list[int]:
    return [cluster.master_index_for_key(redis_key(k)) for k in block_keys]


def stored_with_victim(
        cluster: LocalRedisCluster, count: int, seed: int,
        victim: int) -> tuple[torch.Tensor, torch.Tensor, list[bytes], tuple[bool, ...]]:
    """`count` blocks put on the cluster; returns the source pool, a poisoned target pool, the
    keys, and which keys live on master `victim` (some, not all)."""
    source = pool(count, seed=seed)
    target = torch.full((count, BLOCK), POISON, dtype=torch.uint8)
    names = keys(count)
    on_victim = tuple(m == victim for m in masters_of(cluster, names))
    assert 0 < sum(on_victim) < count
    with backend(cluster, source) as writer:
        assert writer.put(names, range(count)).all_ok
    return source, target, names, on_victim


def test_round_trip_is_bit_exact_over_all_three_masters(redis_cluster: LocalRedisCluster) -> None:
    source, target = pool(48, seed=1), torch.full((48, BLOCK), POISON, dtype=torch.uint8)
    names = keys(48)
    assert set(masters_of(redis_cluster, names)) == {0, 1, 2}
    with backend(redis_cluster, source) as writer, backend(redis_cluster, target) as reader:
        put = writer.put(names, range(48))
        assert put.all_ok and put.pinned_slots == () and set(put.errors) == {""}
        got = reader.get(names, list(reversed(range(48))))
        assert got.all_ok
        assert torch.equal(target.flip(0), source)
        assert reader.lookup(names) == 48
        assert reader.exists([names[3], NS + b"absent"]) == [True, False]
        stats = reader.stats()["nodes"]
        assert sorted(node["keys"] for node in stats.values()) == \
            sorted(masters_of(redis_cluster, names).count(i) for i in range(3))
        assert reader.ping() == 1
        assert reader.delete(names) == [True] * 48
        assert reader.lookup(names) == 0


def test_get_reports_misses_per_block_and_lookup_stops_at_the_first(
        redis_cluster: LocalRedisCluster) -> None:
    source, target = pool(6, seed=2), torch.full((6, BLOCK), POISON, dtype=torch.uint8)
    names = keys(6, start=100)
    with backend(redis_cluster, source) as writer, backend(redis_cluster, target) as reader:
        assert writer.put([names[i] for i in (0, 1, 3, 4)], [0, 1, 3, 4]).all_ok
        got = reader.get(names, range(6))
        assert got.statuses == (BlockStatus.OK, BlockStatus.OK, BlockStatus.MISSING,
                                BlockStatus.OK, BlockStatus.OK, BlockStatus.MISSING)
        assert "does not hold" in got.errors[2]
        assert_slots(target, source, got.ok)
        assert reader.lookup(names) == 2
        writer.delete(names)


def test_tampered_values_never_reach_a_slot(redis_cluster: LocalRedisCluster) -> None:
    source, target = pool(8, seed=3), torch.full((8, BLOCK), POISON, dtype=torch.uint8)
    names = keys(8, start=200)
    admin = redis_cluster.admin()
    with backend(redis_cluster, source) as writer, \
            backend(redis_cluster, source, namespace=OTHER_NS) as other:
        assert writer.put(names, range(8)).all_ok
        foreign = keys(1, start=200, namespace=OTHER_NS)
        assert other.put(foreign, [1]).all_ok
        admin.setrange(redis_key(names[0]), HEADER_BYTES + 1000, b"\x00\x01")  # flipped bytes
        admin.set(redis_key(names[1]), admin.get(redis_key(foreign[0])))  # another namespace
        admin.set(redis_key(names[2]), admin.get(redis_key(names[2]))[:-100])  # truncated
        admin.set(redis_key(names[3]), admin.get(redis_key(names[4])))  # another key's value
        admin.set(redis_key(names[4]), b"not a block")
        admin.append(redis_key(names[5]), b"x" * 5000)  # longer than any block value
        admin.delete(redis_key(names[6]))
        admin.rpush(redis_key(names[6]), b"not a string")
        other.delete(foreign)
    with backend(redis_cluster, target) as reader:
        got = reader.get(names, range(8))
        assert got.statuses == (BlockStatus.CORRUPT, BlockStatus.CORRUPT, BlockStatus.SIZE,
                                BlockStatus.CORRUPT, BlockStatus.CORRUPT, BlockStatus.SIZE,
                                BlockStatus.FAILED, BlockStatus.OK)
        assert "checksum" in got.errors[0] and "namespace" in got.errors[1]
        assert "checksum" in got.errors[3] and "header" in got.errors[4]
        assert f"{HEADER_BYTES + BLOCK + 5000} B" in got.errors[5]
        assert "WRONGTYPE" in got.errors[6]
        assert_slots(target, source, got.ok)
        reader.delete(names)
    admin.close()


def test_wrong_or_missing_credentials_are_refused_and_nothing_is_written(
        redis_cluster: LocalRedisCluster) -> None:
    source = pool(3, seed=4)
    names = keys(3, start=300)
    refused = re.compile("invalid username-password pair or user is disabled"
                         "|Authentication required")
    for bad in (auth(redis_cluster, password="wrong-password"),
                auth(redis_cluster, user=None, password=None)):  # the disabled default user
        with RedisClusterBackend(redis_cluster.url.replace(f"{redis_cluster.user}@", ""), bad,
                                 namespace=NS, pool=source, timeout_s=2.0) as intruder:
            put = intruder.put(names, range(3))
            assert put.statuses == (BlockStatus.FAILED,) * 3
            assert all(refused.search(e) for e in put.errors), put.errors
            with pytest.raises(StoreError, match=refused):
                intruder.lookup(names)
    with backend(redis_cluster) as reader:
        assert reader.exists(names) == [False] * 3


def test_bad_arguments_are_refused_before_anything_is_sent(
        redis_cluster: LocalRedisCluster) -> None:
    from transfer.remote.store.security import Security

    with pytest.raises(ValueError, match="needs a RedisAuth"):
        RedisClusterBackend(redis_cluster.url, Security.none(), namespace=NS)
    with pytest.raises(ValueError, match="not loopback: give a password"):
        RedisClusterBackend("redis://10.9.8.7:7000", RedisAuth(), namespace=NS)
    with pytest.raises(ValueError, match="scheme must be one of"):
        open_backend("http://127.0.0.1:1", RedisAuth())
    source = pool(2, seed=5)
    with backend(redis_cluster, source) as client:
        with pytest.raises(ValueError, match="not in this client's namespace"):
            client.put(keys(1, namespace=OTHER_NS), [0])
        with pytest.raises(ValueError, match="slot 7 is outside"):
            client.put(keys(1), [7])
        with pytest.raises(ValueError, match="slot 1 appears twice"):
            client.get(keys(2), [1, 1])
        assert client.exists(keys(2)) == [False, False]


def test_a_cluster_that_is_down_fails_calls_not_construction() -> None:
    target = torch.full((2, BLOCK), POISON, dtype=torch.uint8)
    with RedisClusterBackend("redis://127.0.0.1:1", RedisAuth(), namespace=NS, pool=target,
                             timeout_s=1.0) as client:
        got = client.get(keys(2), [0, 1])
        assert got.statuses == (BlockStatus.FAILED,) * 2 and "127.0.0.1:1" in got.errors[0]
        with pytest.raises(StoreError, match="Redis Cluster"):
            client.lookup(keys(2))
    assert bool((target == POISON).all())


def test_eviction_turns_into_misses_not_errors(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(maxmemory=12 << 20)
    count, block = 60, 1 << 20  # 60 MiB into 36 MiB of maxmemory
    source = pool(count, seed=6, block=block)
    target = torch.full((count, block), POISON, dtype=torch.uint8)
    names = keys(count)
    with backend(cluster, source) as writer, backend(cluster, target) as reader:
        for start in range(0, count, 10):
            assert writer.put(names[start:start + 10], range(start, start + 10)).all_ok
        got = reader.get(names, range(count))
        missing = got.statuses.count(BlockStatus.MISSING)
        assert set(got.statuses) == {BlockStatus.OK, BlockStatus.MISSING}
        assert 20 <= missing < count, missing
        assert_slots(target, source, got.ok)
        # Reads evict too (reply buffers count toward maxmemory): what is left is what was not.
        evicted = sum(n["evicted_keys"] for n in reader.stats()["nodes"].values())
        assert missing <= evicted and sum(reader.exists(names)) == count - evicted


def test_a_master_killed_mid_get_fails_only_its_blocks(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory()
    count = 36
    source, target, names, on_victim = stored_with_victim(cluster, count, seed=7, victim=1)
    with AsyncRemoteClient(cluster.url, auth(cluster), namespace=NS, pool=target,
                           timeout_s=5.0) as reader:
        victim = cluster.pids[1]
        os.kill(victim, signal.SIGSTOP)  # the get reaches it and waits ...
        started = time.monotonic()
        future = reader.get(names, range(count))
        time.sleep(0.3)
        cluster.kill(1)  # ... and the connection dies under it
        got = future.result(timeout=10)
        assert time.monotonic() - started < 5.0
        assert got.ok == tuple(not v for v in on_victim)
        assert all("Connection" in e for e, v in zip(got.errors, on_victim, strict=True) if v)
        assert_slots(target, source, got.ok)
        # Keys on the surviving masters still hit; a lookup stops at the first lost block.
        first_lost = on_victim.index(True)
        assert reader.lookup(names).result() == first_lost
        survivors = [k for k, v in zip(names, on_victim, strict=True) if not v]
        target.fill_(POISON)
        again = reader.get(survivors, range(len(survivors))).result()
        assert again.all_ok
        # Back after a restart (empty: no persistence): misses, not errors.
        cluster.restart(1)
        lost = [k for k, v in zip(names, on_victim, strict=True) if v]
        after = reader.get(lost, range(len(lost))).result()
        assert set(after.statuses) == {BlockStatus.MISSING}, after.errors


def test_a_failed_over_master_is_followed_to_its_replica(redis_cluster_factory: Factory) -> None:
    """A replica per master: a killed master's blocks fail within the deadline until its replica
    takes over; the same backend then finds them there, bit-exact, and writes there."""
    cluster = redis_cluster_factory(replicas=1)
    count = 24
    source, target, names, on_victim = stored_with_victim(cluster, count, seed=11, victim=1)
    cluster.wait_replicated()  # replication is asynchronous: what was not copied would be lost
    with backend(cluster, target, timeout_s=2.0) as reader:
        assert reader.get(names, range(count)).all_ok  # connected, with the old slot map
        cluster.kill(1)
        target.fill_(POISON)
        started = time.monotonic()
        got = reader.get(names, range(count))
        assert time.monotonic() - started < 3.0
        assert got.ok == tuple(not v for v in on_victim), got.errors
        assert {s for s, v in zip(got.statuses, on_victim, strict=True) if v} == {
            BlockStatus.FAILED}
        assert_slots(target, source, got.ok)
        promoted = cluster.wait_for_failover(1)
        assert promoted in cluster.replica_indices(1)
        tries = 0
        while True:  # the backend re-reads the slot map after a failure, in the background
            tries += 1
            target.fill_(POISON)
            started = time.monotonic()
            got = reader.get(names, range(count))
            assert time.monotonic() - started < 3.0
            assert_slots(target, source, got.ok)
            assert all(got.ok[i] for i, v in enumerate(on_victim) if not v)
            if got.all_ok or tries == 20:
                break
            time.sleep(0.25)
        assert got.all_ok, got.errors
        # New blocks in the failed master's slots land on the promoted replica.
        fresh_names = keys(count, start=1000)
        fresh = pool(count, seed=12)
        with backend(cluster, fresh) as writer:
            assert writer.put(fresh_names, range(count)).all_ok
        target.fill_(POISON)
        assert reader.get(fresh_names, range(count)).all_ok
        assert torch.equal(target, fresh)
        assert any(m == 1 for m in masters_of(cluster, fresh_names))


def test_a_stalled_master_costs_its_blocks_the_deadline_and_never_writes_late(
        redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory()
    count = 24
    source, target, names, on_victim = stored_with_victim(cluster, count, seed=8, victim=2)
    with backend(cluster, target, timeout_s=5.0) as reader:
        assert reader.ping() == 1  # connected, as a running engine is (a first connect to a
        with stopped(cluster.pids[2]):  # stalled cluster is bounded the same way)
            started = time.monotonic()
            got = reader.get(names, range(count), timeout_s=0.5)
            elapsed = time.monotonic() - started
        assert elapsed < 1.5, elapsed
        assert got.ok == tuple(not v for v in on_victim), got.errors
        assert all("deadline" in e for e, v in zip(got.errors, on_victim, strict=True) if v)
        time.sleep(0.5)  # the abandoned pipeline completes now: its bytes must not land
        assert_slots(target, source, got.ok)
    # A first connect that meets a stalled seed is bounded by the call's deadline too.
    target.fill_(POISON)
    with backend(cluster, target, timeout_s=5.0) as fresh:
        with stopped(cluster.pids[0]):
            started = time.monotonic()
            got = fresh.get(names, range(count), timeout_s=0.5)
            elapsed = time.monotonic() - started
        assert elapsed < 1.5, elapsed
        assert got.statuses == (BlockStatus.FAILED,) * count
        assert "no slot map before the deadline" in got.errors[0]
        assert bool((target == POISON).all())
        time.sleep(0.2)
        assert fresh.get(names, range(count)).all_ok  # the connect finished meanwhile
        assert torch.equal(target, source)


def test_a_moved_slot_is_followed(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory()
    source, target = pool(1, seed=9), torch.full((1, BLOCK), POISON, dtype=torch.uint8)
    name = keys(1, start=900)
    key = redis_key(name[0])
    with backend(cluster, source) as writer, backend(cluster, target) as reader:
        assert writer.put(name, [0]).all_ok
        assert reader.lookup(name) == 1  # the reader has read the slot map
        old = cluster.master_index_for_key(key)
        new = (old + 1) % 3
        nodes = [cluster.node_client(i) for i in range(3)]
        node_ids = [c.execute_command("CLUSTER", "MYID") for c in nodes]
        node_ids = [i.decode() if isinstance(i, bytes) else i for i in node_ids]
        slot = nodes[old].execute_command("CLUSTER", "KEYSLOT", key)
        host, port = cluster.nodes[new]
        nodes[new].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_ids[old])
        nodes[old].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_ids[new])
        nodes[old].execute_command("MIGRATE", host, port, "", 0, 5000, "AUTH2", cluster.user,
                                   cluster.password, "KEYS", key)
        for client in nodes:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_ids[new])
        deadline = time.monotonic() + 5
        while cluster.master_index_for_key(key) != new and time.monotonic() < deadline:
            time.sleep(0.05)
        got = reader.get(name, [0])
        assert got.all_ok, got.errors
        assert torch.equal(target, source)
        assert writer.put(name, [0]).all_ok  # the writer follows the move too
        for client in nodes:
            client.close()


def test_tls_cluster_round_trip_and_an_unknown_ca_is_refused(
        redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(tls=True)
    assert cluster.url.startswith("rediss://")
    source, target = pool(6, seed=10), torch.full((6, BLOCK), POISON, dtype=torch.uint8)
    names = keys(6)
    with backend(cluster, source) as writer, backend(cluster, target) as reader:
        assert writer.put(names, range(6)).all_ok
        assert reader.get(names, range(6)).all_ok
        assert torch.equal(target, source)
    target.fill_(POISON)
    untrusted = auth(cluster, ca_file=None)  # the system CAs do not know ours
    with RedisClusterBackend(cluster.url, untrusted, namespace=NS, pool=target,
                             timeout_s=2.0) as stranger:
        got = stranger.get(names, range(6))
        assert got.statuses == (BlockStatus.FAILED,) * 6
        assert "CERTIFICATE_VERIFY_FAILED" in got.errors[0]
    assert bool((target == POISON).all())


def test_concurrent_backends_share_blocks(redis_cluster: LocalRedisCluster) -> None:
    source = pool(16, seed=11)
    names = keys(16, start=1000)
    targets = [torch.full((16, BLOCK), POISON, dtype=torch.uint8) for _ in range(3)]
    results: list[bool] = []
    with backend(redis_cluster, source) as writer:
        assert writer.put(names, range(16)).all_ok

    def read(target: torch.Tensor) -> None:
        with backend(redis_cluster, target) as reader:
            results.append(reader.lookup(names) == 16 and reader.get(names, range(16)).all_ok)

    threads = [threading.Thread(target=read, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 3
    assert all(torch.equal(t, source) for t in targets)
    with backend(redis_cluster) as cleaner:
        cleaner.delete(names)


@pytest.mark.parametrize(("workers", "per_master"), [(8, 2), (3, 1), (2, 1)])
def test_a_call_holds_at_most_its_lanes_connections_per_master(
        redis_cluster: LocalRedisCluster, workers: int, per_master: int) -> None:
    """Pipelines run in lanes, each on one connection for the whole call: workers // masters
    of them per master (at least one), not one connection per pipeline in flight."""
    count = 48
    whole = torch.cat([pool(count, seed=11), torch.full((count, BLOCK), POISON,
                                                        dtype=torch.uint8)])
    names = keys(count)
    nodes = [redis_cluster.node_client(master) for master in range(3)]
    before = [max(c["id"] for c in node.client_list()) for node in nodes]
    with backend(redis_cluster, whole, workers=workers) as client:
        assert client.put(names, range(count)).all_ok
        assert client.get(names, range(count, 2 * count)).all_ok
        assert torch.equal(whole[count:], whole[:count])
        for node, last_before in zip(nodes, before, strict=True):
            lanes = [c for c in node.client_list()
                     if int(c["id"]) > int(last_before) and c["cmd"] in ("set", "get")]
            assert 1 <= len(lanes) <= per_master, lanes
        client.delete(names)
    for node in nodes:
        node.close()

