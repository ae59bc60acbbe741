"""A store process abused by other processes, one class of abuse a test: fields nested deep or
oversized, peers of an old ZMTP, descriptors running out, clients that never read their
answers, gets of more than a message of blocks, keys repeated in one request. Each time a
well-behaved client's bytes come back exact, the store's memory stays within the bound
docs/protocol.md states ("Limits") and it answers stats at once when the attackers are gone
(the whole fuzz run: test_remote_fuzz.py). And the bench's raw baseline server, the other
listener of this package, under requests it does not know.

Deadlines here are liveness bounds for a loaded 2-core machine, not speed checks.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from store_bystander import (
    DEADLINE_S,
    NONE,
    Bystander,
    MiB,
    finish_attack,
    memory,
    start_attack,
    wait_for,
)
from store_peers import RawPeer

from kvconnector.servers.baseline import RawServer
from kvconnector.servers.store import StoreProcess
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient
from transfer.remote.store.protocol import Op, Reply, decode_reply, encode_request

CAPACITY = 64 * MiB
BUDGET = 96 * MiB
STORE_ARGS = ("--max-block-size", "1MiB", "--buffer-budget", f"{BUDGET}B")
# what the store may grow by beyond its capacity and budget (docs/protocol.md, "Memory bound"):
# replies under 4 KiB (32 a connection), zmq's memory per connection, the request being served,
# freed memory glibc keeps for the next put (transfer.remote.store.heap)
SLACK = 192 * MiB
FIELDS = ("v", "id", "op", "ns", "keys", "sizes", "sums")
MAX_PEERS = 256 - 64  # with a limit of 256 descriptors
NS = Namespace("abused", "bfloat16", 16, "BLNHC")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity=f"{CAPACITY}B",
                      extra_args=STORE_ARGS) as proc:
        yield proc


def _stats(url: str) -> dict[str, Any]:
    with StoreClient(url, NONE, timeout_s=DEADLINE_S) as client:
        return client.stats()


def _ask(url: str, frames: list[bytes]) -> tuple[Reply, int]:
    """One request over a fresh connection (a connection is dropped after 16 invalid ones):
    the reply and its header's size."""
    peer = RawPeer(url)
    try:
        answer = peer.request(frames, timeout_s=DEADLINE_S)
    finally:
        peer.close()
    assert answer is not None, "the store did not answer"
    return decode_reply(answer[0]), len(answer[0])


def _header_with(field: str, raw_value: bytes) -> bytes:
    """A put header whose `field` is the msgpack `raw_value`."""
    key = NS.key(b"k")
    header = {"v": 1, "id": 5, "op": "put", "ns": NS.digest, "keys": [key], "sizes": [1],
              "sums": [block_checksum(b"x", key)], field: "PLACEHOLDER"}
    return msgpack.packb(header, use_bin_type=True).replace(msgpack.packb("PLACEHOLDER"),
                                                           raw_value, 1)


def test_deep_and_huge_fields_get_short_malformed_replies(store: StoreProcess) -> None:
    # 1,000 nested arrays made building the error text raise RecursionError (an internal
    # error, a traceback logged each time); a 1 MiB field was quoted in full in the reply
    # (1 MB) and in the log
    deep = b"\x91" * 1000 + b"\xc0"
    huge = msgpack.packb(b"y" * (MiB - 1024), use_bin_type=True)
    asked = 0
    for field in FIELDS:
        for value in (deep, huge):
            reply, size = _ask(store.url, [_header_with(field, value), b"x"])
            asked += 1
            assert (reply.ok, reply.code) == (False, "malformed"), (field, reply)
            assert len(reply.error) <= 200 and size <= 512, (field, len(reply.error), size)
            assert reply.request_id == (None if field == "id" else 5)
    stats = _stats(store.url)
    assert (stats["internal_errors"], stats["request_errors"]) == (0, asked)
    assert store.log_path.stat().st_size <= 64 << 10  # a line a connection, each short


