"""Client of the remote block store: pool blocks to and from the store in pipelined batches.

The pool is a 2-D uint8 CPU tensor (num_slots, block_bytes), e.g. `KVBuffer.block_chunks()`;
rows must be contiguous (the row stride may exceed block_bytes). A put sends each slot straight
from pool memory as a zero-copy zmq frame; the slot stays pinned (`pinned_slots`) until zmq
reports the frame sent. A get receives each block with recv_into straight into its slot and
checks the frame size, and then the checksum on the same lane thread, the block still in its
core's cache, while zmq's IO thread receives the next (a hop to a checker thread per block cost
a fifth more CPU per GiB on 2 cores, and gets at 0.56-0.88 of the raw streams with 8
connections on 16): a slot is valid only where its status is OK, whatever happened (timeout,
lost connection, corrupt or short frame).

A client runs several lanes (`connections`, transfer.remote.store.lanes: one TCP stream moves
what one core copies), each a thread with a connection to each of the store's workers
(transfer.remote.store.workers, asked for at the first call and again after a failure or a
lost connection: a restarted store's workers listen on other ports), and
deals each put's and get's requests over the lanes by their blocks; each key goes to its own
worker (transfer.remote.store.shards); statuses come back in the order of the keys whatever the
lane; lookups, exists, deletes and stats combine the workers' answers.
On a timeout or a lost connection the client drops that socket and connects afresh, so nothing
late lands in a slot the caller has taken back, and a restarted store is found again; the
other lanes' blocks are not affected.
A StoreClient belongs to one thread at a time; AsyncRemoteClient (transfer.remote.async_client)
runs one on a background thread and returns futures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from itertools import count, zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus, RemoteBackend, TransferResult, check_positive
from transfer.remote.store.connection import Complete, Connection, Exchange, StoreError
from transfer.remote.store.heap import keep_received_memory
from transfer.remote.store.lanes import Lanes, default_connections, spread_batch
from transfer.remote.store.protocol import (
    FRAME_SLACK_BYTES,
    Limits,
    Op,
    ProtocolError,
    Reply,
    encode_request,
    quoted,
    reply_bools,
    reply_count,
    reply_statuses,
    reply_uints,
)
from transfer.remote.store.results import STORE_STATUS_TEXT, checked, failed, result
from transfer.remote.store.security import Security, tcp_host
from transfer.remote.store.shards import split, sum_stats, worker_urls

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 5.0
# A put checksums a request's blocks just before zmq sends them: small put requests keep
# those bytes in cache for the send (measured on 2 cores: ~20% less CPU per byte for hashing
# and the send copy than 32 MiB requests). Gets check each block right after its recv_into,
# so their requests can be larger, which spreads the store's per-request work.
DEFAULT_PUT_BATCH_BYTES = 4 << 20
DEFAULT_GET_BATCH_BYTES = 16 << 20
DEFAULT_MAX_IN_FLIGHT = 8  # requests per connection
BATCH_BLOCKS = 1024  # keys per request; well under the store's default limit


class StoreClient(RemoteBackend):
    """Connections to one store for one namespace and (for put/get) one pool.

    Without a pool only lookup/exists/delete/stats/ping work (over one connection); without a
    namespace only stats/ping. `timeout_s` bounds the wait for each reply. `connections`: how
    many lanes a put or get spreads its requests over (default: from the cores,
    `default_connections`), each with a connection to every worker of the store and up to
    `max_in_flight` requests unanswered.
    """

    def __init__(self, url: str, security: Security, *,
                 namespace: Namespace | bytes | None = None, pool: torch.Tensor | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 put_batch_bytes: int = DEFAULT_PUT_BATCH_BYTES,
                 get_batch_bytes: int = DEFAULT_GET_BATCH_BYTES,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 connections: int | None = None) -> None:
        tcp_host(url)
        if not isinstance(security, Security):
            raise ValueError(f"security must be a Security, got {security!r}")
        super().__init__(url, namespace=namespace, pool=pool, timeout_s=timeout_s)
        for name, value in (("put_batch_bytes", put_batch_bytes),
                            ("get_batch_bytes", get_batch_bytes), ("max_in_flight", max_in_flight)):
            check_positive(name, value)
        block_bytes = self.block_bytes
        # the store refuses a put or get of more blocks than its message limit (64 MiB)
        message_bytes = Limits().max_message_bytes
        self._put_batch = blocks_per_batch(min(put_batch_bytes, message_bytes), block_bytes)
        self._get_batch = blocks_per_batch(min(get_batch_bytes, message_bytes), block_bytes)
        self._sending: dict[int, list[zmq.MessageTracker]] = {}
        self._sending_lock = threading.Lock()  # pinned_slots may be asked from another thread
        largest_frame = max(Limits().max_header_bytes, block_bytes) + FRAME_SLACK_BYTES
        if connections is None:  # key queries alone gain nothing from more connections
            connections = 1 if pool is None else default_connections()
        if pool is not None:  # gets receive blocks into buffers zmq mallocs
            keep_received_memory()
        self._request_ids = count(1)
        self._lane_options = {"max_frame_bytes": largest_frame,
                              "max_in_flight": int(max_in_flight)}
        self._security = security
        self._connections = connections
        self._lanes = Lanes([url], security, count=connections, **self._lane_options)
        self._routed = False  # the store's workers are known (asked at the next call if not)

    @property
    def pinned_slots(self) -> frozenset[int]:
        """Slots an earlier put still lends to zmq: don't overwrite them yet."""
        with self._sending_lock:
            self._sending = {slot: trackers for slot, trackers in self._sending.items()
                             if not all(t.done for t in trackers)}
            return frozenset(self._sending)

    def put(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        """Store pool slot `slots[i]` under `keys[i]`; per-block results."""
        keys, slots = self.check_transfer(keys, slots, distinct_slots=False)
        rows = [self._rows[slot] for slot in slots]
        try:
            parts = self._batches(keys, self._put_batch, timeout_s)
        except StoreError as exc:
            return failed(len(keys), str(exc))
        batches = []
        for shard, indices in parts:
            rid = next(self._request_ids)
            part_rows = [rows[i] for i in indices]
            header = partial(self._put_header, rid, [keys[i] for i in indices], part_rows)
            batches.append(Exchange(rid, header, indices, part_rows, shard=shard))
        statuses = [BlockStatus.FAILED] * len(keys)

        def complete(_: Connection, batch: Exchange, reply: Reply) -> None:
            for i, status in zip(batch.indices, reply_statuses(reply, len(batch.indices)),
                                 strict=True):
                statuses[i] = status

        self._exchange(batches, complete, timeout_s)
        pinned = self._wait_sent(batches, slots, timeout_s)
        return result(batches, statuses, [STORE_STATUS_TEXT.get(s, "") for s in statuses],
                       pinned)

    def get(self, keys: Sequence[bytes], slots: Sequence[int], *,
            timeout_s: float | None = None) -> TransferResult:
        """Fetch `keys[i]` into pool slot `slots[i]`; a slot holds its block iff status is OK."""
        keys, slots = self.check_transfer(keys, slots, distinct_slots=True)
        self.check_not_pinned(slots)
        try:
            parts = self._batches(keys, self._get_batch, timeout_s)
        except StoreError as exc:
            return failed(len(keys), str(exc))
        batches = []
        for shard, indices in parts:
            rid = next(self._request_ids)
            header = encode_request(rid, Op.GET, self.namespace, [keys[i] for i in indices])
            batches.append(Exchange(rid, header, indices, shard=shard))
        statuses = [BlockStatus.FAILED] * len(keys)
        errors = [""] * len(keys)

        def complete(connection: Connection, batch: Exchange, reply: Reply) -> None:
            n = len(batch.indices)
            wire = reply_statuses(reply, n)
            sizes, sums = reply_uints(reply, "sizes", n), reply_uints(reply, "sums", n)
            for i, status, size, checksum in zip(batch.indices, wire, sizes, sums, strict=True):
                if status is not BlockStatus.OK:
                    statuses[i], errors[i] = status, STORE_STATUS_TEXT[status]
                    continue
                row = self._rows[slots[i]]
                status, errors[i] = connection.receive_block(row, size)
                if status is not BlockStatus.OK:
                    statuses[i] = status
                else:  # OK only once its checksum matches
                    statuses[i], errors[i] = checked(row, keys[i], checksum)

        self._exchange(batches, complete, timeout_s)
        return result(batches, statuses, errors, ())

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading `keys` the store holds (the longest stored prefix)."""
        keys = self.check_keys(keys)
        positions = split(keys, self._route(timeout_s))
        # each worker answers for its own keys, in order, a chunk at a time until one is
        # missing: the prefix ends at the first key any worker misses
        found, start = len(keys), [0] * len(positions)
        prefixes: dict[int, int] = {}  # by request id

        def complete(_: Connection, request: Exchange, reply: Reply) -> None:
            prefixes[request.request_id] = reply_count(reply, "prefix", len(request.indices))

        while True:
            requests = []
            for shard, mine in enumerate(positions):
                chunk = mine[start[shard]:start[shard] + BATCH_BLOCKS]
                if chunk and chunk[0] < found:
                    rid = next(self._request_ids)
                    header = encode_request(rid, Op.LOOKUP, self.namespace,
                                            [keys[i] for i in chunk])
                    requests.append(Exchange(rid, header, chunk, shard=shard))
            if not requests:
                return found
            self._exchange_all(requests, complete, timeout_s)
            for request in requests:
                prefix = prefixes[request.request_id]
                if prefix < len(request.indices):
                    found = min(found, request.indices[prefix])
                    positions[request.shard] = []
                else:
                    start[request.shard] += len(request.indices)

    def exists(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        """Whether the store holds each key."""
        return self._bools(Op.EXISTS, "found", keys, timeout_s)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> list[bool]:
        """Remove keys; True where the store held the key."""
        return self._bools(Op.DELETE, "deleted", keys, timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The store's counters (see docs/protocol.md), summed over its workers."""
        requests = [Exchange(rid, encode_request(rid, Op.STATS), shard=shard)
                    for shard in range(self._route(timeout_s))
                    for rid in [next(self._request_ids)]]
        stats: dict[int, dict[str, Any]] = {}

        def complete(_: Connection, request: Exchange, reply: Reply) -> None:
            stats[request.shard] = _field(reply, "stats", dict)

        self._exchange_all(requests, complete, timeout_s)
        return sum_stats([stats[shard] for shard in sorted(stats)])

    def ping(self, *, timeout_s: float | None = None) -> int:
        """Round trip to the store; returns its protocol version."""
        return self._call(Op.PING, None, lambda r: _field(r, "protocol", int), timeout_s)

    @property
    def connections(self) -> int:
        return len(self._lanes)

    def close(self) -> None:
        """Drop the connections; frames not yet sent are discarded."""
        self._lanes.close()

    def _put_header(self, request_id: int, keys: list[bytes], rows: list[np.ndarray]) -> bytes:
        sums = [block_checksum(row, key) for row, key in zip(rows, keys, strict=True)]
        return encode_request(request_id, Op.PUT, self.namespace, keys,
                              [row.nbytes for row in rows], sums)

    def _bools(self, op: Op, name: str, keys: Sequence[bytes],
               timeout_s: float | None) -> list[bool]:
        keys = self.check_keys(keys)
        requests = []
        for shard, mine in enumerate(split(keys, self._route(timeout_s))):
            for start in range(0, len(mine), BATCH_BLOCKS):
                chunk = mine[start:start + BATCH_BLOCKS]
                rid = next(self._request_ids)
                header = encode_request(rid, op, self.namespace, [keys[i] for i in chunk])
                requests.append(Exchange(rid, header, chunk, shard=shard))
        answers = [False] * len(keys)

        def complete(_: Connection, request: Exchange, reply: Reply) -> None:
            values = reply_bools(reply, name, len(request.indices))
            for index, value in zip(request.indices, values, strict=True):
                answers[index] = value

        self._exchange_all(requests, complete, timeout_s)
        return answers

    def _call(self, op: Op, keys: list[bytes] | None, parse: Callable[[Reply], Any],
              timeout_s: float | None, request_id: int | None = None) -> Any:
        """One request to the store's first worker (the one at `url`)."""
        rid = next(self._request_ids) if request_id is None else request_id
        request = Exchange(rid, encode_request(rid, op, self.namespace, keys or ()))
        parsed = []
        self._lanes.lanes[0].exchange(
            [request], lambda _, __, reply: parsed.append(parse(reply)),
            self.call_timeout(timeout_s))
        if request.error:
            self._routed = False
            raise StoreError(request.error)
        return parsed[0]

    def _route(self, timeout_s: float | None) -> int:
        """How many workers the store has, asking it (its ping) unless known; lanes to each.
        StoreError when the store does not answer."""
        if self._routed and self._lanes.lost():
            # a worker went away: a store restarted on the same address has its workers on
            # other ports, where every request would wait out its deadline
            self._routed = False
        if self._routed:
            return len(self._lanes.urls)
        # id 0, never a put's or get's: after a failure the connection is a fresh one, so no
        # earlier ping's reply can come in its place
        ports = self._call(Op.PING, None, lambda reply: reply.fields.get("shards"), timeout_s,
                           request_id=0)
        try:
            urls = worker_urls(self.url, ports)
        except ProtocolError as exc:
            raise StoreError(f"malformed reply from the store at {self.url}: {exc}") from None
        if urls != self._lanes.urls:  # each lane a connection to each worker
            lanes = Lanes(urls, self._security, count=self._connections, **self._lane_options)
            self._lanes.close()
            self._lanes = lanes
        self._routed = True
        return len(urls)

    def _batches(self, keys: list[bytes], batch_blocks: int,
                 timeout_s: float | None) -> list[tuple[int, list[int]]]:
        """A put's or get's requests: (worker, the positions of its keys), the workers' in turn
        (so the lanes' windows hold requests to every worker at once)."""
        workers = self._route(timeout_s)
        per_worker = []
        for shard, mine in enumerate(split(keys, workers)):
            step = spread_batch(len(mine), batch_blocks, -(-len(self._lanes) // workers))
            per_worker.append([(shard, mine[start:start + step])
                               for start in range(0, len(mine), step)])
        return [batch for turn in zip_longest(*per_worker) for batch in turn if batch]

    def _exchange(self, requests: list[Exchange], complete: Complete,
                  timeout_s: float | None) -> None:
        self._lanes.exchange(requests, complete, self.call_timeout(timeout_s))
        if any(request.error for request in requests):
            self._routed = False  # ask again: the store may have restarted with other workers

    def _exchange_all(self, requests: list[Exchange], complete: Complete,
                      timeout_s: float | None) -> None:
        """Requests of key queries: StoreError unless every one has its answer."""
        self._exchange(requests, complete, timeout_s)
        for request in requests:
            if request.error:
                raise StoreError(request.error)

    def _wait_sent(self, requests: list[Exchange], slots: list[int],
                   timeout_s: float | None) -> tuple[int, ...]:
        """Wait until zmq is done with every put frame; slots it still holds stay pinned."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for request in requests:
            for index, tracker in zip(request.indices, request.trackers, strict=False):
                try:
                    tracker.wait(max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    with self._sending_lock:
                        self._sending.setdefault(slots[index], []).append(tracker)
        return tuple(sorted(self.pinned_slots.intersection(slots)))


def _field(reply: Reply, name: str, kind: type) -> Any:
    value = reply.fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"reply {name} must be a {kind.__name__}, got {quoted(value)}")
    return value


def blocks_per_batch(batch_bytes: int, block_bytes: int) -> int:
    """Blocks per request: as many as fit in `batch_bytes`, at least one."""
    return max(1, min(BATCH_BLOCKS, batch_bytes // max(1, block_bytes)))
