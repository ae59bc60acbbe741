"""Lanes: one client's connections to the store, and how a call's requests are spread over them.

One TCP stream moves what one core can copy through the kernel (3.3-4.4 GB/s on the 16-core
GPU machine, against 52-55 GB/s of host memory), so a client runs several lanes. A lane is one
thread and one zmq IO thread of the client's own context, with a connection
(transfer.remote.store.connection) to each of the store's workers (transfer.remote.store.workers):
a put or get deals its requests over the lanes by their blocks, each lane sends its share with
its own window of requests in flight, each request on its lane's connection to the request's
worker (`Exchange.shard`), and the call returns once every lane has. So the kernel copies (and
CURVE's encryption, done on the IO threads) run in parallel, the lane threads checksum puts and
receive gets (both release the GIL), and every lane carries an even share of a job's bytes
however its keys fall on the workers: with a lane per worker instead, one client's job of 512
keys over 8 workers gave the busiest lane 1.16-1.32x the mean, and the job waits for it.

A failure (timeout, lost connection) fails the requests of that connection only: each
connection reconnects on its own, and a block's status depends only on its own request.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import zmq

from transfer.remote.store.connection import Complete, Connection, Exchange, StoreError
from transfer.remote.store.security import Security

MAX_DEFAULT_CONNECTIONS = 8
_POLLIN = int(zmq.POLLIN)
T = TypeVar("T")


def default_connections(cores: int | None = None) -> int:
    """Connections (lanes) per client for `cores` cores (default: those this process may run
    on, its CPU affinity): half of them, at most 8; one on 2 cores or fewer, where a second
    stream has no core of its own and costs CPU per byte (docs/benchmarks.md, "Remote tier")."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return 1 if cores <= 2 else max(1, min(MAX_DEFAULT_CONNECTIONS, cores // 2))


def start_zero_copy_collector() -> None:
    """Make pyzmq's zero-copy bookkeeping ready on this thread, before lanes send at once.

    libzmq reports a zero-copy frame done through a PUSH socket (and a mutex) that pyzmq
    creates on the first zero-copy send of the process, without a lock. Two lanes' first sends
    at once could each create one: frames bound to the socket dropped never report done, so
    their trackers never finish (seen on 16 cores: the first puts over 4 connections of a
    fresh process waited forever for some of their frames). A tracked frame made here
    creates both once.
    """
    zmq.Frame(bytes(1), copy=False, track=True)


