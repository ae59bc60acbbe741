"""Lanes: one client's connections to the store, and how a call's requests are spread over them.

One TCP stream moves what one core can copy through the kernel (3.3-4.4 GB/s on the 16-core
GPU machine, against 52-55 GB/s of host memory), so a client opens several connections. A lane is
one connection (transfer.remote.store.connection) run by one thread: a put or get deals its
requests round-robin over the lanes, each lane sends its share with its own window of requests
in flight, and the call returns once every lane has. zmq gives each connection an IO thread of
the client's own context, so the kernel copies (and CURVE's encryption, done on the IO threads)
run in parallel too; the lane threads checksum puts and receive gets (both release the GIL).

A store of several workers (transfer.remote.store.workers) gets lanes of its own per worker:
each request names its worker (`Exchange.shard`) and is dealt over that worker's lanes.

A lane's failure (timeout, lost connection) fails that lane's requests only: each connection
reconnects on its own, and a block's status depends only on its own request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import zmq

from transfer.remote.store.connection import Complete, Connection, Exchange
from transfer.remote.store.security import Security

MAX_DEFAULT_CONNECTIONS = 8
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


def deal(requests: Sequence[T], lanes: int) -> list[list[T]]:
    """Request k goes to lane k % lanes: consecutive requests run at once on different lanes,
    so a job's blocks arrive roughly in order."""
    return [list(requests[lane::lanes]) for lane in range(lanes)]


def spread_batch(blocks: int, batch_blocks: int, lanes: int) -> int:
    """Blocks per request for a job of `blocks`: at most `batch_blocks`, and few enough that
    every lane gets a request when the job is small."""
    return max(1, min(batch_blocks, -(-blocks // lanes)))


class Lanes:
    """`per_worker` connections to each of a store's workers (`urls`, worker 0 first), each on
    its own zmq IO thread; the lanes of one client, used by one call at a time."""

    def __init__(self, urls: Sequence[str], security: Security, *, per_worker: int,
                 max_frame_bytes: int, max_in_flight: int) -> None:
        if isinstance(per_worker, bool) or not isinstance(per_worker, int) or per_worker < 1:
            raise ValueError(f"connections must be an int >= 1, got {per_worker!r}")
        start_zero_copy_collector()
        self.urls = list(urls)
        self.per_worker = per_worker
        count = per_worker * len(self.urls)
        self._context = zmq.Context(io_threads=count)
        self._threads: ThreadPoolExecutor | None = None
        self.connections: list[Connection] = []
        try:
            for lane in range(count):
                self.connections.append(Connection(
                    self.urls[lane // per_worker], security, context=self._context,
                    io_thread=lane, max_frame_bytes=max_frame_bytes,
                    max_in_flight=max_in_flight))
        except BaseException:
            self.close()
            raise
        # the calling thread runs lane 0; the others run here
        self._threads = (ThreadPoolExecutor(count - 1, thread_name_prefix="kvconnector-lane")
                         if count > 1 else None)

    def __len__(self) -> int:
        return len(self.connections)

    def exchange(self, requests: Sequence[Exchange], complete: Complete,
                 timeout_s: float) -> None:
        """Run `requests` dealt over their workers' lanes (see Connection.exchange); returns
        when every lane is done, so no lane reads or writes a pool slot after the call."""
        shares = []
        for worker in range(len(self.urls)):
            shares += deal([r for r in requests if r.shard == worker], self.per_worker)
        running: list[Future[None]] = [
            self._threads.submit(connection.exchange, share, complete, timeout_s)
            for connection, share in zip(self.connections[1:], shares[1:], strict=True)
            if share]
        try:
            if shares[0]:
                self.connections[0].exchange(shares[0], complete, timeout_s)
        finally:
            wait(running)
        for lane in running:
            lane.result()  # a lane's bug raises here, as it would on one connection

    def close(self) -> None:
        """Close every connection; frames not yet sent are dropped."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        for connection in self.connections:
            connection.close()
        self._context.destroy(linger=0)
