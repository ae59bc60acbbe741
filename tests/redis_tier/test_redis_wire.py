"""Block values over a node connection (transfer/remote/redis/wire.py): against a real cluster
node, and the reply reader fed a byte at a time (which no real server can be made to do)."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

pytest.importorskip("redis")

from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: E402
from redis.exceptions import MovedError, ResponseError  # noqa: E402
from redis.exceptions import TimeoutError as RedisTimeoutError  # noqa: E402

from kvconnector.servers.redis_cluster import LocalRedisCluster  # noqa: E402
from transfer.remote.redis.wire import (  # noqa: E402
    _IOV_MAX,
    ValueTooLarge,
    _ReplyReader,
    _send,
    checked_out,
    get_values,
    set_values,
)

BUFFER = 200 << 10
SIZES = (0, 1, 5000, 100 << 10, BUFFER)  # empty, tiny, and past the 64 KiB line buffer


def tagged(name: str) -> bytes:
    return b"kvc:{wire}" + name.encode()  # one hash slot: one node, one pipeline


@pytest.mark.redis
def test_values_round_trip_and_every_reply_kind_keeps_the_stream_in_step(
        redis_cluster: LocalRedisCluster) -> None:
    node = redis_cluster.node_client(redis_cluster.master_index_for_key(tagged("x")), protocol=2)
    heads = [os.urandom(40) for _ in SIZES]
    bodies = [memoryview(os.urandom(size))[: max(0, size - 40)] for size in SIZES]
    names = [tagged(f"v{size}") for size in SIZES]
    with checked_out(node) as conn:
        assert set_values(conn, names, list(zip(heads, bodies, strict=True))) == \
            [True] * len(SIZES)
    for name, head, body in zip(names, heads, bodies, strict=True):
        assert node.get(name) == head + bytes(body)

    node.rpush(tagged("a-list"), b"x")
    node.set(tagged("too-big"), os.urandom(BUFFER + 1))
    connection_id = node.client_id()
    asked = [names[0], tagged("missing"), names[1], tagged("a-list"), tagged("too-big"),
             *names[2:]]
    buffer = memoryview(bytearray(BUFFER))
    got = []
    with checked_out(node) as conn:
        for reply in get_values(conn, asked, buffer):
            got.append(bytes(reply) if isinstance(reply, memoryview) else reply)
    assert got[0] == heads[0] + bytes(bodies[0]) and got[2] == heads[1] + bytes(bodies[1])
    assert got[1] is None
    assert isinstance(got[3], ResponseError) and "WRONGTYPE" in str(got[3])
    assert isinstance(got[4], ValueTooLarge) and got[4].size == BUFFER + 1
    assert got[5:] == [h + bytes(b) for h, b in zip(heads[2:], bodies[2:], strict=True)]
    assert node.client_id() == connection_id  # the same connection, back in the pool in step
    node.delete(*names, tagged("a-list"), tagged("too-big"))
    node.close()
    resp3 = redis_cluster.node_client(0, protocol=3)
    with checked_out(resp3) as conn, pytest.raises(ValueError, match="protocol=2"):
        next(get_values(conn, names, buffer))
    resp3.close()


@pytest.mark.redis
def test_a_read_left_halfway_drops_its_connection(redis_cluster: LocalRedisCluster) -> None:
    node = redis_cluster.node_client(redis_cluster.master_index_for_key(tagged("x")), protocol=2)
    names = [tagged(f"half{i}") for i in range(3)]
    values = [os.urandom(100 << 10) for _ in names]
    with checked_out(node) as conn:
        assert set_values(conn, names, [(b"", v) for v in values]) == [True] * 3
    connection_id = node.client_id()
    buffer = memoryview(bytearray(BUFFER))
    with checked_out(node) as conn:
        replies = get_values(conn, names, buffer)
        assert bytes(next(replies)) == values[0]
        replies.close()  # two replies still unread: that connection must never be reused
    assert node.client_id() != connection_id
    with checked_out(node) as conn:
        assert [bytes(r) for r in get_values(conn, names, buffer)] == values
    node.delete(*names)
    node.close()


def _feed(stream: bytes, payload: bytes = b"") -> tuple[socket.socket, threading.Thread]:
    """A socket receiving `stream` a byte at a time, except `payload` in 7777-byte pieces."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)

    def dribble() -> None:
        head = stream.index(payload) if payload else len(stream)
        pieces = [stream[i:i + 1] for i in range(head)]
        pieces += [payload[i:i + 7777] for i in range(0, len(payload), 7777)]
        pieces += [stream[i:i + 1] for i in range(head + len(payload), len(stream))]
        with theirs:
            for piece in pieces:
                theirs.sendall(piece)

    writer = threading.Thread(target=dribble, daemon=True)
    writer.start()
    return ours, writer


