"""The remote tier's scheduler side: asynchronous lookups with a deadline, and its plans.

`RemoteLookups` asks the store how many of the keys the pool (and the tiers before this one)
lack it holds. While the answer is in flight the engine is told "ask again later" (None); on a
timeout, an error or a store known to be down the answer is 0, so a request is served from the
pool or recomputed, never held up. Fetches land in pool slots the scheduler reserved; every
block stored in the pool is written to the store once its store is done (write-through).

Keys: the scheduler's block index uses the namespace of TP rank 0; lookups ask for those keys
only (a rank missing a block makes the load fail and vLLM recompute it); each rank's worker puts
and gets under its own rank's namespace (transfer/remote/worker.py).

A block whose fetch failed (missing at some rank, corrupt, unread in time) is refused from then
on: lookups end before it and a fetch naming it is not planned, so the request recomputes it
instead of fetching it again (the store keeps a key's first block on a later put, so a corrupt
one would fail every fetch; a rank's worker deletes such a block, transfer/remote/worker.py).
It is offered again once this engine has written it to the store anew. At most MAX_REFUSED
keys are refused, the oldest forgotten first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.settings import RemoteSettings
from transfer.tier import TierOp, TierPlanner

MAX_REFUSED = 1 << 16


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
        self._pending.clear()
        self._client.close(drop_queued=True)


class RemotePlanner(TierPlanner):
    """The store as a tier below the pool: lookups through `RemoteLookups`; fetches and writes
    need no plan of their own (the store finds blocks by key). With `settings.only` the pool
    only stages blocks on their way to and from the store."""

    name = "remote"

    def __init__(self, settings: RemoteSettings, namespace_digest: bytes,
                 backoff_s: float | None = None) -> None:
        self.pool_stages = settings.only
        self.lookups = RemoteLookups(settings, namespace_digest, backoff_s)
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # failed fetches (module doc)
        self._writing: dict[int, list[bytes]] = {}  # write op -> the refused keys it writes

    def lookup(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        if self._refused:
            keys = keys[:next((i for i, key in enumerate(keys) if key in self._refused),
                              len(keys))]
            if not keys:
                return 0
        return self.lookups.poll(req_id, keys)

    def forget(self, req_id: str) -> None:
        self.lookups.forget(req_id)

    def plan_fetch(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int],
                   segment: str = "") -> TierOp | None:
        if self._refused and any(key in self._refused for key in keys):
            return None
        return TierOp(self.name, op_id, False, tuple(keys), tuple(slots), segment=segment)

    def complete_fetch(self, op_id: int, keys: Sequence[bytes], bad: Sequence[bytes]) -> None:
        for key in bad:
            self._refused[key] = None
            self._refused.move_to_end(key)
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)

    def plan_write(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int], *,
                   evicted: bool, segment: str = "",
                   sums: Sequence[Sequence[int]] | None = None) -> TierOp | None:
        if evicted:
            return None  # written through: an evicted block is in the store already
        if self._refused and (anew := [key for key in keys if key in self._refused]):
            self._writing[op_id] = anew
        return TierOp(self.name, op_id, True, tuple(keys), tuple(slots), segment=segment)

    def complete_write(self, op_id: int, bad: Sequence[bytes]) -> None:
        # a failed put is a later miss; a refused key written anew is offered again
        for key in self._writing.pop(op_id, ()):
            if key not in bad:
                self._refused.pop(key, None)

    def take_counters(self) -> dict[str, float]:
        return {"lookup_failures": self.lookups.take_failures()}

    def close(self) -> None:
        self.lookups.close()
