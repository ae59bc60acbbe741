"""The store's same-run baseline: raw pyzmq streams, the store's transport without its protocol.

`kvconnector bench` and benchmarks/bench_remote.py hold the store against it:
- `RawStreams` is a client with the store client's connections (a lane thread and a zmq IO
  thread each), request sizes, dealing and window per connection, sending the same zero-copy
  frames after a one-word header instead of a msgpack one: no checksums, no index;
- `RawServer` is a ROUTER with the store's security and IO threads that keeps the newest
  `capacity` bytes of put frames (its memory churns like the store's) and answers a get of n
  blocks with the next n of them in turn, zero-copy and tracked as the store sends; in a
  thread where the store is in-process (`kvconnector bench`), or in a process of its own
  (`RawServerProcess`, `python -m kvconnector.servers.baseline`) where the store is one.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import zmq

from kvconnector.servers.child import ChildServer
from transfer.remote.store.heap import keep_received_memory
from transfer.remote.store.lanes import deal, spread_batch, start_zero_copy_collector
from transfer.remote.store.security import Security, SecurityMode

_SNDMORE = int(zmq.SNDMORE)
MAX_GET_BLOCKS = 4096  # as the store's limit of keys per request


class RawStreams:
    """`connections` DEALERs moving pool rows like the store client's lanes, minus the
    protocol. put/get raise RuntimeError if a frame is lost or of the wrong size."""

    def __init__(self, url: str, security: Security, rows: np.ndarray, *, connections: int,
                 put_batch_blocks: int, get_batch_blocks: int, max_in_flight: int,
                 timeout_s: float) -> None:
        self.rows = rows
        self._put_batch, self._get_batch = put_batch_blocks, get_batch_blocks
        self._window = max_in_flight
        keep_received_memory()  # as the store client does
        start_zero_copy_collector()
        self._context = zmq.Context(io_threads=connections)
        self._sockets = []
        for lane in range(connections):
            sock = self._context.socket(zmq.DEALER)
            sock.linger = 0
            sock.affinity = 1 << lane  # an IO thread of its own, as the store client's lanes
            sock.rcvtimeo = sock.sndtimeo = int(timeout_s * 1000)  # never hang on a lost peer
            security.apply_client(sock, url)
            sock.connect(url)
            self._sockets.append(sock)
        self._threads = ThreadPoolExecutor(connections, thread_name_prefix="raw-lane")

    def put(self, slots: list[int]) -> None:
        self._run(self._put_lane, slots, self._put_batch)

    def get(self, slots: list[int]) -> None:
        self._run(self._get_lane, slots, self._get_batch)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._context.destroy(linger=0)

    def _run(self, lane: Callable[[zmq.Socket, list[list[int]]], None], slots: list[int],
             batch_blocks: int) -> None:
        step = spread_batch(len(slots), batch_blocks, len(self._sockets))
        batches = [slots[start:start + step] for start in range(0, len(slots), step)]
        running = [self._threads.submit(lane, sock, share)
                   for sock, share in zip(self._sockets, deal(batches, len(self._sockets)),
                                          strict=True) if share]
        wait(running)
        for done in running:
            done.result()

    def _put_lane(self, sock: zmq.Socket, batches: list[list[int]]) -> None:
        trackers, in_flight = [], 0
        for batch in batches:
            if in_flight == self._window:
                sock.recv()
                in_flight -= 1
            sock.send(b"put", _SNDMORE)
            for i, slot in enumerate(batch):
                more = _SNDMORE if i < len(batch) - 1 else 0
                trackers.append(sock.send(self.rows[slot], more, copy=False, track=True))
            in_flight += 1
        for _ in range(in_flight):
            sock.recv()
        for tracker in trackers:
            tracker.wait()

    def _get_lane(self, sock: zmq.Socket, batches: list[list[int]]) -> None:
        pending: deque[list[int]] = deque()
        for batch in batches:
            if len(pending) == self._window:
                self._receive(sock, pending.popleft())
            sock.send(b"get:%d" % len(batch))
            pending.append(batch)
        while pending:
            self._receive(sock, pending.popleft())

    def _receive(self, sock: zmq.Socket, batch: list[int]) -> None:
        sock.recv()
        for slot in batch:
            row = self.rows[slot]
            if sock.recv_into(row) != row.nbytes:
                raise RuntimeError("a raw baseline frame of the wrong size")


class RawServer:
    """The baseline ROUTER: in a thread of this process (`start`, `stop`; as an in-process
    store runs) or in the foreground until killed (`serve_forever`, the child process)."""

    def __init__(self, security: Security, capacity: int, io_threads: int,
                 listen: str = "tcp://127.0.0.1:*") -> None:
        keep_received_memory()  # as the store does
        self._context = zmq.Context(io_threads=io_threads)
        self._router = self._context.socket(zmq.ROUTER)
        self._auth = security.apply_server(self._context, self._router, listen)
        self._router.router_mandatory = 1  # a send waits for room instead of dropping frames
        self._router.linger = 0
        self._router.bind(listen)
        self.url = self._router.last_endpoint.decode()
        self._capacity = capacity
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        self._thread = threading.Thread(target=self.serve_forever, name="raw-baseline",
                                        daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.destroy(linger=0)

    def serve_forever(self) -> None:
        router, held, held_bytes = self._router, deque(), 0
        turn = 0  # gets take the frames held in turn, so a job's lanes get distinct ones
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            identity, op, *blocks = router.recv_multipart(copy=False)
            if op.bytes == b"put":
                held.extend(blocks)
                held_bytes += sum(len(block) for block in blocks)
                while held_bytes > self._capacity and len(held) > 1:
                    held_bytes -= len(held.popleft())
                router.send_multipart([identity, b"ok"])
            else:  # b"get:<count>"
                count = _get_count(op.bytes)
                if count is None or not held:  # anything else on its port: refused, not fatal
                    router.send_multipart([identity, b"error"])
                    continue
                router.send_multipart([identity, b"ok"], _SNDMORE)
                for i in range(count):  # like the store: zero-copy frames, tracked
                    router.send(held[(turn + i) % len(held)].buffer,
                                _SNDMORE if i < count - 1 else 0, copy=False, track=True)
                turn = (turn + count) % len(held)


def _get_count(op: bytes) -> int | None:
    """n of a `get:<n>` request (1..MAX_GET_BLOCKS), or None for anything else."""
    digits = op[4:]
    if not (op.startswith(b"get:") and digits.isdigit() and len(digits) <= 6):
        return None
    count = int(digits)
    return count if 0 < count <= MAX_GET_BLOCKS else None


class RawServerProcess(ChildServer):
    """The baseline server in a child process; `url` once started. Puts must precede gets."""

    label = "raw baseline server"
    ready_line = re.compile(r"^listening on (\S+)")
    start_timeout_s = 30.0

    def __init__(self, security: Security, capacity: int, io_threads: int,
                 listen: str = "tcp://127.0.0.1:*") -> None:
        super().__init__(None)  # its few lines go to this process's output
        self.args = ["--listen", listen, "--capacity", str(capacity), "--io-threads",
                     str(io_threads), *security_args(security)]
        self.url: str | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvconnector.servers.baseline", *self.args]

    def start(self) -> str:
        match = super().start()
        assert match is not None  # a ready line was asked for
        self.url = match.group(1)
        return self.url


def security_args(security: Security) -> list[str]:
    """The server-side flags of `kvconnector store serve` (and of this module) for `security`."""
    args = ["--security", security.mode.value]
    if security.mode is SecurityMode.SECRET:
        args += ["--secret-file", str(security.secret_file)]
    elif security.mode is SecurityMode.CURVE:
        args += ["--curve-key-pair", str(security.curve_key_pair), "--curve-clients",
                 str(security.curve_clients_dir)]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvconnector.servers.baseline",
                                     description="the raw pyzmq baseline server")
    parser.add_argument("--listen", default="tcp://127.0.0.1:*")
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--io-threads", type=int, required=True)
    parser.add_argument("--security", choices=[m.value for m in SecurityMode], required=True)
    parser.add_argument("--secret-file", type=Path)
    parser.add_argument("--curve-key-pair", type=Path)
    parser.add_argument("--curve-clients", type=Path)
    args = parser.parse_args(argv)
    mode = SecurityMode(args.security)
    if mode is SecurityMode.NONE:
        security = Security.none()
    elif mode is SecurityMode.SECRET:
        security = Security.shared_secret(args.secret_file)
    else:
        security = Security.curve_server(args.curve_key_pair, args.curve_clients)
    server = RawServer(security, args.capacity, args.io_threads, args.listen)
    print(f"listening on {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
