"""A store of several worker processes: `kvconnector store serve --workers N`.

One process serves its requests on one Python thread (the GIL), and with many connections that
thread was the limit, not the network (docs/benchmarks.md, "Several workers"). So the store can
run N processes, each a whole StoreServer for the keys that hash to it
(transfer.remote.store.shards): its own index, a 1/N share of the capacity and of the IO and
verifier threads, its own port and admission limits, with the whole buffer budget each (one
connection alone may hold four of the largest requests: a share of the budget dropped
well-behaved clients' connections, seen with 16 MiB puts over 8 workers), so what zmq holds in
all stays under N budgets. The first worker runs in this process on the store's address; the
others are spawned, listen on free ports of the same host and exit when this process does
(also when it is killed: each watches a pipe from it); and this process stops the store
when a worker ends on its own (`StoreWorkers.watch`), since that worker's keys are gone. The
first worker's `ping` reply names every worker's port; clients send each key straight to its
worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from transfer.remote.store.admission import (
    DEFAULT_MAX_PEERS,
    STALL_TIMEOUT_S,
    PeerGuard,
    buffer_budget,
)
from transfer.remote.store.protocol import Limits
from transfer.remote.store.puts import DEFAULT_VERIFY_THREADS
from transfer.remote.store.security import Security, tcp_host
from transfer.remote.store.server import DEFAULT_IO_THREADS, StoreServer

log = logging.getLogger(__name__)



def default_workers(cores: int | None = None) -> int:
    """Worker processes for `cores` cores (default: this machine's): half of them, at most 8;
    one on 2 cores or fewer. On 16 cores four clients' puts over 8 connections each moved
    0.91 of the raw streams with 8 workers, 0.72 with 4, 0.75 with one (docs/benchmarks.md)."""
    cores = cores or os.cpu_count() or 1
    return 1 if cores <= 2 else min(8, cores // 2)


DEFAULT_WORKERS = default_workers()
START_TIMEOUT_S = 120.0  # a spawned worker imports zmq, msgpack, xxhash: slow on a busy machine
STOP_TIMEOUT_S = 10.0
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class WorkerSettings:
    """One worker's StoreServer arguments (picklable: spawned workers get them)."""

    listen: str
    capacity_bytes: int
    security: Security
    limits: Limits
    buffer_budget_bytes: int
    io_threads: int
    verify_threads: int
    shard: tuple[int, int]
    max_peers: int | None = None  # connections each worker keeps (None: DEFAULT_MAX_PEERS)
    stall_timeout_s: float = STALL_TIMEOUT_S

    def server(self) -> StoreServer:
        return StoreServer(self.listen, self.capacity_bytes, self.security, limits=self.limits,
                           buffer_budget_bytes=self.buffer_budget_bytes,
                           io_threads=self.io_threads, verify_threads=self.verify_threads,
                           shard=self.shard, max_peers=self.max_peers,
                           stall_timeout_s=self.stall_timeout_s)


def worker_settings(listen: str, capacity_bytes: int, security: Security, *, workers: int,
                    limits: Limits | None = None, buffer_budget_bytes: int | None = None,
                    io_threads: int = DEFAULT_IO_THREADS,
                    verify_threads: int = DEFAULT_VERIFY_THREADS, max_peers: int | None = None,
                    stall_timeout_s: float = STALL_TIMEOUT_S) -> list[WorkerSettings]:
    """Each worker's settings: the capacity, IO and verifier threads split `workers` ways, the
    buffer budget, connection limit and stall timeout each its own; ValueError naming a bad
    value."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not isinstance(capacity_bytes, int) or capacity_bytes < workers:
        raise ValueError(f"capacity must be at least one byte per worker ({workers}), got "
                         f"{capacity_bytes!r}")
    limits = limits or Limits()
    budget = buffer_budget(limits, buffer_budget_bytes)
    PeerGuard(budget, max_peers=DEFAULT_MAX_PEERS if max_peers is None else max_peers,
              stall_timeout_s=stall_timeout_s)  # ValueError for a bad one, before any worker
    first = WorkerSettings(listen, capacity_bytes // workers, security, limits,
                           budget,
                           max(1, io_threads // workers), verify_threads // workers, (0, workers),
                           max_peers, stall_timeout_s)
    # the others listen on free ports of the same host: a restarted store never waits for an
    # old worker to let go of a fixed one
    host = tcp_host(listen)
    others = f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"
    return [first, *(replace(first, listen=others, shard=(index, workers))
                     for index in range(1, workers))]


class StoreWorkers:
    """Workers 1..N-1 of a store, each in a spawned process (worker 0 is the caller's)."""

    def __init__(self, settings: list[WorkerSettings]) -> None:
        self._settings = settings
        self._context = mp.get_context("spawn")  # never fork a process that runs zmq threads
        self._processes: list[Any] = []
        self._pipes: list[Any] = []
        self._stopping = threading.Event()

    def start(self) -> list[int]:
        """Start the workers; their ports, once every one listens (RuntimeError if one fails)."""
        try:
            for settings in self._settings:
                parent, child = self._context.Pipe()
                process = self._context.Process(target=_run_worker, args=(settings, child),
                                                name=f"kvconnector-store-{settings.shard[0]}",
                                                daemon=True)
                process.start()
                child.close()
                self._processes.append(process)
                self._pipes.append(parent)
            ports = []
            for settings, pipe in zip(self._settings, self._pipes, strict=True):
                if not pipe.poll(START_TIMEOUT_S):
                    raise RuntimeError(f"store worker {settings.shard[0]} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s")
                kind, value = pipe.recv()
                if kind != "listening":
                    raise RuntimeError(f"store worker {settings.shard[0]} failed: {value}")
                ports.append(int(value.rsplit(":", 1)[1]))
            return ports
        except BaseException:
            self.stop()
            raise

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(why)` from a thread if a worker ends before `stop()`: its share of the
        keys is gone, so the store should end too rather than serve without it."""
        processes = list(self._processes)

        def wait_for_one() -> None:
            ended = mp_connection.wait([process.sentinel for process in processes])
            if self._stopping.is_set():
                return
            process = next(p for p in processes if p.sentinel in ended)
            process.join()
            on_exit(f"store worker {process.name} ended (exit code {process.exitcode})")

        if processes:
            threading.Thread(target=wait_for_one, name="kvconnector-store-workers",
                             daemon=True).start()

    def stop(self) -> None:
        """Stop every worker (SIGKILL one that lingers) and wait for them."""
        self._stopping.set()
        for pipe in self._pipes:
            pipe.close()  # the worker's watcher sees the end of the pipe
        for process in self._processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
        self._processes, self._pipes = [], []


def _run_worker(settings: WorkerSettings, pipe: Any) -> None:
    """A spawned worker: serve until the parent closes the pipe or goes away."""
    # Ctrl-C, or a stop signal to the whole process group: the parent stops the workers (so a
    # worker that ends on its own is always a failure to the parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    try:
        server = settings.server()
        endpoint = server.bind()
    except Exception as exc:  # the parent reports it and stops the others
        pipe.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("listening", endpoint))
    threading.Thread(target=_watch_parent, args=(pipe, server), daemon=True).start()
    server.serve_forever()


def _watch_parent(pipe: Any, server: StoreServer) -> None:
    with suppress(EOFError, OSError):
        pipe.recv()
    server.stop()
