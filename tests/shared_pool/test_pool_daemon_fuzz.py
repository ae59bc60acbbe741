"""A time-bounded fuzz of the pool daemon: processes throwing random bytes, truncated and deep
msgpack, wrong types, huge frames, hundreds of connections, half frames, answers left unread,
protocol abuse by well-formed clients (a second hello, keys twice, commits of keys never begun
or by slots not theirs, others' pins released, junk written into the slots they are given) and
clients SIGKILLed midway, while a legitimate client stores and loads. Afterwards the daemon is
alive and prompt, every slot is usable and a round trip is byte-exact; its memory stayed under a
stated bound.

KVCONNECTOR_POOL_FUZZ_S sets the attack's length (default 12 s, for CI); the figures are printed
(pytest -s).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import struct
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pool_attackers import (
    NS,
    Attacker,
    Legit,
    Segment,
    TunedPool,
    memory_kib,
    nested,
    reset_peak,
    wait_for,
)

from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError

FUZZ_S = float(os.environ.get("KVCONNECTOR_POOL_FUZZ_S", "12"))
WORKERS = 3
FUZZ_BOUND_MIB = 512  # peak RSS over idle: parked input, unread answers, one request unpacked
OTHER_NS = NS.__class__(model="attacker-2", dtype="bf16", block_size=4, block_layout="x")
HELD_MAX = 60  # connections a worker leaves open between attacks
MAX_CLIENTS = 400  # the daemon's cap: the attackers' bursts of connections reach it
SOCKET_TIMEOUT_S = 2.0


class Worker:
    """One attacker process's state: what it holds open and what it counts."""

    def __init__(self, path: Path, name: str, seed: int) -> None:
        self.path = path
        self.name = name
        self.rng = random.Random(seed)
        self.held: list[socket.socket] = []
        self.messages = 0
        self.connections = 0
        self.kills = 0

    def connect(self, hello: bool = False) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            return None
        self.connections += 1
        if hello:
            namespaces = self.rng.choice([[NS.digest], [OTHER_NS.digest], [NS.digest] * 3])
            self.send(sock, msgpack.packb([protocol.HELLO, namespaces, 100]))
        return sock

    def send(self, sock: socket.socket, data: bytes) -> bool:
        self.messages += 1
        try:
            sock.sendall(data)
        except OSError:
            return False
        return True

    def leave(self, sock: socket.socket) -> None:
        """Close it, or keep it open (a later attack closes it)."""
        if self.rng.random() < 0.5:
            self.held.append(sock)
        else:
            sock.close()
        while len(self.held) > HELD_MAX:
            self.held.pop(self.rng.randrange(len(self.held))).close()

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held.clear()

    # ---- the attacks ----------------------------------------------------------------------

    def random_bytes(self) -> None:
        if sock := self.connect(hello=self.rng.random() < 0.5):
            self.send(sock, self.rng.randbytes(self.rng.randint(1, 64 << 10)))
            self.leave(sock)

    def truncated(self) -> None:
        if sock := self.connect(hello=True):
            whole = msgpack.packb(self.request())
            self.send(sock, whole[:self.rng.randrange(len(whole))])
            self.leave(sock)

    def deep(self) -> None:
        if sock := self.connect(hello=self.rng.random() < 0.7):
            depth = self.rng.choice([4, 100, 1000, 1023, 1025, 3000])
            body = nested(depth, msgpack.packb(NS.key(b"deep")))
            self.send(sock, self.rng.choice([body, b"\x92\xa6lookup" + body]))
            self.leave(sock)

    def wrong_types(self) -> None:
        if sock := self.connect(hello=True):
            for _ in range(self.rng.randint(1, 20)):
                verb = self.rng.choice([*protocol.ARGUMENTS, "nope", "", "x" * 70])
                args = [self.junk() for _ in range(self.rng.randint(0, 4))]
                if not self.send(sock, msgpack.packb([verb, *args])):
                    break
            self.leave(sock)

    def huge(self) -> None:
        if sock := self.connect(hello=self.rng.random() < 0.7):
            header = self.rng.choice([b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                                      b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                                      b"\x92\xa6lookup\x91\xc6" + (9 << 20).to_bytes(4, "big")])
            self.send(sock, header)
            self.send(sock, b"\x00" * self.rng.choice([1 << 10, 1 << 20, 9 << 20]))
            self.leave(sock)

    def many_connections(self) -> None:
        opened = [s for _ in range(self.rng.randint(100, 250))
                  if (s := self.connect(hello=self.rng.random() < 0.3))]
        time.sleep(self.rng.uniform(0.0, 0.5))  # held a while (an attack, not a sync)
        for sock in opened:
            sock.close()

    def half_frames(self) -> None:
        for _ in range(self.rng.randint(1, 10)):
            if sock := self.connect(hello=True):
                whole = msgpack.packb(self.request())
                self.send(sock, whole[:max(1, len(whole) // 2)])
                self.leave(sock)

    def never_read(self) -> None:
        if sock := self.connect(hello=True):
            keys = self.keys(self.rng.randint(1, 40))
            for _ in range(self.rng.randint(1, 30)):
                verb = self.rng.choice([protocol.CHECKSUMS, protocol.STATS,
                                        protocol.PREPARE_STORES])
                args = [[keys]] if verb == protocol.PREPARE_STORES else \
                    [] if verb == protocol.STATS else [keys * 500]
                if not self.send(sock, msgpack.packb([verb, *args])):
                    break
            self.leave(sock)

    def abuse(self) -> None:
        """A well-formed client breaking the protocol's rules (and writing junk into the
        slots it is given)."""
        try:
            client = PoolClient(self.name, [self.rng.choice([NS, OTHER_NS])], 100, timeout_s=5)
        except PoolError:
            return
        self.connections += 1
        segment = Segment(client.info.segment, client.info.slot_bytes)
        try:
            for _ in range(self.rng.randint(1, 15)):
                self.messages += 1
                self.abuse_once(client, segment)
        except (PoolError, ValueError, TypeError, IndexError):
            pass
        finally:
            segment.close()
            client.close()

    def abuse_once(self, client: PoolClient, segment: Segment) -> None:
        rng = self.rng
        keys = self.keys(rng.randint(1, 300))
        move = rng.randrange(10)
        if move == 0:
            client.request(protocol.HELLO, [NS.digest], 100)
        elif move == 1:
            client.request(protocol.PREPARE_STORES, [keys + keys[:1]])
        elif move in (2, 3):
            placed, slots = client.request(protocol.PREPARE_STORES, [keys])[0][:2]
            for slot in slots:
                segment.write(slot, rng.randbytes(64))  # junk where it may write
            flags = [rng.random() < 0.8 for _ in placed]
            sums = [[rng.getrandbits(64)] if ok else None for ok in flags]
            if move == 3 and placed:
                flags, sums = flags + flags[:1], sums + sums[:1]
                placed = placed + placed[:1]  # a key twice
            client.notify(protocol.COMPLETE_STORE, placed, flags, sums)
        elif move == 4:
            client.notify(protocol.COMPLETE_STORE, keys, [True] * len(keys),
                          [[1]] * len(keys))  # never begun
        elif move == 5:
            answer = client.request(protocol.PREPARE_LOAD, keys[:rng.randint(1, 8)])
            if answer is not None and rng.random() < 0.5:
                client.notify(protocol.COMPLETE_LOAD, keys)
        elif move == 6:
            client.notify(protocol.COMPLETE_LOAD, keys)  # others' pins, or none
        elif move == 7:
            client.notify(rng.choice([protocol.DISCARD, protocol.CLEAR]),
                          *([keys] if rng.random() < 0.5 else []))
        elif move == 8:  # a commit by slots: its own; or with others', free ones, past the pool
            slots = client.request(protocol.PREPARE_STORES, [keys])[0][1]
            if rng.random() < 0.5:
                slots += [rng.randrange(rng.choice([1 << 8, 1 << 12, 1 << 32]))
                          for _ in range(rng.randint(1, 3))]
            ranks = rng.choice([1, 2])
            client.notify(protocol.COMMIT_ROW_SUMS, struct.pack(f"<{len(slots)}I", *slots),
                          rng.randbytes(8 * ranks * len(slots)), ranks)
        else:
            client.request(protocol.CHECKSUMS, keys * rng.randint(1, 50))

    def sigkill(self) -> None:
        """A client killed midway: holding stores and pins, mid-request."""
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                client = PoolClient(self.name, [NS], 100, timeout_s=5)
                keys = self.keys(self.rng.randint(1, 50))
                client.request(protocol.PREPARE_STORES, [keys])
                client.request(protocol.PREPARE_LOAD, keys[:3])
                if sock := self.connect(hello=True):
                    self.send(sock, b"\x92\xa6lookup\xdc\x00\x10")  # mid-request
                time.sleep(5)
            finally:
                os._exit(0)
        time.sleep(self.rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        self.connections += 1
        self.kills += 1

    # ---- values ---------------------------------------------------------------------------

    def keys(self, count: int) -> list[bytes]:
        namespace = self.rng.choice([NS, OTHER_NS])
        return namespace.keys([f"f{self.rng.randrange(2000)}".encode() for _ in range(count)])

    def request(self) -> list[Any]:
        verb = self.rng.choice(list(protocol.ARGUMENTS))
        return [verb, *[self.keys(self.rng.randint(1, 100))
                        for _ in range(protocol.ARGUMENTS[verb])]]

    def junk(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(11 if depth < 5 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice([0, -1, 1 << 63, -(1 << 63), (1 << 64) - 1, rng.getrandbits(40)])
        if kind == 3:
            return rng.random() * 1e300
        if kind == 4:
            return "s" * rng.choice([0, 1, 64, 65, 5000])
        if kind == 5:
            return rng.choice([b"", NS.digest, NS.key(b"j"), b"\x07" * rng.choice([17, 257])])
        if kind in (6, 7):
            return [self.junk(depth + 1) for _ in range(rng.randint(0, 6))]
        if kind == 8:
            return {"k": self.junk(depth + 1)}
        if kind == 9:
            return self.keys(rng.randint(1, 50))
        return [self.keys(3)] * rng.randint(1, 3)


ATTACKS = ["random_bytes", "truncated", "deep", "wrong_types", "huge", "many_connections",
           "half_frames", "never_read", "abuse", "abuse", "abuse", "sigkill"]


def fuzz_worker(conn: Connection, path: Path, name: str, seed: int, seconds: float) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    worker = Worker(path, name, seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        getattr(worker, worker.rng.choice(ATTACKS))()
    worker.close()
    conn.send((worker.messages, worker.connections, worker.kills))


def test_the_daemon_survives_a_fuzz(tmp_path: Path) -> None:
    name = f"z{uuid.uuid4().hex[:10]}"
    with TunedPool(tmp_path / "pool.log", name, max_clients=MAX_CLIENTS, reply_timeout_s=1.0,
                   partial_timeout_s=1.0, hello_timeout_s=1.0) as pool:
        assert pool.process is not None
        pid = pool.process.pid
        legit = Legit(pool.name)
        assert legit.round_trip() == 4
        idle = memory_kib(pid)["VmRSS"]
        reset_peak(pid)
        started = time.monotonic()
        workers = [Attacker(fuzz_worker, pool.path, pool.name, seed, FUZZ_S)
                   for seed in range(WORKERS)]
        loaded = 0
        while any(w.process.is_alive() and not w.conn.poll() for w in workers):
            # Others' stores may evict its blocks before it loads them; what loads is exact.
            loaded += legit.round_trip(allow_evicted=True)
        counts = [w.answer() for w in workers]
        for w in workers:
            w.process.join(30)
        attacked_s = time.monotonic() - started
        assert pool.process.poll() is None, "the daemon died"
        peak = memory_kib(pid)["VmHWM"]
        stats = wait_for(lambda: (s := legit.stats())["clients"] == 1 and s,
                         "the attackers' connections to go")
        ping_started = time.monotonic()
        legit.stats()
        ping_s = time.monotonic() - ping_started
        legit.every_slot_usable()
        assert legit.round_trip() == 4
        after = memory_kib(pid)["VmRSS"]
        messages, connections, kills = (sum(c[i] for c in counts) for i in range(3))
        print(f"\npool fuzz: {attacked_s:.1f} s, {WORKERS} attacker processes, {messages} "
              f"messages, {connections} connections ({kills} clients SIGKILLed), daemon dropped "
              f"{stats['dropped']} and refused {stats['refused_busy']}; legit client "
              f"{legit.rounds} round trips, {loaded} blocks loaded byte-exact; ping after "
              f"{ping_s * 1000:.1f} ms; daemon RSS idle {idle >> 10} MiB, peak "
              f"{peak >> 10} MiB, after {after >> 10} MiB")
        assert loaded > 0, "the legitimate client loaded nothing during the fuzz"
        assert ping_s < 10.0
        assert connections > 300 and messages > 500  # the fuzz ran
        assert peak - idle < FUZZ_BOUND_MIB << 10, f"peak RSS {peak} KiB, idle {idle} KiB"
        # The control: the legitimate client's check sees a byte changed under its block.
        legit.corrupt_next = True
        with pytest.raises(AssertionError, match="other bytes than stored"):
            legit.round_trip()
        legit.close()
