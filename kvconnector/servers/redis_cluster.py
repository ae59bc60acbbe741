"""A real local Redis Cluster (Debian's redis-server) for the tests, the bench and examples.

LocalRedisCluster starts `masters` redis-server processes on free 127.0.0.1 ports in a private
temp dir, forms a cluster with the slots split evenly over them (and `replicas` replicas of each
master, if asked), and tears it all down on stop(), at interpreter exit, or when the object is
collected.

Auth is an ACL user with a random password (the `default` user is off); the password lives only
in each node's 0600 config file and in `password_file`, never on a command line. With tls=True
the nodes listen on TLS only, with a throwaway CA (`ca_file`) and a server cert for 127.0.0.1.

`url` is "redis://USER@127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3" ("rediss://" with TLS): the user
name rides in the first host's userinfo, the password is never in the URL (read password_file).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from kvconnector.servers import certs as redis_certs
from kvconnector.servers.redis_nodes import HOST, NodeProcesses, free_ports, node_config

CONVERGE_TIMEOUT_S = 30.0
_POLL_S = 0.05


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.execute_command("CLUSTER", "INFO")
    info = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in info.split() if ":" in line)


def _slot_map(client: redis.Redis) -> list[tuple[int, int, list[int]]]:
    """CLUSTER SLOTS as (low, high, [master port, replica ports...]), in the node's order."""
    return [(int(entry[0]), int(entry[1]), [int(node[1]) for node in entry[2:]])
            for entry in client.execute_command("CLUSTER", "SLOTS")]


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    """0..16383 split into `masters` contiguous, near-equal ranges (inclusive ends)."""
    bounds = [round(i * REDIS_CLUSTER_HASH_SLOTS / masters) for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class LocalRedisCluster:
    """`masters` redis-server processes forming one Redis Cluster on 127.0.0.1 (a context manager).

    Nodes 0..masters-1 are the masters as formed; with replicas, master i's replicas follow
    (`replica_indices(i)`). Without replicas a killed master's slots stay unserved until
    restart(); the survivors keep serving theirs (cluster-require-full-coverage no). With them,
    a replica takes a killed master's slots over after about `node_timeout_ms`
    (`wait_for_failover`).
    """

    def __init__(self, masters: int = 3, *, replicas: int = 0, maxmemory: int | None = None,
                 user: str = "kvconnector", tls: bool = False,
                 node_timeout_ms: int = 1000) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not on PATH: install Debian's redis-server "
                               "(apt-get install redis-server redis-tools)")
        self._user = user
        self._password = secrets.token_urlsafe(32)
        self._maxmemory = maxmemory
        self._tls = tls
        self._node_timeout_ms = node_timeout_ms
        self._ranges = _slot_ranges(masters)
        self._replicas = replicas
        self._root = Path(tempfile.mkdtemp(prefix="kvc-redis-"))  # 0700
        self._nodes = NodeProcesses(server, masters * (1 + replicas), self._root)
        self._finalizer = weakref.finalize(self, self._nodes.stop)  # also runs at exit
        self._ports: list[int] = []
        self._bus_ports: list[int] = []
        self._password_file = self._root / "password"
        self._password_file.touch(mode=0o600)
        self._password_file.write_text(self._password + "\n")
        self._certs = redis_certs.make_certs(self._root) if tls else None
        try:
            self._start_all()
            self._form()
        except BaseException:
            self.stop()
            raise

    # --- public API -------------------------------------------------------------------------

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [(HOST, port) for port in self._ports]

    @property
    def url(self) -> str:
        scheme = "rediss" if self._tls else "redis"
        return f"{scheme}://{self._user}@" + ",".join(f"{h}:{p}" for h, p in self.nodes)

    @property
    def user(self) -> str:
        return self._user

    @property
    def password(self) -> str:
        return self._password

    @property
    def password_file(self) -> Path:
        return self._password_file

    @property
    def pids(self) -> list[int]:
        """PIDs of the live redis-server processes (index order, killed ones left out)."""
        return [self._nodes.pid(i) for i in self._nodes.live()]

    @property
    def ca_file(self) -> Path | None:
        return self._certs[0] if self._certs else None

    def node_client(self, index: int, **kwargs: Any) -> redis.Redis:
        """A plain client for one node (it serves only its own slots; others answer MOVED)."""
        # no retries by default: redis-py's retry backoff would hide a dead node for seconds
        options = {"retry": Retry(NoBackoff(), 0), **self._client_kwargs(), **kwargs}
        return redis.Redis(host=HOST, port=self._ports[index], **options)

    def admin(self, **kwargs: Any) -> RedisCluster:
        """A cluster client with the credentials; keyword args override the defaults."""
        # full coverage not required and few, short retries: a killed master fails fast
        options: dict[str, Any] = {"require_full_coverage": False,
                                   "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
                                   **self._client_kwargs()}
        options.update(kwargs)
        startup = [ClusterNode(h, p) for h, p in self.nodes]
        return RedisCluster(startup_nodes=startup, **options)

    def master_index_for_key(self, key: bytes) -> int:
        """Index (into `nodes`) of the master, as formed, owning the key's slot (hash tags
        honoured). After a failover one of its `replica_indices` serves the slot."""
        return self._index_for_slot(key_slot(key))

    def replica_indices(self, master: int) -> list[int]:
        """Indices (into `nodes`) of the replicas formed for master `master`."""
        start = len(self._ranges) + master * self._replicas
        return list(range(start, start + self._replicas))

    def wait_replicated(self) -> None:
        """Wait until every live replica has applied all its master's writes so far."""
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        for master in range(len(self._ranges)):
            with self.node_client(master) as client:
                target = client.info("replication")["master_repl_offset"]
            for replica in self.replica_indices(master):
                with self.node_client(replica) as client:
                    while client.info("replication").get("slave_repl_offset", -1) < target:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"replica {replica} of master {master} still "
                                               f"behind offset {target}")
                        time.sleep(_POLL_S)

    def wait_for_failover(self, master: int) -> int:
        """After kill(master): wait until one of its replicas serves its slots and every live
        node says the cluster is ok; returns that replica's index. (A failover needs the votes
        of a majority of masters: 3 or more.)"""
        low, _ = self._ranges[master]
        ports = {self._ports[i]: i for i in self.replica_indices(master)}
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while True:
            live = self._nodes.live()
            try:
                with self.node_client(live[0], socket_timeout=1.0) as client:
                    owner = next(nodes[0] for first, last, nodes in _slot_map(client)
                                 if first <= low <= last)
                if owner in ports and all(self._cluster_ok(i) for i in live):
                    return ports[owner]
            except (redis.ConnectionError, redis.TimeoutError, StopIteration):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica of master {master} took its slots over in "
                                   f"{CONVERGE_TIMEOUT_S:.0f} s")
            time.sleep(_POLL_S * 2)

    def kill(self, index: int) -> None:
        """SIGKILL one node and wait for the process to be gone (no-op if already down)."""
        self._nodes.kill(index)

    def restart(self, index: int) -> None:
        """Start a killed node on its ports and nodes.conf, empty (no persistence): a master
        owns its slots again, or, where its replica took them over, rejoins as that replica's
        replica. Wait until the whole cluster is ok."""
        if self._nodes.running(index):
            raise RuntimeError(f"node {index} is still running: kill() it first")
        self._spawn(index)
        self._wait_ready(index)
        self._wait_converged()

    def stop(self) -> None:
        """Terminate every node, wait, remove the temp dir (idempotent)."""
        self._finalizer()

    def log_tail(self, index: int, lines: int = 30) -> str:
        return self._nodes.log_tail(index, lines)

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # --- internals --------------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        options: dict[str, Any] = {"username": self._user, "password": self._password,
                                   "socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        if self._certs:
            options.update(ssl=True, ssl_ca_certs=str(self._certs[0]))
        return options

    def _cluster_ok(self, index: int) -> bool:
        with self.node_client(index, socket_timeout=1.0) as client:
            return _cluster_info(client).get("cluster_state") == "ok"

    def _spawn(self, index: int) -> None:
        self._nodes.spawn(index, node_config(
            self._ports[index], self._bus_ports[index], self._nodes.node_dir(index),
            node_timeout_ms=self._node_timeout_ms, maxmemory=self._maxmemory, user=self._user,
            password=self._password, certs=self._certs))

    def _index_for_slot(self, slot: int) -> int:
        for index, (low, high) in enumerate(self._ranges):
            if low <= slot <= high:
                return index
        raise AssertionError(f"slot {slot} outside 0..{REDIS_CLUSTER_HASH_SLOTS - 1}")

    def _start_all(self) -> None:
        count = len(self._nodes)
        for attempt in range(3):
            ports = free_ports(2 * count)
            self._ports, self._bus_ports = ports[:count], ports[count:]
            for index in range(count):
                self._spawn(index)
            try:
                for index in range(count):
                    self._wait_ready(index)
                return
            except RuntimeError:
                # a port grabbed between probing and binding: retry on fresh ports
                raced = any("Address already in use" in self.log_tail(i) for i in range(count))
                if not raced or attempt == 2:
                    raise
                for index in range(count):
                    self.kill(index)
                    shutil.rmtree(self._nodes.node_dir(index))  # its nodes.conf names the old ports

    def _wait_ready(self, index: int) -> None:
        client = self.node_client(index, socket_timeout=1.0, socket_connect_timeout=1.0)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.TimeoutError):
                return False

        try:
            self._nodes.wait_ready(index, answers)
        finally:
            client.close()

    def _form(self) -> None:
        clients = [self.node_client(i) for i in range(len(self._nodes))]
        try:
            for epoch, (low, high) in enumerate(self._ranges, 1):
                clients[epoch - 1].execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
                # distinct epochs up front, as redis-cli --cluster create does
                clients[epoch - 1].execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for port, bus in zip(self._ports[1:], self._bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER", "MEET", HOST, port, bus)
            for master in range(len(self._ranges)):
                master_id = clients[master].execute_command("CLUSTER", "MYID")
                for replica in self.replica_indices(master):
                    self._replicate(clients[replica], master_id)
        finally:
            for client in clients:
                client.close()
        self._wait_converged()

    def _replicate(self, client: redis.Redis, master_id: bytes | str) -> None:
        """CLUSTER REPLICATE, retried until the node has heard of the master (gossip)."""
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while True:
            try:
                client.execute_command("CLUSTER", "REPLICATE", master_id)
                return
            except redis.ResponseError:  # "Unknown node": MEET has not reached it yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(_POLL_S)

    def _convergence_problem(self) -> str | None:
        """None when every node is ok, knows all nodes, flags none failed, and has our slot map:
        each range served by its master as formed or one of its replicas (after a failover),
        with all the other nodes of that group as its replicas."""
        groups = [{self._ports[i] for i in (master, *self.replica_indices(master))}
                  for master in range(len(self._ranges))]
        expected = sorted((low, high, group) for (low, high), group
                          in zip(self._ranges, map(sorted, groups), strict=True))
        for index in range(len(self._nodes)):
            client = self.node_client(index, socket_timeout=1.0, socket_connect_timeout=1.0)
            try:
                fields = _cluster_info(client)
                if fields.get("cluster_state") != "ok":
                    return f"node {index}: cluster_state={fields.get('cluster_state')}"
                if fields.get("cluster_known_nodes") != str(len(self._nodes)):
                    return f"node {index}: knows {fields.get('cluster_known_nodes')} nodes"
                raw_nodes = client.execute_command("CLUSTER", "NODES")
                if isinstance(raw_nodes, bytes):
                    raw_nodes = raw_nodes.decode()
                if isinstance(raw_nodes, str) and "fail" in raw_nodes:
                    return f"node {index} flags a node as failing"
                slots = sorted((low, high, sorted(ports))
                               for low, high, ports in _slot_map(client))
                if slots != expected:
                    return f"node {index}: slot map {slots} != {expected}"
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                return f"node {index}: {exc!r}"
            finally:
                client.close()
        return None

    def _wait_converged(self) -> None:
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while (problem := self._convergence_problem()) is not None:
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- node {i} ({HOST}:{p}) ---\n{self.log_tail(i)}"
                                  for i, p in enumerate(self._ports))
                raise RuntimeError(f"Redis Cluster did not converge in {CONVERGE_TIMEOUT_S:.0f}"
                                   f" s: {problem}\n{tails}")
            time.sleep(_POLL_S * 2)
