"""Attacking the pool daemon from other processes, and what a legitimate client checks meanwhile.

`TunedPool`: a daemon process with PoolLimits of the test's choosing (`kvconnector pool serve`
serves the defaults; tests of deadlines shorten them). `Attacker`: a forked process running an
attack, driven through a pipe. `Raw`: one connection speaking (or abusing) the protocol by
hand. `Legit`: an engine's store and load through the segment, checked byte for byte (an
attacker that is handed a slot writes junk into it, so a slot handed out twice shows).
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack

from kvconnector.servers.pool import PoolProcess
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.shared import protocol
from transfer.shared.client import PoolClient

NS = Namespace(model="attacker", dtype="bf16", block_size=4, block_layout="x")
LEGIT_NS = Namespace(model="legit", dtype="bf16", block_size=4, block_layout="x")
TIMEOUT_S = 60.0  # any wait on the daemon or a child: generous, a busy machine is slow
_FORK = mp.get_context("fork")  # attackers need sockets only: no imports, no start-up time
_TUNED_MAIN = """
import json, sys
from kvconnector.cli.serving import log_to_stderr, stop_on_signals
from transfer.shared.daemon import PoolDaemon, PoolLimits
log_to_stderr()
name, capacity, slot_bytes, limits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
daemon = PoolDaemon(name, capacity, slot_bytes, limits=PoolLimits(**json.loads(limits)))
stop_on_signals(daemon.stop)
print(f"tuned pool {name}: serving at {daemon.path}", flush=True)
daemon.serve_forever()
"""


class TunedPool(PoolProcess):
    """A pool daemon process with the given PoolLimits fields (sizes in bytes)."""

    def __init__(self, log_path: str | Path, name: str, capacity: int = 16 << 20,
                 slot_bytes: int = 64 << 10, **limits: Any) -> None:
        super().__init__(log_path, name)
        self.tuned_args = [name, str(capacity), str(slot_bytes), json.dumps(limits)]

    def command(self) -> list[str]:
        return [sys.executable, "-c", _TUNED_MAIN, *self.tuned_args]


class Attacker:
    """`target(conn, *args)` in a forked process; `ask` sends it a command, `answer` waits."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_end = _FORK.Pipe()
        self.process = _FORK.Process(target=_run, args=(target, child_end, *args), daemon=True)
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def ask(self, message: Any) -> Any:
        self.conn.send(message)
        return self.answer()

    def answer(self) -> Any:
        assert self.conn.poll(TIMEOUT_S), "the attacker did not answer"
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def kill(self) -> None:
        """SIGKILL: its connections close with no goodbye."""
        self.process.kill()
        self.process.join(TIMEOUT_S)


def _run(target: Callable[..., None], conn: Connection, *args: Any) -> None:
    try:
        target(conn, *args)
    except BaseException as exc:  # the test sees it, not a silent child
        conn.send(RuntimeError(f"attacker {target.__name__}: {type(exc).__name__}: {exc}"))