def deal(requests: Sequence[T], lanes: int,
         size: Callable[[T], int] = lambda _: 1) -> list[list[T]]:
    """Each request in turn goes to the lane with the fewest blocks (`size`) so far, the first
    of them on a tie: requests of one size go k to lane k % lanes, so consecutive requests run
    at once on different lanes and a job's blocks arrive roughly in order."""
    shares: list[list[T]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for request in requests:
        lane = loads.index(min(loads))
        shares[lane].append(request)
        loads[lane] += size(request)
    return shares


def spread_batch(blocks: int, batch_blocks: int, lanes: int) -> int:
    """Blocks per request for a job of `blocks`: at most `batch_blocks`, and few enough that
    every lane gets a request when the job is small."""
    return max(1, min(batch_blocks, -(-blocks // lanes)))


class Lane:
    """One thread's connections, one to each of the store's workers (index = worker), on one
    IO thread; `window` requests in flight over them in all."""

    def __init__(self, connections: list[Connection], window: int) -> None:
        self.connections = connections
        self.window = window

    def exchange(self, requests: Sequence[Exchange], complete: Complete,
                 timeout_s: float) -> None:
        """Send each request on its worker's connection, at most `window` unanswered;
        `complete` takes each reply and reads its block frames; a request without a usable
        reply gets `error` set (those of a failed connection only, which reconnects)."""
        queue: deque[Exchange] = deque(requests)
        pending: list[dict[int, Exchange]] = [{} for _ in self.connections]  # per connection
        connect_by = time.monotonic() + timeout_s  # waits for a connection: one timeout in all
        for connection in self.connections:
            connection.prepare()
        poller, sockets = self._poller()
        try:
            while queue or any(pending):
                while queue and sum(map(len, pending)) < self.window:
                    request = queue.popleft()
                    pending[request.shard][request.request_id] = request
                    request.deadline = time.monotonic() + timeout_s
                    try:
                        self.connections[request.shard].send(request, connect_by=connect_by)
                    except StoreError as exc:
                        self._fail(request.shard, str(exc), pending, queue)
                        poller, sockets = self._poller()
                if any(pending) and self._serve(poller, sockets, pending, queue, complete):
                    poller, sockets = self._poller()  # a connection was replaced
        except BaseException:
            for connection in self.connections:  # never leave a half-read message behind
                connection.reconnect()
            raise

    def _serve(self, poller: zmq.Poller, sockets: dict[Any, tuple[int, bool]],
               pending: list[dict[int, Exchange]], queue: deque[Exchange],
               complete: Complete) -> bool:
        """Wait for replies until the nearest deadline and read those that came; True if a
        connection failed (and was replaced)."""
        deadline = min(r.deadline for share in pending for r in share.values())
        timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
        failed: set[int] = set()
        for sock, _ in poller.poll(timeout_ms):
            shard, is_monitor = sockets[sock]
            connection = self.connections[shard]
            if shard in failed:  # its socket was replaced: nothing to read from the new one
                continue
            try:
                if is_monitor:
                    connection.read_monitor(raise_failures=True)
                else:
                    connection.receive_reply(pending[shard], complete)
            except StoreError as exc:
                self._fail(shard, str(exc), pending, queue)
                failed.add(shard)
        now = time.monotonic()
        for shard, share in enumerate(pending):
            if any(request.deadline <= now for request in share.values()):
                self._fail(shard, f"no reply from the store at {self.connections[shard].url} "
                                  f"within the timeout", pending, queue)
                failed.add(shard)
        return bool(failed)

    def _fail(self, shard: int, error: str, pending: list[dict[int, Exchange]],
              queue: deque[Exchange]) -> None:
        """Connection `shard` failed: its requests (sent or not) get `error`; it reconnects.
        Once its old socket is destroyed, the sent requests' frames are no longer lent to zmq
        (their trackers are dropped), so their pool slots are not left pinned."""
        sent = list(pending[shard].values())
        for request in sent:
            request.error = error
        pending[shard].clear()
        for request in [r for r in queue if r.shard == shard]:
            request.error = error
            queue.remove(request)
        if self.connections[shard].reconnect():
            for request in sent:
                request.trackers.clear()

    def _poller(self) -> tuple[zmq.Poller, dict[Any, tuple[int, bool]]]:
        poller, sockets = zmq.Poller(), {}
        for shard, connection in enumerate(self.connections):
            for sock, is_monitor in ((connection.socket, False), (connection.monitor, True)):
                poller.register(sock, _POLLIN)
                sockets[sock] = (shard, is_monitor)
        return poller, sockets


class Lanes:
    """`count` lanes, each with a connection to every one of a store's workers (`urls`,
    worker 0 first) on its own zmq IO thread; the lanes of one client, used by one call at a
    time."""

    def __init__(self, urls: Sequence[str], security: Security, *, count: int,
                 max_frame_bytes: int, max_in_flight: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"connections must be an int >= 1, got {count!r}")
        start_zero_copy_collector()
        self.urls = list(urls)
        self._context = zmq.Context(io_threads=count)
        self._threads: ThreadPoolExecutor | None = None
        self.lanes: list[Lane] = []
        try:
            for lane in range(count):
                self.lanes.append(Lane([], max_in_flight))
                for url in self.urls:
                    self.lanes[-1].connections.append(Connection(
                        url, security, context=self._context, io_thread=lane,
                        max_frame_bytes=max_frame_bytes))
        except BaseException:
            self.close()
            raise
        # the calling thread runs lane 0; the others run here
        self._threads = (ThreadPoolExecutor(count - 1, thread_name_prefix="kvconnector-lane")
                         if count > 1 else None)

    def __len__(self) -> int:
        return len(self.lanes)

    def lost(self) -> bool:
        """Whether the store dropped a connection of the first lane and it is not back (every
        lane connects to every worker, so one lane tells)."""
        for connection in self.lanes[0].connections:
            connection.read_monitor(raise_failures=False)
        return any(connection.lost for connection in self.lanes[0].connections)

    def exchange(self, requests: Sequence[Exchange], complete: Complete,
                 timeout_s: float) -> None:
        """Run `requests` dealt over the lanes by their blocks (see Lane.exchange); returns
        when every lane is done, so no lane reads or writes a pool slot after the call."""
        shares = deal(requests, len(self.lanes), lambda request: len(request.indices) or 1)
        running: list[Future[None]] = [
            self._threads.submit(lane.exchange, share, complete, timeout_s)
            for lane, share in zip(self.lanes[1:], shares[1:], strict=True) if share]
        try:
            if shares[0]:
                self.lanes[0].exchange(shares[0], complete, timeout_s)
        finally:
            wait(running)
        for lane in running:
            lane.result()  # a lane's bug raises here, as it would on one connection

    def close(self) -> None:
        """Close every connection; frames not yet sent are dropped."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        for lane in self.lanes:
            for connection in lane.connections:
                connection.close()
        self._context.destroy(linger=0)
