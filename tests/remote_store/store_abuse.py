"""One attacker of a store, run as its own process by the fuzz run (test_remote_fuzz.py) and the
abuse tests (test_store_abuse.py):

    python store_abuse.py KIND URL SECONDS SEED [ARG]

It attacks until SIGTERM or SECONDS, then prints one JSON line: its kind, how long it attacked,
connections opened, how many the store hung up on (or refused), messages and bytes sent. The
store is expected to run with `--max-block-size 1MiB` (frames over 1 MiB + 4 KiB are over its
transport limit). Kinds:
- raw_bytes: TCP connections sending random bytes, a greeting cut short or a bogus mechanism
- garbage: random frames over ZMTP, single and multipart
- msgpack: headers cut short, nested up to 2,000 deep, fields of the wrong type, fields of up to
  1.1 MiB, containers declaring 2**32 items, ext types
- huge_frames: frames declaring more than the transport limit, up to 2**63 B, some sent in full
- connections: waves of as many connections as this process may open (ARG at most, default
  4000; the soft descriptor limit raised to the hard one), some speaking ZMTP, some not, held
  then reset or closed
- half_frames: up to 32 connections, each holding a message or a frame header cut short. Of
  those holding more than the stall allowance of a message begun it counts `past_stall`, hung
  up on after it saw them alive STALL_SEEN_S past the stall timeout (dropped as stalled),
  and `outlived_stall`, alive STALL_MARGIN_S past it (the store must have dropped them)
- non_readers: 4 connections each sending 64 gets it never reads (the same 512-byte block 4,096
  times, 4,096 missing keys) from a receive buffer of 4 KiB, then holding on; a new connection
  when the store hangs up
- well_formed: a zmq DEALER sending valid requests that abuse the protocol: keys repeated in a
  put, a get and a delete, wrong checksums, frames of the wrong size, gets of more than a
  message of blocks, 4,096-key queries, 64 requests in flight before reading; it counts the
  replies that say `internal`
- sigkill: clients (`victim` processes) killed with SIGKILL mid-put or with gets unread
- victim: connect, start a put of 1 MiB frames or send gets, and wait to be killed
- hold: ARG connections (default 600), held until SIGTERM; prints `held N` once open
- late_flood: one connection made at once; `connected` printed; on a line on stdin it sends one
  never-ending put of 1 MiB frames until the store hangs up or ARG MiB (default 1024) are sent
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from store_peers import ZmtpPeer

from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.store.admission import STALL_ALLOWANCE_BYTES, STALL_TIMEOUT_S
from transfer.remote.store.protocol import Op, encode_request

MiB = 1 << 20
FRAME_LIMIT = MiB + 4096  # the store's transport limit with --max-block-size 1MiB
NS = Namespace("abuse", "bfloat16", 16, "BLNHC")
HOT = NS.key(b"hot")  # a 1-byte block the non-readers ask for, 4096 times a get
HOT_BLOCK = b"\x07"
ECHO = NS.key(b"echo")  # a 512-byte block: 4096 of them are a 2 MiB reply, copied
ECHO_BLOCK = bytes(range(256)) * 2
WIDE = NS.key(b"wide")  # a 32 KiB block: 4096 of them are more than a message (64 MiB)
WIDE_BLOCK = bytes(range(256)) * 128
MISSING = NS.keys([b"missing-%d" % i for i in range(4096)])
FIELDS = ("v", "id", "op", "ns", "keys", "sizes", "sums")
ZEROS = memoryview(bytes(FRAME_LIMIT + 8192))
# a connection seen alive this long past the stall timeout stalled in the store's eyes too (its
# checks, at most a second apart, see progress a check late); one alive STALL_MARGIN_S past it
# outlived any check, even on a machine busy with every attacker at once
STALL_SEEN_S = 2.0
STALL_MARGIN_S = 8.0


class Attack:
    def __init__(self, url: str, seconds: float, seed: int, arg: int | None) -> None:
        self.url, self.arg, self.rng = url, arg, random.Random(seed)
        host, port = url[len("tcp://"):].rsplit(":", 1)
        self.address = (host.strip("[]"), int(port))
        self.deadline = time.monotonic() + seconds
        self.stopped = False
        self.counts: dict[str, int] = {"opened": 0, "hung_up": 0, "messages": 0, "sent": 0}

    @property
    def running(self) -> bool:
        return not self.stopped and time.monotonic() < self.deadline

    def count(self, name: str, amount: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount

    def zmtp(self, receive_buffer: int | None = None) -> ZmtpPeer | None:
        """A ZMTP connection, or None when the store refused or dropped it at once."""
        self.count("opened")
        try:
            return ZmtpPeer(self.url, receive_buffer)
        except OSError:
            self.count("hung_up")
            return None

    def send_messages(self, make: Callable[[], list[bytes]], per_connection: int = 1000,
                      pause_s: float = 0.0) -> None:
        """Messages from `make` over a connection, a fresh one when the store hangs up or
        after `per_connection` messages."""
        while self.running:
            peer = self.zmtp()
            if peer is None:
                time.sleep(0.05)
                continue
            try:
                for _ in range(per_connection):
                    if not self.running:
                        break
                    frames = make()
                    peer.send_message(frames)
                    self.count("messages")
                    self.count("sent", sum(len(f) for f in frames))
                    if pause_s:
                        time.sleep(pause_s)
                if peer.hung_up(0.0):
                    self.count("hung_up")
            except OSError:
                self.count("hung_up")
            peer.abort()

    # ---- kinds

    def raw_bytes(self) -> None:
        rng = self.rng
        greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0])
        while self.running:
            self.count("opened")
            try:
                with socket.create_connection(self.address, timeout=5.0) as sock:
                    choice = rng.random()
                    if choice < 0.3:
                        data = greeting[:rng.randint(1, len(greeting))]
                    elif choice < 0.5:
                        data = greeting + rng.choice([b"CURVE", b"PLAIN", b"BOGUS"]).ljust(
                            20, b"\0") + rng.randbytes(rng.randint(0, 200))
                    else:
                        data = rng.randbytes(rng.randint(1, 4096))
                    sock.sendall(data)
                    self.count("messages")
                    self.count("sent", len(data))
                    if rng.random() < 0.5:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
            except OSError:
                self.count("hung_up")
            time.sleep(0.002)  # a few hundred connections a second: the others need a core too

    def garbage(self) -> None:
        rng = self.rng
        self.send_messages(lambda: [rng.randbytes(rng.randint(0, 300))
                                    for _ in range(rng.randint(1, 4))], per_connection=40)

    def msgpack(self) -> None:
        self.send_messages(self._bad_header, per_connection=20)

    def _bad_header(self) -> list[bytes]:
        rng = self.rng
        header: dict[str, Any] = {"v": 1, "id": rng.getrandbits(64), "op": rng.choice(list(Op)),
                                  "ns": NS.digest, "keys": [HOT], "sizes": [1],
                                  "sums": [block_checksum(HOT_BLOCK, HOT)]}
        header["op"] = header["op"].value
        choice = rng.randrange(6)
        field = rng.choice(FIELDS)
        if choice == 0:  # cut short
            raw = msgpack.packb(header, use_bin_type=True)
            return [raw[:rng.randrange(len(raw))]]
        if choice == 1:  # nested deep
            depth = rng.randint(100, 2000)
            header[field] = "NESTED"
            raw = msgpack.packb(header, use_bin_type=True)
            nested = rng.choice([b"\x91", b"\x81\x00"]) * depth + b"\xc0"
            return [raw.replace(msgpack.packb("NESTED"), nested, 1), HOT_BLOCK]
        if choice == 2:  # of the wrong type
            header[field] = rng.choice([None, True, -1, 2**64 - 1, 1.5, "x" * 9, b"\0" * 9,
                                        [None], {"a": 1}, [[b""] * 3], msgpack.ExtType(5, b"e")])
        elif choice == 3:  # huge
            size = rng.choice([64 << 10, MiB - 512, MiB + 4096])
            header[field] = rng.choice([b"y" * size, "z" * size, [b"k" * 40] * (size // 42)])
        elif choice == 4:  # a container declaring 2**32 items, a few given
            raw = msgpack.packb(header, use_bin_type=True)
            return [raw[:-4] + rng.choice([b"\xdd", b"\xdf"]) + b"\xff\xff\xff\xff"
                    + rng.randbytes(16)]
        else:  # a whole header of random msgpack
            header = {rng.randbytes(2): rng.randbytes(3) for _ in range(rng.randint(0, 8))}
        return [msgpack.packb(header, use_bin_type=True), HOT_BLOCK]

    def huge_frames(self) -> None:
        rng = self.rng
        while self.running:
            peer = self.zmtp()
            if peer is None:
                time.sleep(0.05)
                continue
            try:
                if rng.random() < 0.5:  # declared only
                    peer.send_frame_head(rng.choice([FRAME_LIMIT + 1, 1 << 40, (1 << 63) - 1]),
                                         more=rng.random() < 0.5)
                    peer.send_raw(ZEROS[:rng.randint(0, 64 << 10)])
                else:  # sent in full, after a put header
                    peer.send_frame(encode_request(1, Op.PUT, NS.digest, [HOT], [MiB], [0]),
                                    more=True)
                    peer.send_frame(ZEROS[:FRAME_LIMIT + rng.randint(1, 8192)], more=False)
                self.count("messages")
                if peer.hung_up(2.0):
                    self.count("hung_up")
            except OSError:
                self.count("hung_up")
            peer.abort()

    def connections(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        limit = min(self.arg or 4000, hard - 64)
        self.counts["most_held"] = 0
        while self.running:
            held: list[Any] = []
            wave_end = time.monotonic() + self.rng.uniform(1.0, 3.0)
            while len(held) < limit and time.monotonic() < wave_end and self.running:
                self.count("opened")
                try:
                    if self.rng.random() < 0.1:  # a ZMTP handshake (blocks until answered)
                        held.append(ZmtpPeer(self.url))
                    else:
                        held.append(socket.create_connection(self.address, timeout=5.0))
                except OSError:
                    self.count("hung_up")
                    time.sleep(0.01)
            self.counts["most_held"] = max(self.counts["most_held"], len(held))
            while time.monotonic() < wave_end and self.running:
                time.sleep(0.05)
            for conn in held:
                if isinstance(conn, ZmtpPeer):
                    conn.abort()
                else:
                    conn.close()
            time.sleep(self.rng.uniform(0.1, 0.5))

    def half_frames(self) -> None:
        rng = self.rng
        held: list[tuple[ZmtpPeer, float, bool]] = []  # the peer, held since, a message begun
        seen_stalled: set[ZmtpPeer] = set()
        outlived: set[ZmtpPeer] = set()
        self.counts.update(past_stall=0, outlived_stall=0)
        while self.running:
            for entry in list(held):
                peer, since, begun = entry
                if peer.hung_up(0.001):
                    held.remove(entry)
                    if peer in seen_stalled:
                        self.count("past_stall")
                    peer.abort()
                    self.count("hung_up")
                elif begun:
                    held_s = time.monotonic() - since
                    if held_s > STALL_TIMEOUT_S + STALL_SEEN_S:
                        seen_stalled.add(peer)
                    if held_s > STALL_TIMEOUT_S + STALL_MARGIN_S and peer not in outlived:
                        outlived.add(peer)
                        self.count("outlived_stall")
            if len(held) >= 32:
                time.sleep(0.05)
                continue
            peer = self.zmtp()
            if peer is None:
                time.sleep(0.05)
                continue
            try:
                header = encode_request(rng.getrandbits(32), Op.PUT, NS.digest, [HOT] * 8,
                                        [MiB] * 8, [0] * 8)
                choice = rng.randrange(3)
                if choice == 0:  # 7 of 8 frames
                    peer.send_frame(header, more=True)
                    for _ in range(7):
                        peer.send_frame(ZEROS[:MiB], more=True)
                    sent = len(header) + 7 * MiB
                    self.count("sent", 7 * MiB)
                elif choice == 1:  # a frame cut short
                    peer.send_frame(header, more=True)
                    peer.send_frame_head(MiB, more=False)
                    cut = rng.randint(1, MiB - 1)
                    peer.send_raw(ZEROS[:cut])
                    sent = len(header) + cut
                    self.count("sent", cut)
                else:  # a frame header cut short
                    peer.send_raw(b"\x02" + bytes(rng.randint(0, 7)))
                    sent = 0
                self.count("messages")
                # what the store counts (framing included) is more than the bytes counted here
                held.append((peer, time.monotonic(), sent > STALL_ALLOWANCE_BYTES))
            except OSError:
                self.count("hung_up")
                peer.abort()
        for peer, _, _ in held:
            peer.abort()

    def non_readers(self) -> None:
        self._put_blocks()
        echo = encode_request(2, Op.GET, NS.digest, [ECHO] * 4096)
        missing = encode_request(3, Op.GET, NS.digest, MISSING)
        ping = encode_request(4, Op.PING)
        peers: list[ZmtpPeer | None] = [None] * 4
        sent = [0] * 4
        while self.running:
            for index, peer in enumerate(peers):
                if peer is None:
                    peer = peers[index] = self.zmtp(receive_buffer=4096)
                    sent[index] = 0
                    if peer is None:
                        continue
                try:
                    if sent[index] < 64:
                        request = echo if sent[index] % 2 else missing
                    elif sent[index] % 100 == 0:  # a ping now and then: a send fails once
                        request = ping              # the store has hung up
                    else:
                        sent[index] += 1
                        continue
                    peer.send_message([request])
                    sent[index] += 1
                    self.count("messages")
                except OSError:
                    self.count("hung_up")
                    peer.abort()
                    peers[index] = None
            time.sleep(0.005)
        for peer in peers:
            if peer is not None:
                peer.abort()

    def _put_blocks(self) -> None:
        """The hot and the wide block, put by a well-behaved request."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.url)
        for key, block in ((HOT, HOT_BLOCK), (WIDE, WIDE_BLOCK), (ECHO, ECHO_BLOCK)):
            sock.send_multipart([encode_request(1, Op.PUT, NS.digest, [key], [len(block)],
                                                [block_checksum(block, key)]), block])
            sock.poll(10_000)
            if sock.poll(0):
                sock.recv_multipart()
        sock.close()

    def well_formed(self) -> None:
        self._put_blocks()
        rng = self.rng
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 5000
        sock.connect(self.url)
        self.count("opened")
        self.counts["internal"] = 0
        dup_keys = NS.keys([b"dup-%d" % rng.randrange(4) for _ in range(6)])
        requests: list[Callable[[], list[bytes]]] = [
            lambda: [encode_request(rng.getrandbits(64), Op.PUT, NS.digest, dup_keys,
                                    [4] * 6, [block_checksum(b"abcd", k) for k in dup_keys]),
                     *[rng.choice([b"abcd", b"wxyz"]) for _ in dup_keys]],
            lambda: [encode_request(rng.getrandbits(64), Op.PUT, NS.digest, [HOT], [1],
                                    [rng.getrandbits(64)]), b"\x09"],  # a wrong checksum
            lambda: [encode_request(2**64 - 1, Op.GET, NS.digest, dup_keys + [HOT] * 100)],
            lambda: [encode_request(7, Op.GET, NS.digest, [WIDE] * 4096)],  # over a message
            lambda: [encode_request(8, Op.EXISTS, NS.digest, MISSING)],
            lambda: [encode_request(9, Op.LOOKUP, NS.digest, [HOT] * 4096)],
            lambda: [encode_request(10, Op.DELETE, NS.digest, dup_keys + dup_keys)],
            lambda: [encode_request(11, rng.choice([Op.STATS, Op.PING]))],
        ]
        while self.running:
            burst = rng.choice([1, 1, 1, 64])  # sometimes 64 in flight before reading
            for _ in range(burst):
                frames = rng.choice(requests)()
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.count("messages")
                self.count("sent", sum(len(f) for f in frames))
            for _ in range(burst):
                if not sock.poll(2000):
                    break
                reply = msgpack.unpackb(sock.recv_multipart(copy=False)[0].buffer)
                if reply.get("code") == "internal":
                    self.counts["internal"] += 1
        sock.close()

    def sigkill(self) -> None:
        script = os.path.abspath(__file__)
        while self.running:
            victim = subprocess.Popen([sys.executable, script, "victim", self.url, "30",
                                       str(self.rng.getrandbits(32))],
                                      stdout=subprocess.PIPE, env=os.environ)
            try:
                victim.stdout.readline()  # "started"
                time.sleep(self.rng.uniform(0.05, 0.5))
            finally:
                victim.kill()
                victim.wait()
                victim.stdout.close()
            self.count("opened")
            self.count("messages")

    def victim(self) -> None:
        peer = self.zmtp()
        print("started", flush=True)
        if peer is None:
            return
        try:
            if self.rng.random() < 0.5:
                peer.send_frame(encode_request(1, Op.PUT, NS.digest, [HOT] * 4, [MiB] * 4,
                                               [0] * 4), more=True)
                while self.running:
                    peer.send_frame(ZEROS[:MiB], more=True)
            else:
                request = encode_request(2, Op.GET, NS.digest, [HOT] * 4096)
                while self.running:
                    peer.send_message([request])
        except OSError:  # the store hung up first
            self.count("hung_up")

    def hold(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        held = []
        for _ in range(self.arg or 600):
            self.count("opened")
            try:
                held.append(socket.create_connection(self.address, timeout=5.0))
            except OSError:
                self.count("hung_up")
        print(f"held {len(held)}", flush=True)
        while self.running:
            time.sleep(0.05)
        for sock in held:
            sock.close()

    def late_flood(self) -> None:
        peer = self.zmtp()
        print("connected", flush=True)
        sys.stdin.readline()
        limit = (self.arg or 1024) * MiB
        try:
            peer.send_frame(encode_request(1, Op.PUT, NS.digest, [HOT], [MiB], [0]), more=True)
            while self.counts["sent"] < limit and self.running:
                peer.send_frame(ZEROS[:MiB], more=True)
                self.count("sent", MiB)
        except OSError:
            self.count("hung_up")
        if not self.counts["hung_up"] and peer.hung_up(10.0):
            self.count("hung_up")
        peer.abort()


def main() -> None:
    kind, url, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    arg = int(sys.argv[5]) if len(sys.argv) > 5 else None
    attack = Attack(url, seconds, seed, arg)

    def stop(*_: object) -> None:
        attack.stopped = True

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    getattr(attack, kind)()
    print(json.dumps({"kind": kind, "seconds": round(time.monotonic() - started, 1),
                      **attack.counts}), flush=True)


if __name__ == "__main__":
    main()