def test_reader_takes_replies_split_anywhere() -> None:
    payload = os.urandom(100 << 10)
    stream = (b"$5\r\nhello\r\n" + b"$-1\r\n" + b"-MOVED 3999 127.0.0.1:6381\r\n"
              + b"-ERR syntax error\r\n" + b"$%d\r\n%s\r\n" % (len(payload), payload)
              + b"$0\r\n\r\n" + b"_\r\n")
    ours, writer = _feed(stream, payload)
    try:
        reader = _ReplyReader(ours)
        buffer = memoryview(bytearray(BUFFER))
        assert bytes(reader.bulk(buffer)) == b"hello"
        assert reader.bulk(buffer) is None
        moved = reader.bulk(buffer)
        assert isinstance(moved, MovedError) and moved.slot_id == 3999
        error = reader.bulk(buffer)
        assert isinstance(error, ResponseError) and "syntax error" in str(error)
        assert bytes(reader.bulk(buffer)) == payload
        assert bytes(reader.bulk(buffer)) == b""
        with pytest.raises(RedisConnectionError, match="unexpected reply to GET: b'_'"):
            reader.bulk(buffer)  # RESP3: the backend's connections speak RESP2
        writer.join(10)
        with pytest.raises(RedisConnectionError, match="closed the connection"):
            reader.bulk(buffer)
    finally:
        ours.close()


@pytest.mark.parametrize("line", [b"$" + b"1" * (70 << 10), b"$-5", b"$--1", b"$12x"])
def test_reader_refuses_malformed_lines(line: bytes) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(10)
        theirs.sendall(line + b"\r\n")
        with pytest.raises(RedisConnectionError, match="longer than 64 KiB|unexpected reply"):
            _ReplyReader(ours).bulk(memoryview(bytearray(BUFFER)))


class _Connection:
    """What `_send` uses of a redis-py connection: its socket, and disconnect."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.disconnected = False

    def disconnect(self) -> None:
        self.disconnected = True


def test_send_resumes_after_partial_sends_and_splits_past_the_iov_limit() -> None:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # every sendmsg goes in part
    ours.settimeout(10)
    theirs.settimeout(10)
    body = np.frombuffer(os.urandom(1 << 20), np.uint8)
    parts = [b"head", body, memoryview(b"xy"), *(bytes([i % 251]) for i in range(2 * _IOV_MAX)),
             b"tail"]
    expected = b"".join(bytes(memoryview(part)) for part in parts)
    got = bytearray()

    def drain() -> None:
        while len(got) < len(expected):
            got.extend(theirs.recv(3000))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    connection = _Connection(ours)
    with ours, theirs:
        _send(connection, parts)
        reader.join(10)
    assert bytes(got) == expected and not connection.disconnected


@pytest.mark.parametrize(("reader_gone", "error"), [(True, RedisConnectionError),
                                                     (False, RedisTimeoutError)])
def test_send_failures_disconnect_and_raise_redis_errors(reader_gone: bool,
                                                         error: type[Exception]) -> None:
    ours, theirs = socket.socketpair()
    ours.settimeout(0.2)
    if reader_gone:
        theirs.close()
    connection = _Connection(ours)
    with ours, pytest.raises(error):
        _send(connection, [b"head", os.urandom(8 << 20)])  # more than any socket buffer
    theirs.close()
    assert connection.disconnected