@pytest.mark.parametrize("data", [
    b"\x01\x00" + b"\x03\x00hi",  # identity (empty), message "hi": length, flags, bytes
    b"\xff" + bytes(8) + b"\x7f\x00" + b"\x01\x00" + b"\x03\x00hi",  # the same, versioned
    b"\xff" + bytes(8) + b"\x7f\x01\x05" + b"\x00\x00" + b"\x00\x02hi",  # flags, size, bytes
], ids=["zmtp-1.0", "zmtp-1.0-versioned", "zmtp-2.0"])
def test_a_peer_speaking_an_old_zmtp_cannot_take_the_store_down(store: StoreProcess,
                                                               data: bytes) -> None:
    # Six bytes of ZMTP 1.0 (an empty identity, then a message) ended the store: zmq had no
    # descriptor on record for the message (Frame.get(SRCFD) raised EINVAL, outside the
    # request's error handling). The store now refuses ZMTP 1.0 and 2.0 peers at the handshake.
    host, port = store.url[len("tcp://"):].rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
            sock.sendall(data)
            sock.settimeout(2.0)  # (a store that answers a ZMTP 2.0 peer leaves it open)
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                while sock.recv(4096):  # until the store closes the connection
                    pass
    stats = _stats(store.url)
    assert (stats["internal_errors"], stats["request_errors"]) == (0, 0)
    assert store.process.poll() is None


def test_descriptors_running_out_never_lose_count_of_a_connection(tmp_path: Path) -> None:
    # Past its descriptor limit the store could not duplicate a connection's descriptor to
    # read its byte count, took the connection for gone and stopped counting it: a flood on it
    # afterwards grew the store without bound (2.4 GiB of 60 MiB frames, never dropped). Now it
    # keeps at most its descriptor limit less 64 connections (192 here), refuses the others at
    # once, and reads the counts in place.
    with StoreProcess(tmp_path / "store.log", capacity=f"{CAPACITY}B", extra_args=STORE_ARGS,
                      fd_limit=256) as store:
        idle = memory(store.process.pid)["VmRSS"]
        bystander = Bystander(store.url)
        observer = StoreClient(store.url, NONE, timeout_s=DEADLINE_S)
        flood = start_attack("late_flood", store.url, 180.0, arg=1024)
        holder = None
        try:
            peers = observer.stats()["peers"]
            assert flood.stdout.readline() == b"connected\n"
            assert wait_for(lambda: observer.stats()["peers"] > peers)  # the flood's, counted
            holder = start_attack("hold", store.url, 180.0, arg=600)
            assert holder.stdout.readline().startswith(b"held ")
            # every connection the store took in was counted (or refused) meanwhile
            wait_for(lambda: observer.stats().get("refused_peers", 0) >= 600 - MAX_PEERS,
                     timeout_s=DEADLINE_S)
            during = observer.stats()
            held = finish_attack(holder)  # its connections close: descriptors come back
            flood.stdin.write(b"go\n")
            flood.stdin.flush()
            flooded = finish_attack(flood, timeout_s=120.0, terminate=False)
        finally:
            for attacker in filter(None, (holder, flood)):
                if attacker.poll() is None:
                    attacker.kill()
                    attacker.wait()
            bystander.stop()
            observer.close()
        peak = memory(store.process.pid)["VmHWM"] - idle
        stats = _stats(store.url)
        assert held["opened"] == 600
        assert flooded["hung_up"] == 1 and flooded["sent"] <= 4 * BUDGET, flooded
        assert peak <= CAPACITY + BUDGET + SLACK, f"the store grew by {peak / MiB:.0f} MiB"
        assert during.get("max_peers") == MAX_PEERS and during["peers"] <= MAX_PEERS
        assert during["refused_peers"] >= 600 - MAX_PEERS
        assert bystander.failures == [] and bystander.rounds >= 1
        assert stats["dropped_peers"] >= 1 and stats["internal_errors"] == 0
        assert stats["peers"] <= 4  # the attackers' connections are gone
        assert store.process.poll() is None


def test_clients_that_never_read_hold_bounded_memory(store: StoreProcess) -> None:
    # A peer reading none of its answers had up to 1,000 replies queued by zmq, each a get of
    # the same 1-byte block 4,096 times (4,096 frames, ~0.3 MB): 0.3 GB a connection, never
    # dropped, its blocks pinned (unevictable) for good. Now 32 replies at most a connection,
    # the large ones counted in the buffer budget, and a peer that leaves them unread is dropped.
    idle = memory(store.process.pid)["VmRSS"]
    bystander = Bystander(store.url)
    attackers = [start_attack("non_readers", store.url, 5.0, seed=seed) for seed in (1, 2)]
    try:
        summaries = [finish_attack(attacker, timeout_s=60.0, terminate=False)
                     for attacker in attackers]
    finally:
        bystander.stop()
    peak = memory(store.process.pid)["VmHWM"] - idle
    assert sum(s["messages"] for s in summaries) >= 8 * 32  # past every connection's 32
    assert peak <= CAPACITY + BUDGET + SLACK, (
        f"the store grew by {peak / MiB:.0f} MiB ({summaries})")
    # their connections are gone: so are their replies and pins
    assert wait_for(lambda: (lambda s: s["pinned_blocks"] == 0 and s["pending_bytes"] == 0)(
        _stats(store.url)), timeout_s=DEADLINE_S)
    stats = _stats(store.url)
    assert stats["dropped_replies"] > 0 and stats["internal_errors"] == 0
    assert bystander.failures == [] and bystander.rounds >= 1


