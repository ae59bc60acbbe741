"""A remote tier (transfer.remote: our block store, or a Redis Cluster) as the connector's second
tier. No vLLM imports.

Scheduler side, `RemoteLookups`: asks the store, asynchronously and with a deadline, how many of
the keys the CPU tier lacks it holds. While the answer is in flight the adapter tells vLLM "ask
again later" (None); on a timeout, an error or a store known to be down it answers 0 remote
blocks, so a request is served from the CPU tier or recomputed, never held up.

Worker side, `RemoteFetcher`: gets remote hits into the pool slots the scheduler reserved (then
the usual pool -> GPU load runs), and puts stored blocks to the store once their GPU -> pool copy
is done (write-through). Both run on AsyncRemoteClient threads; every non-OK block fails its
job.

Keys: the scheduler's block index uses the namespace of TP rank 0; rank r puts and gets under
its own rank's namespace (same hash, rank r's digest), since its bytes differ. Lookups ask for
rank 0's keys only: a rank missing a block makes the load fail and vLLM recompute it. Where every
TP rank holds the same bytes (MLA's latent cache), all ranks use rank 0's keys and only rank 0
puts (`writes`): one copy in the store instead of one per rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from transfer.keys import DIGEST_BYTES
from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.backend import TransferResult
from transfer.remote.factory import REDIS_SCHEMES
from transfer.remote.redis.values import RedisAuth, RedisURL
from transfer.remote.store.security import Security, require_loopback, tcp_host

SECURITY_CHOICES = ("none", "secret", "curve")


@dataclass(frozen=True)
class RemoteSettings:
    """The remote part of `kv_connector_extra_config` (see ConnectorOptions)."""

    url: str
    credentials: Security | RedisAuth  # Security for tcp://, RedisAuth for redis(s)://
    lookup_deadline_s: float
    timeout_s: float
    only: bool


def is_redis_url(url: str) -> bool:
    return url.partition("://")[0] in REDIS_SCHEMES


def make_redis_auth(url: str, user: str | None, password_file: str | None,
                    ca_file: str | None) -> RedisAuth:
    """RedisAuth for a redis(s):// URL; without a password (file or environment) the URL must
    be loopback. ValueError names the bad value."""
    parsed = RedisURL.parse(url)
    if ca_file is not None and not parsed.tls:
        raise ValueError(f"remote_redis_ca_file is for rediss:// (TLS) URLs, got {url!r}")
    auth = RedisAuth.from_sources(user, password_file, ca_file)
    if auth.password is None and not parsed.loopback:
        raise ValueError(f"Redis without a password is allowed only on loopback; give "
                         f"remote_redis_password_file for {url!r}")
    return auth


def make_security(url: str, mode: str, secret_file: str | None, curve_key_pair: str | None,
                  curve_server_key: str | None) -> Security:
    """The client Security for `remote_security`; ValueError names the missing key."""
    tcp_host(url)
    if mode == "none":
        require_loopback(url, "remote_security 'none'")
        return Security.none()
    if mode == "secret":
        if not secret_file:
            raise ValueError("remote_security 'secret' needs remote_secret_file")
        return Security.shared_secret(secret_file)
    if mode == "curve":
        if not (curve_key_pair and curve_server_key):
            raise ValueError("remote_security 'curve' needs remote_curve_key_pair (this "
                             "client's .key_secret file) and remote_curve_server_key")
        return Security.curve_client(curve_key_pair, curve_server_key)
    raise ValueError(f"remote_security must be one of {SECURITY_CHOICES}, got {mode!r}")


@dataclass
class _Lookup:
    keys: tuple[bytes, ...]
    future: Future[int]
    deadline: float


class RemoteLookups:
    """Asynchronous longest-prefix lookups, one in flight per request (scheduler side).

    After a failed or late lookup the store counts as down for `backoff_s`: lookups in that time
    answer 0 at once instead of each waiting out the deadline.
    """

    def __init__(self, settings: RemoteSettings, namespace_digest: bytes,
                 backoff_s: float | None = None) -> None:
        self.deadline_s = settings.lookup_deadline_s
        self.backoff_s = 10 * self.deadline_s if backoff_s is None else backoff_s
        self._client = AsyncRemoteClient(settings.url, settings.credentials,
                                        namespace=namespace_digest,
                                        timeout_s=settings.lookup_deadline_s)
        self._pending: dict[str, _Lookup] = {}
        self._down_until = 0.0
        self.failures = 0  # lookups that timed out or failed
        self._unreported = 0

    def poll(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        """Leading `keys` the store holds, or None while the answer is in flight."""
        keys = tuple(keys)
        now = time.monotonic()
        pending = self._pending.get(req_id)
        if pending is None or pending.keys != keys:
            if now < self._down_until:
                return 0
            future = self._client.lookup(keys, deadline_s=self.deadline_s)
            self._pending[req_id] = _Lookup(keys, future, now + self.deadline_s)
            return None
        if not pending.future.done():
            if now < pending.deadline:
                return None
            pending.future.cancel()  # late: the client thread drops it or fails it itself
            return self._failed(req_id, now)
        del self._pending[req_id]
        if pending.future.exception() is not None:
            return self._failed(req_id, now)
        return min(int(pending.future.result()), len(keys))

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def take_failures(self) -> int:
        """Failures since the last call (for the connector's counters)."""
        failures, self._unreported = self._unreported, 0
        return failures

    def _failed(self, req_id: str, now: float) -> int:
        self._pending.pop(req_id, None)
        self.failures += 1
        self._unreported += 1
        self._down_until = now + self.backoff_s
        return 0

    def close(self) -> None:
        self._client.close()


class RemoteFetcher:
    """Gets and puts whole blocks between one worker's pool and the store (worker side).

    `pool`: the worker's (num_slots, block_bytes) uint8 slot rows; `namespace_digest`: this
    rank's namespace (keys from the scheduler are re-keyed to it); `writes`: whether this rank
    puts its stored blocks (False on a rank whose bytes another rank puts under the same keys).
    """

    def __init__(self, settings: RemoteSettings, namespace_digest: bytes,
                 pool: torch.Tensor, writes: bool = True) -> None:
        self.timeout_s = settings.timeout_s
        self.writes = writes
        self._digest = namespace_digest
        # Two connections: calls on one run in order, and a load must not wait behind puts.
        self._getter, self._putter = (
            AsyncRemoteClient(settings.url, settings.credentials, namespace=namespace_digest,
                             pool=pool, timeout_s=settings.timeout_s) for _ in range(2))

    def rekey(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self._digest + key[DIGEST_BYTES:] for key in keys]

    def get(self, keys: Sequence[bytes], slots: Sequence[int]) -> Future[TransferResult]:
        return self._getter.get(self.rekey(keys), slots, deadline_s=self.timeout_s)

    def put(self, keys: Sequence[bytes], slots: Sequence[int]) -> Future[TransferResult]:
        return self._putter.put(self.rekey(keys), slots, deadline_s=self.timeout_s)

    def pinned_slots(self) -> frozenset[int]:
        """Slots the transport may still read for a put that timed out (rare). Asked from the
        worker thread while the client thread adds to the set (both backends lock it): a slot
        pinned a moment after this answer is in the next one."""
        return self._putter._client.pinned_slots

    def close(self) -> None:
        self._getter.close()
        self._putter.close()


def leading_ok(future: Future[TransferResult]) -> int:
    """Of a finished get: how many leading blocks arrived OK (0 on an exception)."""
    if future.cancelled() or future.exception() is not None:
        return 0
    ok = future.result().ok
    return next((i for i, flag in enumerate(ok) if not flag), len(ok))


def settled(future: Future[TransferResult]) -> bool | None:
    """None while running; else whether every block is OK (an exception counts as not OK)."""
    if not future.done():
        return None
    if future.cancelled() or future.exception() is not None:
        return False
    return future.result().all_ok
