"""Blocks in a Redis Cluster (or Valkey), through redis-py's cluster client.

Each block is one value (transfer.remote.redis.values: header + bytes) under `kvc:` + its key.
A batch is split by the node that owns each key's hash slot, and each node's share runs as
pipelines of at most `batch_bytes` (transfer.remote.redis.wire: values never copied into Python
objects) on a small thread pool, so the masters work in parallel and a dead or slow node fails
only its own blocks: its blocks get FAILED (load errors; misses for a lookup), the others
complete. No call outlives its timeout: node
work still running at the deadline is abandoned, and a gate stops it from writing into a slot
afterwards. Redirections (a slot moved, a failover) are retried once through the cluster
client, which follows MOVED/ASK, and the slot map is refreshed on the next call. A value under
one of our keys that is not one of our blocks (someone else's, another namespace's, a huge one)
never counts as held for a lookup, and a get refuses it per block without ever holding more than
a block value's bytes of it.

Eviction and expiry are Redis's own: run the masters with `maxmemory` and
`maxmemory-policy allkeys-lru`; an evicted block is a miss. With no replicas, set
`cluster-require-full-coverage no` so the surviving masters keep serving when one dies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    RedisError,
)
from redis.retry import Retry

from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus, RemoteBackend, TransferResult, check_positive
from transfer.remote.redis.lanes import Gate, Lane, deal_lanes, default_workers, run_lane
from transfer.remote.redis.replies import REDIRECT_TEXT, REDIRECTS, describe, key_answer, put_status
from transfer.remote.redis.values import (
    HEADER_BYTES,
    VALUE_VERSION,
    RedisAuth,
    RedisURL,
    decode_value,
    encode_value,
    redis_key,
    value_header,
)
from transfer.remote.redis.wire import ValueTooLarge, get_values, set_values
from transfer.remote.store.connection import StoreError

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 5.0
# One large value per pipeline: Redis reads a big argument straight into place only at the head
# of its input buffer, so deep pipelines of 2 MB values slow the server; parallelism comes from
# lanes instead (`redis_lanes.deal_lanes`): workers // masters connections per master, each
# sending its values in turn, so one lane checksums the next value while another's is on the
# wire (`default_workers`).
DEFAULT_BATCH_BYTES = 4 << 20
DEFAULT_WORKERS = default_workers()
KEYS_PER_PIPELINE = 1024  # lookups, exists, deletes
_REFRESH_INTERVAL_S = 1.0
_LATE = "no reply from its Redis node before the deadline"
_STATS = ("used_memory", "maxmemory", "evicted_keys", "keyspace_hits", "keyspace_misses",
          "connected_clients")


class RedisClusterBackend(RemoteBackend):
    """A Redis Cluster as the remote tier for one namespace and (for put/get) one pool.

    `url`: `redis://[user@]host:port[,host:port...]` (seeds; the rest of the cluster is
    discovered), `rediss://` for TLS. `auth`: RedisAuth (ACL user and password; the URL's
    user wins over auth.user). Without a password the seeds must be loopback.
    """

    def __init__(self, url: str, auth: RedisAuth, *,
                 namespace: Namespace | bytes | None = None, pool: torch.Tensor | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 workers: int = DEFAULT_WORKERS) -> None:
        self._url = RedisURL.parse(url)
        if not isinstance(auth, RedisAuth):
            raise ValueError(f"a Redis URL needs a RedisAuth, got {auth!r}")
        if auth.password is None and not self._url.loopback:
            raise ValueError(f"Redis URL {url!r} is not loopback: give a password (an ACL "
                             f"user's, from a file or the environment)")
        super().__init__(url, namespace=namespace, pool=pool, timeout_s=timeout_s)
        check_positive("batch_bytes", batch_bytes)
        check_positive("workers", workers)
        self._auth = auth
        self._blocks_per_pipeline = max(1, int(batch_bytes) // (self.block_bytes + HEADER_BYTES))
        self._workers = int(workers)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvconnector-redis")
        self._cluster: RedisCluster | None = None
        self._stale = False  # a node failed or a slot moved: re-read the slot map
        self._connecting: Future[Any] | None = None  # making the client or re-reading the map
        self._next_refresh = 0.0  # ... at most once a second while a node stays down
        self._late_puts: list[tuple[Future[Any], list[int]]] = []
        self._late_lock = threading.Lock()  # pinned_slots may be asked from another thread
        self._buffers = threading.local()  # each pool thread's GET buffer (one value)
        # Read the slot map now, in the background: the first call (a scheduler's lookup, with
        # a deadline well under a second) would otherwise wait for it and could miss.
        self._connecting = self._pool.submit(self._make_cluster)

    @property
    def pinned_slots(self) -> frozenset[int]:
        with self._late_lock:
            self._late_puts = [(f, slots) for f, slots in self._late_puts if not f.done()]
            return frozenset(slot for _, slots in self._late_puts for slot in slots)

    def put(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        keys, slots = self.check_transfer(keys, slots, distinct_slots=False)
        rows = self._rows
        statuses = [BlockStatus.FAILED] * len(keys)
        errors = [_LATE] * len(keys)

        def send(conn: Any, indices: list[int], gate: Gate) -> None:
            values = [(value_header(keys[i], rows[slots[i]]), rows[slots[i]]) for i in indices]
            replies = set_values(conn, [redis_key(keys[i]) for i in indices], values)
            for i, reply in zip(indices, replies, strict=True):
                statuses[i], errors[i] = put_status(reply)

        def resend(i: int, cluster: RedisCluster, gate: Gate) -> None:
            statuses[i], errors[i] = put_status(
                cluster.set(redis_key(keys[i]), encode_value(keys[i], rows[slots[i]])))

        late = self._run(keys, self._blocks_per_pipeline, send, resend, statuses, errors,
                         timeout_s)
        pinned = sorted({slots[i] for future, indices in late for i in indices})
        with self._late_lock:
            self._late_puts += [(f, [slots[i] for i in indices]) for f, indices in late]
        return _result(statuses, errors, tuple(pinned))

    def get(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        keys, slots = self.check_transfer(keys, slots, distinct_slots=True)
        self.check_not_pinned(slots)
        rows, block_bytes = self._rows, self.block_bytes
        statuses = [BlockStatus.FAILED] * len(keys)
        errors = [_LATE] * len(keys)

        def land(i: int, reply: Any, gate: Gate) -> None:
            if isinstance(reply, ValueTooLarge):
                statuses[i], errors[i] = BlockStatus.SIZE, str(reply)
                return
            if isinstance(reply, Exception):
                statuses[i], errors[i] = BlockStatus.FAILED, describe(reply)
                return
            if reply is None:
                statuses[i], errors[i] = BlockStatus.MISSING, "the cluster does not hold this key"
                return
            status, error = decode_value(reply, keys[i], block_bytes)  # before the slot
            if status is BlockStatus.OK:
                if not gate.enter():
                    return  # the call returned: the slot is the caller's again
                try:
                    np.copyto(rows[slots[i]], np.frombuffer(reply, np.uint8, offset=HEADER_BYTES))
                    statuses[i], errors[i] = status, error
                finally:
                    gate.leave()
            else:
                statuses[i], errors[i] = status, error

        def fetch(conn: Any, indices: list[int], gate: Gate) -> None:
            replies = get_values(conn, [redis_key(keys[i]) for i in indices], self._buffer())
            for i, reply in zip(indices, replies, strict=True):
                if isinstance(reply, REDIRECTS):
                    statuses[i], errors[i] = BlockStatus.FAILED, describe(reply)
                else:
                    land(i, reply, gate)

        def refetch(i: int, cluster: RedisCluster, gate: Gate) -> None:
            # through the cluster client, which follows the move; never more than a block
            # value's bytes, so a huge value is refused without being held
            limit = len(self._buffer())
            value = cluster.getrange(redis_key(keys[i]), 0, limit)
            land(i, ValueTooLarge(len(value), limit) if len(value) > limit else value or None,
                 gate)

        self._run(keys, self._blocks_per_pipeline, fetch, refetch, statuses, errors, timeout_s)
        return _result(statuses, errors, ())

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Leading keys held; a key on a node that fails or answers late ends the prefix.
        StoreError only when no key could be asked at all."""
        found = self._ask("held", keys, timeout_s)
        if found and all(isinstance(f, str) for f in found):
            raise StoreError(f"no Redis node answered: {found[0]}")
        return next((i for i, f in enumerate(found) if f is not True), len(found))

    def exists(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        """Whether each key holds a block of ours (see `holds_block`)."""
        return _all_answered(self._ask("held", keys, timeout_s))

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        return _all_answered(self._ask("delete", keys, timeout_s))

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Per master (host:port): memory, evictions, hits, misses, clients, keys."""
        cluster = self._connect(time.monotonic() + self.call_timeout(timeout_s))
        stats = {}
        for node in cluster.get_primaries():
            try:
                info = cluster.get_redis_connection(node).info()
            except RedisError as exc:
                stats[node.name] = {"error": describe(exc)}
                continue
            stats[node.name] = {name: info.get(name) for name in _STATS}
            stats[node.name]["keys"] = info.get("db0", {}).get("keys", 0)
        return {"backend": "redis-cluster", "nodes": stats}

    def ping(self, *, timeout_s: float | None = None) -> int:
        """PING every master; StoreError naming the first that does not answer."""
        cluster = self._connect(time.monotonic() + self.call_timeout(timeout_s))
        for node in cluster.get_primaries():
            try:
                cluster.get_redis_connection(node).ping()
            except RedisError as exc:
                raise StoreError(f"Redis node {node.name}: {describe(exc)}") from None
        return VALUE_VERSION

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        connecting, cluster = self._connecting, self._cluster
        self._connecting = self._cluster = None
        if connecting is not None:  # a client still being made is closed once it is made
            connecting.add_done_callback(lambda made: _close_made(made, cluster))
        if cluster is not None:
            cluster.close()

    def _buffer(self) -> memoryview:
        """This thread's buffer for one value, reused by every get it runs."""
        buffer = getattr(self._buffers, "value", None)
        if buffer is None:
            buffer = self._buffers.value = memoryview(bytearray(HEADER_BYTES + self.block_bytes))
        return buffer

    def _connect(self, deadline: float) -> RedisCluster:
        """The cluster client. It is made (and the slot map read) on a pool thread, waited for
        until `deadline` only: a cluster that is down or stalled fails calls, not construction,
        and never holds one past its deadline. After a failure the slot map is re-read in the
        background while calls go on with the old one."""
        finished = self._connecting
        if finished is not None and finished.done():
            self._connecting = None
            if finished.exception() is not None:
                self._stale = True
            elif self._cluster is None:
                self._cluster = finished.result()
        if self._cluster is not None:
            if self._stale and self._connecting is None \
                    and time.monotonic() >= self._next_refresh:
                self._stale, self._next_refresh = False, time.monotonic() + _REFRESH_INTERVAL_S
                self._connecting = self._pool.submit(self._cluster.nodes_manager.initialize)
            return self._cluster
        if self._connecting is None:
            self._connecting = self._pool.submit(self._make_cluster)
        connecting = self._connecting
        wait([connecting], max(0.0, deadline - time.monotonic()))
        if not connecting.done():
            raise StoreError(f"Redis Cluster {self.url}: no slot map before the deadline")
        self._connecting = None
        if connecting.exception() is not None:
            raise StoreError(f"Redis Cluster {self.url}: "
                             f"{describe(connecting.exception())}") from None
        self._cluster = connecting.result()
        return self._cluster

    def _make_cluster(self) -> RedisCluster:
        auth = self._auth
        tls = ({"ssl": True, "ssl_ca_certs": str(auth.ca_file) if auth.ca_file else None}
               if self._url.tls else {})
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self._url.seeds],
            username=self._url.user or auth.user, password=auth.password,
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            socket_read_size=1 << 20, require_full_coverage=False,
            # RESP2: redis_wire reads GET replies itself, and RESP3 could put push messages
            # (maintenance notifications) between them
            protocol=2, retry=Retry(NoBackoff(), 1), **tls)

    def _node_pipelines(self, cluster: RedisCluster, keys: list[bytes], per_pipeline: int,
                        answers: list[Any]) -> list[Lane]:
        """Each node's client and its keys cut into pipelines; keys of uncovered slots
        answered here."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, key in enumerate(keys):
            try:
                node = cluster.get_node_from_key(redis_key(key))
            except RedisError as exc:
                answers[i] = describe(exc)
                continue
            by_node.setdefault(node.name, (node, []))[1].append(i)
        return [(cluster.get_redis_connection(node),
                 [indices[s:s + per_pipeline] for s in range(0, len(indices), per_pipeline)])
                for node, indices in by_node.values()]

    def _run(self, keys: list[bytes], per_pipeline: int,
             work: Callable[[Any, list[int], Gate], None],
             redo: Callable[[int, RedisCluster, Gate], None], statuses: list[BlockStatus],
             errors: list[str], timeout_s: float | None) -> list[tuple[Future[Any], list[int]]]:
        """Runs `work` on every pipeline, in lanes (`deal_lanes`) on the pool's threads, until the
        deadline, then `redo` for redirected keys. Returns the lanes still running (abandoned:
        they stop at their next pipeline) with their futures and keys."""
        deadline = time.monotonic() + self.call_timeout(timeout_s)
        try:
            cluster = self._connect(deadline)
        except StoreError as exc:
            errors[:] = [str(exc)] * len(keys)
            return []
        gate = Gate()
        unrouted: list[Any] = [None] * len(keys)
        futures = {self._pool.submit(run_lane, work, client, pipelines, gate):
                   [i for indices in pipelines for i in indices]
                   for client, pipelines in deal_lanes(
                       self._node_pipelines(cluster, keys, per_pipeline, unrouted),
                       self._workers)}
        for i, reason in enumerate(unrouted):
            if reason is not None:
                errors[i] = reason
        done, running = wait(futures, max(0.0, deadline - time.monotonic()))
        for future in done:
            if future.exception() is not None:  # the connection failed: the lane's blocks only
                self._stale = True
                for i in futures[future]:
                    if errors[i] is _LATE:  # (the pipelines it ran before have their answers)
                        errors[i] = describe(future.exception())
        redirected = [i for i, e in enumerate(errors)
                      if statuses[i] is BlockStatus.FAILED and e.startswith(REDIRECT_TEXT)]
        if redirected:
            self._stale = True
            for i in redirected:
                if time.monotonic() >= deadline:
                    break
                try:
                    redo(i, cluster, gate)
                except RedisError as exc:
                    statuses[i], errors[i] = BlockStatus.FAILED, describe(exc)
        gate.close()
        return [(f, futures[f]) for f in running]

    def _ask(self, verb: str, keys: Sequence[bytes], timeout_s: float | None) -> list[Any]:
        """`held` (the value's header and length: GETRANGE, STRLEN) or `delete` for each key,
        pipelined per node: True/False, or why not (a str)."""
        keys = self.check_keys(keys)
        answers: list[Any] = [_LATE] * len(keys)
        deadline = time.monotonic() + self.call_timeout(timeout_s)
        cluster = self._connect(deadline)
        # one task per pipeline, round-robin over the nodes
        shares = [share for turn in zip_longest(*(
            [(client, indices) for indices in pipelines]
            for client, pipelines in self._node_pipelines(cluster, keys, KEYS_PER_PIPELINE,
                                                          answers)))
            for share in turn if share is not None]

        def ask(client: redis.Redis, indices: list[int]) -> None:
            pipe = client.pipeline(transaction=False)
            for i in indices:
                if verb == "held":
                    pipe.getrange(redis_key(keys[i]), 0, HEADER_BYTES - 1)
                    pipe.strlen(redis_key(keys[i]))
                else:
                    pipe.delete(redis_key(keys[i]))
            replies = iter(pipe.execute(raise_on_error=False))
            for i, reply in zip(indices, replies, strict=False):
                length = next(replies) if verb == "held" else None
                answers[i] = key_answer(verb, reply, length, keys[i], self.block_bytes)

        futures = {self._pool.submit(ask, client, indices): indices for client, indices in shares}
        done, _ = wait(futures, max(0.0, deadline - time.monotonic()))
        for future in done:
            if future.exception() is not None:
                self._stale = True
                for i in futures[future]:
                    answers[i] = describe(future.exception())
        return list(answers)


def _all_answered(answers: list[Any]) -> list[bool]:
    failed = next((a for a in answers if isinstance(a, str)), None)
    if failed is not None:
        raise StoreError(f"a Redis node did not answer: {failed}")
    return answers


def _close_made(made: Future[Any], adopted: RedisCluster | None) -> None:
    """Close a cluster client that `_make_cluster` finished after `close` (a slot-map
    refresh returns None; the adopted client is closed by `close` itself)."""
    if not made.cancelled() and made.exception() is None and made.result() not in (None, adopted):
        made.result().close()


def _result(statuses: list[BlockStatus], errors: list[str],
            pinned: tuple[int, ...]) -> TransferResult:
    errors = ["" if s is BlockStatus.OK else e for s, e in zip(statuses, errors, strict=True)]
    return TransferResult(tuple(statuses), tuple(errors), pinned)