def test_a_get_of_more_than_a_message_of_blocks_is_refused(store: StoreProcess) -> None:
    # a get's reply had no byte limit: 4,096 times one 32 KiB block is 128 MiB copied into
    # one reply (blocks under pyzmq's 64 KiB copy threshold are copied)
    key, block = NS.key(b"wide"), bytes(range(256)) * 128
    pool = torch.frombuffer(bytearray(block), dtype=torch.uint8).reshape(1, -1)
    with StoreClient(store.url, NONE, namespace=NS, pool=pool) as writer:
        assert writer.put([key], [0]).all_ok
    reply, _ = _ask(store.url, [encode_request(3, Op.GET, NS.digest, [key] * 4096)])
    assert (reply.request_id, reply.ok, reply.code) == (3, False, "limit")
    assert "limit is 67108864 B per message" in reply.error
    peer = RawPeer(store.url)
    try:
        answer = peer.request([encode_request(4, Op.GET, NS.digest, [key] * 100)])
    finally:
        peer.close()
    assert answer is not None and decode_reply(answer[0]).ok
    assert answer[1:] == [block] * 100
    assert _stats(store.url)["internal_errors"] == 0


def test_keys_repeated_in_one_request_are_stored_once_and_nothing_leaks(
        store: StoreProcess) -> None:
    # the pool daemon leaked a slot for a key committed twice; the store keeps the first
    # block of a key (same key, same bytes), answers each position and holds nothing after
    first, other = NS.key(b"twice"), NS.key(b"once")
    keys, blocks = [first, first, other], [b"AAAA", b"BBBB", b"CCCC"]
    header = encode_request(1, Op.PUT, NS.digest, keys, [4] * 3,
                            [block_checksum(b, k) for b, k in zip(blocks, keys, strict=True)])
    reply, _ = _ask(store.url, [header, *blocks])
    assert reply.ok and reply.fields["status"] == [BlockStatus.OK.value] * 3
    peer = RawPeer(store.url)
    try:
        answer = peer.request([encode_request(2, Op.GET, NS.digest, keys)])
    finally:
        peer.close()
    assert answer is not None and answer[1:] == [b"AAAA", b"AAAA", b"CCCC"]
    assert wait_for(lambda: _stats(store.url)["pinned_blocks"] == 0, timeout_s=DEADLINE_S)
    stats = _stats(store.url)
    assert (stats["blocks"], stats["used_bytes"]) == (2, 8)
    reply, _ = _ask(store.url, [encode_request(3, Op.DELETE, NS.digest, [first, first])])
    assert reply.fields["deleted"] == [True, False]
    reply, _ = _ask(store.url, [encode_request(4, Op.PUT, NS.digest, [first], [4],
                                               [block_checksum(b"DDDD", first)]), b"DDDD"])
    assert reply.fields["status"] == [BlockStatus.OK.value]
    stats = _stats(store.url)
    assert (stats["blocks"], stats["used_bytes"], stats["internal_errors"]) == (2, 8, 0)


def test_the_raw_baseline_survives_requests_it_does_not_know() -> None:
    # the bench's baseline ROUTER (loopback, for a bench run) ended its serving thread on the
    # first request it could not parse, and on a get before any put (a division by zero)
    server = RawServer(NONE, capacity=1 << 20, io_threads=1)
    server.start()
    peer = RawPeer(server.url)
    try:
        for request in ([b"bogus"], [b"get:"], [b"get:x1"], [b"get:2"], [b"get:99999999"]):
            assert peer.request(request, timeout_s=DEADLINE_S) == [b"error"], request
        assert peer.request([b"put", b"abc"], timeout_s=DEADLINE_S) == [b"ok"]
        assert peer.request([b"get:2"], timeout_s=DEADLINE_S) == [b"ok", b"abc", b"abc"]
    finally:
        peer.close()
        server.stop()