class Raw:
    """One connection to the daemon at `path`, written and read by hand."""

    def __init__(self, path: Path | None, sock: socket.socket | None = None) -> None:
        """A new connection to `path`, or `sock` (connected)."""
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(TIMEOUT_S)
            sock.connect(str(path))
        self.sock = sock
        self.unpacker = msgpack.Unpacker()

    def send(self, data: bytes) -> bool:
        """Send raw bytes; False when the daemon has closed the connection."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def request(self, *message: Any) -> bool:
        return self.send(msgpack.packb(list(message)))

    def answer(self, timeout_s: float = TIMEOUT_S) -> Any:
        """The next answer, or EOFError when the daemon closes the connection first."""
        self.sock.settimeout(timeout_s)
        while True:
            for answer in self.unpacker:
                return answer
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                data = b""
            if not data:
                raise EOFError("the daemon closed the connection")
            self.unpacker.feed(data)

    def hello(self, namespace: Namespace = NS, entry_bytes: int = 100) -> list[Any]:
        self.request(protocol.HELLO, [namespace.digest], entry_bytes)
        ok, answer = self.answer()
        assert ok, answer
        return answer

    def dropped(self, timeout_s: float = TIMEOUT_S) -> bool:
        """Reads (and drops) whatever comes until the daemon closes the connection: True, or
        False when it stays open for `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.answer(max(0.01, deadline - time.monotonic()))
            except EOFError:
                return True
            except TimeoutError:
                return False
        return False

    def close(self) -> None:
        self.sock.close()


class Legit:
    """A well-behaved engine of its own namespace: stores blocks of random bytes through the
    segment, loads them back and checks every byte and checksum."""

    def __init__(self, name: str, tag: str = "legit") -> None:
        self.client = PoolClient(name, [LEGIT_NS], 100)
        self.info = self.client.info
        self.tag = tag
        self.segment = Segment(self.info.segment, self.info.slot_bytes)
        self.rounds = 0
        self.blocks = 0
        self.corrupt_next = False  # a control: the next round trip's first slot is changed

    def round_trip(self, count: int = 4, allow_evicted: bool = False) -> int:
        """Store `count` blocks and load them back, byte-exact: how many. With
        `allow_evicted`, blocks evicted by others' stores before the load are not an error
        (none load)."""
        self.rounds += 1
        rng = random.Random(f"{self.tag}-{self.rounds}")
        keys = LEGIT_NS.keys([f"{self.tag}-{self.rounds}-{i}".encode() for i in range(count)])
        placed, slots = self.client.request(protocol.PREPARE_STORES, [keys])[0][:2]
        written = [rng.randbytes(self.info.slot_bytes) for _ in placed]
        for slot, data in zip(slots, written, strict=True):
            self.segment.write(slot, data)
        sums = [[block_checksum(data, key)] for data, key in zip(written, placed, strict=True)]
        self.client.notify(protocol.COMPLETE_STORE, placed, [True] * len(placed), sums)
        if not placed:
            return 0
        if self.corrupt_next:
            self.corrupt_next = False
            self.segment.write(slots[0], bytes([self.segment.read(slots[0])[0] ^ 1]))
        answer = self.client.request(protocol.PREPARE_LOAD, placed)
        if answer is None:
            assert allow_evicted, "a block stored a moment ago is gone"
            return 0
        load_slots, load_sums = answer
        assert load_slots == slots and load_sums == sums
        for slot, data in zip(load_slots, written, strict=True):
            assert self.segment.read(slot) == data, f"slot {slot}: other bytes than stored"
        self.client.notify(protocol.COMPLETE_LOAD, placed)
        self.client.notify(protocol.DISCARD, placed)  # its slots free again
        self.blocks += len(placed)
        return len(placed)

    def stats(self) -> dict[str, Any]:
        return self.client.request(protocol.STATS)

    def every_slot_usable(self) -> None:
        """Every slot of the pool can be stored into now (none left held by anyone)."""
        stats = self.stats()
        assert stats["busy_slots"] == 0 and stats["storing"] == stats["pinned"] == 0, stats
        keys = LEGIT_NS.keys([f"fill-{self.rounds}-{i}".encode()
                              for i in range(self.info.num_slots)])
        self.rounds += 1
        placed = self.client.request(protocol.PREPARE_STORES, [keys])[0][0]
        assert len(placed) == self.info.num_slots, (len(placed), self.info.num_slots)
        self.client.notify(protocol.COMPLETE_STORE, placed, [False] * len(placed),
                           [None] * len(placed))
        assert self.stats()["busy_slots"] == 0

    def close(self) -> None:
        self.segment.close()
        self.client.close()


class Segment:
    """The daemon's segment, mapped: slot i's bytes (its header page first)."""

    def __init__(self, segment: str, slot_bytes: int) -> None:
        from kvconnector.layout.descriptor import HOST_ALIGNMENT

        fd = os.open(f"/dev/shm/{segment}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.header = HOST_ALIGNMENT
        self.slot_bytes = slot_bytes

    def write(self, slot: int, data: bytes) -> None:
        start = self.header + slot * self.slot_bytes
        self.map[start:start + len(data)] = data

    def read(self, slot: int) -> bytes:
        start = self.header + slot * self.slot_bytes
        return self.map[start:start + self.slot_bytes]

    def close(self) -> None:
        self.map.close()


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh at the current RSS (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    """Poll `condition` until it is truthy (its value), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def nested(depth: int, leaf: bytes = b"\xc0") -> bytes:
    """msgpack arrays nested `depth` deep around `leaf` (packb refuses over 511)."""
    return b"\x91" * depth + leaf


def frame(verb: str, *raw_args: bytes) -> bytes:
    """A request whose arguments are given as msgpack bytes."""
    return bytes([0x90 + 1 + len(raw_args)]) + msgpack.packb(verb) + b"".join(raw_args)
