"""LocalRedisCluster: a real 3-master Redis Cluster of Debian's redis-server on loopback."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

redis = pytest.importorskip("redis")

from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402

from kvconnector.servers import certs as redis_certs  # noqa: E402
from kvconnector.servers.redis_cluster import LocalRedisCluster  # noqa: E402

pytestmark = pytest.mark.redis

Factory = Callable[..., LocalRedisCluster]
MiB = 1 << 20


def _keys_by_master(cluster: LocalRedisCluster, count: int) -> dict[int, list[bytes]]:
    by_master: dict[int, list[bytes]] = {i: [] for i in range(len(cluster.nodes))}
    for n in range(count):
        key = f"key:{n}".encode()
        by_master[cluster.master_index_for_key(key)].append(key)
    return by_master


def test_all_slots_covered_by_three_distinct_masters(redis_cluster: LocalRedisCluster) -> None:
    assert len(redis_cluster.nodes) == 3
    assert len(set(redis_cluster.nodes)) == 3
    assert all(host == "127.0.0.1" for host, _ in redis_cluster.nodes)
    for index in range(3):
        with redis_cluster.node_client(index) as client:
            slots = client.execute_command("CLUSTER", "SLOTS")
            info = client.execute_command("CLUSTER", "INFO").decode()
        assert "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info
        owners = {(entry[2][0], int(entry[2][1])) for entry in slots}
        assert owners == {(b"127.0.0.1", port) for _, port in redis_cluster.nodes}
        covered = sorted((int(entry[0]), int(entry[1])) for entry in slots)
        assert covered == [(0, 5460), (5461, 10922), (10923, 16383)]
    ports = ",".join(f"127.0.0.1:{port}" for _, port in redis_cluster.nodes)
    assert redis_cluster.url == f"redis://kvconnector@{ports}"
    assert redis_cluster.ca_file is None


def test_set_and_get_through_admin(redis_cluster: LocalRedisCluster) -> None:
    with redis_cluster.admin() as admin:
        payload = os.urandom(4096)
        assert admin.set(b"roundtrip", payload) is True
        assert admin.get(b"roundtrip") == payload
        assert admin.delete(b"roundtrip") == 1
        assert admin.get(b"roundtrip") is None


def test_keys_spread_over_all_masters(redis_cluster: LocalRedisCluster) -> None:
    by_master = _keys_by_master(redis_cluster, 300)
    assert sum(len(keys) for keys in by_master.values()) == 300
    assert all(len(keys) >= 50 for keys in by_master.values()), {
        i: len(k) for i, k in by_master.items()}
    # the computed owner is the node that really holds the key
    with redis_cluster.admin() as admin:
        for index, keys in by_master.items():
            admin.set(keys[0], b"v%d" % index)
    for index, keys in by_master.items():
        with redis_cluster.node_client(index) as client:
            assert client.get(keys[0]) == b"v%d" % index


@pytest.mark.parametrize("credentials", [
    {},  # no AUTH at all: the default user is off
    {"username": "default", "password": ""},
    {"username": "default", "password": "x"},
    {"username": "kvconnector", "password": "wrong-password"},
], ids=["no-auth", "default-empty", "default-x", "wrong-password"])
def test_bad_credentials_are_refused(redis_cluster: LocalRedisCluster,
                                     credentials: dict[str, str]) -> None:
    host, port = redis_cluster.nodes[0]
    client = redis.Redis(host=host, port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0),
                         **credentials)
    with pytest.raises(redis.AuthenticationError) as info:
        client.ping()
    assert type(info.value) is redis.AuthenticationError
    client.close()


def test_password_stays_off_command_lines(redis_cluster: LocalRedisCluster) -> None:
    password_file = redis_cluster.password_file
    assert password_file.read_text().strip() == redis_cluster.password
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert len(redis_cluster.password) >= 32
    pids = redis_cluster.pids
    assert len(pids) == 3
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline
        assert redis_cluster.password.encode() not in cmdline


def test_kill_keeps_other_masters_serving_and_restart_recovers(
        redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory()
    by_master = _keys_by_master(cluster, 90)
    admin = cluster.admin()
    for keys in by_master.values():
        for key in keys:
            assert admin.set(key, key)
    victim = 1
    survivors = [i for i in range(3) if i != victim]
    cluster.kill(victim)
    assert len(cluster.pids) == 2
    for index in survivors:
        with cluster.node_client(index) as client:
            assert [client.get(k) for k in by_master[index]] == by_master[index]
            assert client.set(by_master[index][0], b"after-kill") is True
            assert client.get(by_master[index][0]) == b"after-kill"
    # the cluster client too: survivors' slots work, the dead master's fail fast
    assert admin.get(by_master[survivors[0]][1]) == by_master[survivors[0]][1]
    assert admin.set(by_master[survivors[1]][1], b"x") is True
    with pytest.raises(redis.ConnectionError):
        admin.get(by_master[victim][0])
    with cluster.node_client(victim) as client, pytest.raises(redis.ConnectionError):
        client.get(by_master[victim][0])

    cluster.restart(victim)
    assert len(cluster.pids) == 3
    with cluster.node_client(victim) as client:
        # no persistence: the restarted master owns its slots again, but empty
        assert [client.get(k) for k in by_master[victim]] == [None] * len(by_master[victim])
        assert client.dbsize() == 0
    assert admin.set(by_master[victim][0], b"back") is True
    assert admin.get(by_master[victim][0]) == b"back"
    assert admin.get(by_master[survivors[0]][0]) == b"after-kill"
    admin.close()


def test_maxmemory_evicts_instead_of_failing(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(maxmemory=8 * MiB)
    written = [f"big:{n}".encode() for n in range(40)]
    with cluster.admin() as admin:
        for n, key in enumerate(written):
            assert admin.set(key, bytes([n]) * MiB) is True  # no OOM error
        remaining = [key for key in written if admin.exists(key)]
        assert 0 < len(remaining) < len(written)
        for key in remaining:  # survivors are intact
            assert admin.get(key) == bytes([written.index(key)]) * MiB
    evicted = 0
    for index in range(3):
        with cluster.node_client(index) as client:
            assert client.config_get("maxmemory")["maxmemory"] == str(8 * MiB)
            assert client.info("memory")["used_memory"] <= 8 * MiB
            evicted += client.info("stats")["evicted_keys"]
    assert evicted == len(written) - len(remaining)


@pytest.mark.parametrize("certs", ["openssl", "cryptography"])
def test_tls_cluster(redis_cluster_factory: Factory, monkeypatch: pytest.MonkeyPatch,
                     certs: str) -> None:
    if certs == "cryptography":
        pytest.importorskip("cryptography")
        monkeypatch.setattr(redis_certs, "_openssl", lambda: None)
    elif redis_certs._openssl() is None:
        pytest.skip("no openssl CLI")
    cluster = redis_cluster_factory(tls=True)
    assert cluster.ca_file is not None and cluster.ca_file.is_file()
    assert cluster.url.startswith("rediss://kvconnector@127.0.0.1:")
    with cluster.admin() as admin:
        for n in range(30):
            assert admin.set(f"tls:{n}".encode(), b"%d" % n) is True
        assert [admin.get(f"tls:{n}".encode()) for n in range(30)] == [
            b"%d" % n for n in range(30)]
    host, port = cluster.nodes[0]
    credentials = {"username": cluster.user, "password": cluster.password, "socket_timeout": 2,
                   "socket_connect_timeout": 2, "retry": Retry(NoBackoff(), 0)}
    plain = redis.Redis(host=host, port=port, **credentials)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    unverified = redis.Redis(host=host, port=port, ssl=True, **credentials)  # system CAs only
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        unverified.ping()
    verified = redis.Redis(host=host, port=port, ssl=True, ssl_ca_certs=str(cluster.ca_file),
                           **credentials)
    assert verified.ping() is True
    for client in (plain, unverified, verified):
        client.close()


def test_stop_is_idempotent_and_cleans_up(redis_cluster_factory: Factory) -> None:
    cluster = redis_cluster_factory(masters=2)
    pids, root = cluster.pids, cluster.password_file.parent
    assert len(pids) == 2 and root.is_dir()
    cluster.stop()
    cluster.stop()
    assert cluster.pids == []
    assert not root.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()


def test_missing_redis_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="redis-server is not on PATH"):
        LocalRedisCluster()


def test_replicas_take_a_killed_masters_slots_over(redis_cluster_factory: Factory) -> None:
    with pytest.raises(ValueError, match="replicas must be >= 0, got -1"):
        LocalRedisCluster(replicas=-1)
    cluster = redis_cluster_factory(replicas=1)  # a failover needs a majority of masters
    assert len(cluster.nodes) == 6
    assert [cluster.replica_indices(m) for m in range(3)] == [[3], [4], [5]]
    with cluster.node_client(0) as client:
        slots = sorted(client.execute_command("CLUSTER", "SLOTS"))
    ports = [port for _, port in cluster.nodes]
    assert [(int(e[0]), int(e[1]), [int(n[1]) for n in e[2:]]) for e in slots] == [
        (0, 5460, [ports[0], ports[3]]), (5461, 10922, [ports[1], ports[4]]),
        (10923, 16383, [ports[2], ports[5]])]
    by_master = _keys_by_master(cluster, 200)
    with cluster.admin() as admin:
        for key in by_master[1]:
            assert admin.set(key, key * 100) is True
    cluster.wait_replicated()
    cluster.kill(1)
    assert cluster.wait_for_failover(1) == 4
    with cluster.admin() as admin:  # every key written before the kill, from the replica
        assert [admin.get(key) for key in by_master[1]] == [key * 100 for key in by_master[1]]
    cluster.restart(1)  # the old master comes back as the new one's replica
    with cluster.node_client(1) as client:
        assert client.info("replication")["role"] == "slave"
