"""The client side of a remote tier: one interface, two backends, chosen by URL.

- `tcp://host:port`: our block store (transfer.remote.store.client.StoreClient, zmq + msgpack);
  credentials: a transfer.remote.store.security.Security.
- `redis://[user@]host:port[,host:port...]` or `rediss://...` (TLS): a Redis Cluster
  (transfer.remote.redis.backend.RedisClusterBackend, redis-py's cluster client);
  credentials: a transfer.remote.redis.backend.RedisAuth.

Both move whole blocks between a pool (a 2-D uint8 CPU tensor, one row per slot) and the store
for one namespace, in batches, with a timeout, and report per block: a slot holds its block iff
that block's status is OK, whatever else happened. A backend belongs to one thread at a time;
transfer.remote.async_client.AsyncRemoteClient runs one on a background thread.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer.keys import DIGEST_BYTES, Namespace

if TYPE_CHECKING:
    import torch

# Keys travel as msgpack bytes (our store) or as part of a Redis key: bounded for both.
MAX_KEY_BYTES = 256


class BlockStatus(str, Enum):
    """Outcome for one block of a put or get."""

    OK = "ok"
    MISSING = "missing"  # get: the store does not hold the key
    CORRUPT = "corrupt"  # the bytes do not match the checksum
    SIZE = "size"  # a frame is not the size declared, or not the size of a pool block
    FULL = "full"  # put: no room without evicting blocks that are being sent
    FAILED = "failed"  # client side only: no usable reply (timeout, lost connection, refusal)


@dataclass(frozen=True)
class TransferResult:
    """Per-block outcome of a put or get, in the order of the keys given."""

    statuses: tuple[BlockStatus, ...]
    errors: tuple[str, ...]  # "" where OK, else why
    pinned_slots: tuple[int, ...] = ()  # put: slots the backend may still read; don't overwrite

    @property
    def ok(self) -> tuple[bool, ...]:
        return tuple(status is BlockStatus.OK for status in self.statuses)

    @property
    def all_ok(self) -> bool:
        return all(status is BlockStatus.OK for status in self.statuses)


class RemoteBackend(ABC):
    """Blocks of one pool to and from one remote store, under one namespace.

    Without a pool only lookup/exists/delete/stats/ping work; without a namespace only
    stats/ping. `timeout_s` bounds each call unless the call gives its own.
    """

    def __init__(self, url: str, *, namespace: Namespace | bytes | None,
                 pool: torch.Tensor | None, timeout_s: float) -> None:
        if isinstance(namespace, Namespace):
            namespace = namespace.digest
        if namespace is not None and (not isinstance(namespace, bytes)
                                      or len(namespace) != DIGEST_BYTES):
            raise ValueError(f"namespace must be a Namespace or a {DIGEST_BYTES}-byte digest, "
                             f"got {namespace!r}")
        check_positive("timeout_s", timeout_s)
        self.url, self.namespace, self.timeout_s = url, namespace, float(timeout_s)
        self._rows = None if pool is None else pool_rows(pool)

    @property
    def num_slots(self) -> int:
        return 0 if self._rows is None else self._rows.shape[0]

    @property
    def block_bytes(self) -> int:
        return 0 if self._rows is None else self._rows.shape[1]

    @property
    def pinned_slots(self) -> frozenset[int]:
        """Slots an earlier put may still read (it outlived its timeout): don't overwrite."""
        return frozenset()

    @abstractmethod
    def put(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        """Store pool slot `slots[i]` under `keys[i]`; per-block results."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        """Fetch `keys[i]` into pool slot `slots[i]`; a slot holds its block iff status is OK."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading `keys` the store holds (the longest stored prefix)."""

    @abstractmethod
    def exists(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        """Whether the store holds each key."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        """Remove keys; True where the store held the key."""

    @abstractmethod
    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The store's counters."""

    @abstractmethod
    def ping(self, *, timeout_s: float | None = None) -> int:
        """Round trip to the store; returns the protocol version it speaks."""

    @abstractmethod
    def close(self) -> None:
        """Drop connections; sends not yet done are abandoned."""

    def __enter__(self) -> RemoteBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call_timeout(self, timeout_s: float | None) -> float:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        return float(timeout)

    def check_keys(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys as a list; ValueError for a key that is malformed or outside the namespace."""
        if self.namespace is None:
            raise ValueError("this client has no namespace: it can only run stats and ping")
        keys = list(keys)
        for index, key in enumerate(keys):
            if not isinstance(key, bytes) or not DIGEST_BYTES < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"key {index} must be {DIGEST_BYTES + 1}..{MAX_KEY_BYTES} "
                                 f"bytes, got {key!r:.80}")
            if key[:DIGEST_BYTES] != self.namespace:
                raise ValueError(f"key {index} ({key.hex()}) is not in this client's namespace "
                                 f"{self.namespace.hex()}")
        return keys

    def check_transfer(self, keys: Iterable[bytes], slots: Iterable[int], *,
                       distinct_slots: bool) -> tuple[list[bytes], list[int]]:
        """Keys and slots as lists; ValueError for bad keys, bad slots or a length mismatch."""
        if self._rows is None:
            raise ValueError("this client has no pool: put and get need one")
        keys = self.check_keys(keys)
        try:
            slots = [operator.index(slot) for slot in slots]
        except TypeError as exc:
            raise ValueError(f"slots must be ints: {exc}") from None
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside the pool's 0..{self.num_slots - 1}")
        if distinct_slots and len(set(slots)) != len(slots):
            twice = next(s for i, s in enumerate(slots) if s in slots[:i])
            raise ValueError(f"slot {twice} appears twice: one slot cannot receive two blocks")
        return keys, slots

    def check_not_pinned(self, slots: list[int]) -> None:
        """ValueError if a get would land in a slot an earlier put still reads. On the
        backend's own thread only: `pinned_slots` prunes state that thread owns."""
        busy = self.pinned_slots.intersection(slots)
        if busy:
            raise ValueError(f"slots {sorted(busy)} are still being sent by an earlier put")


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def pool_rows(pool: torch.Tensor) -> np.ndarray:
    """The pool's slots as a numpy view (shares the memory: rows are the slots themselves)."""
    import torch  # only clients with a pool need torch; lookup-only clients and the CLI don't

    if (not isinstance(pool, torch.Tensor) or pool.dim() != 2 or pool.dtype != torch.uint8
            or pool.device.type != "cpu" or 0 in pool.shape):
        raise ValueError(f"pool must be a non-empty 2-D uint8 CPU tensor (num_slots, "
                         f"block_bytes), got {_describe(pool)}")
    if pool.stride(1) != 1:
        raise ValueError(f"pool rows must be contiguous (stride 1), got strides {pool.stride()}")
    return pool.numpy()


def _describe(value: Any) -> str:
    shape, dtype, device = (getattr(value, a, None) for a in ("shape", "dtype", "device"))
    return f"{type(value).__name__} shape={tuple(shape) if shape is not None else None} " \
           f"dtype={dtype} device={device}"
