"""Block values over a Redis node connection without copying them through Python objects.

redis-py hands every GET reply over as a new `bytes`, grown through hiredis's buffer: two 2 MB
copies made holding the GIL (profiled: ~45% of the GIL time of a 4-thread get), and it wants a
SET's value as one buffer, so header and block were joined (another copy under the GIL, 25% of
a put's). Here a node's share of a put or get is one pipeline on a connection from the node
client's own pool (redis-py made it: AUTH, TLS, timeouts): a SET sends the header and the pool
slot as separate buffers, and each GET reply is read with recv_into straight into the calling
thread's reused buffer, so the kernel copies with the GIL released and the bytes are checked
while still in cache. Only the RESP2 a GET's reply needs is read here (a string, nil or an
error; the backend's connections speak RESP2, so no push message can arrive between replies);
anything else, a short read or a timeout disconnects the connection and fails the node's share.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

_CRLF = b"\r\n"
_LINE_BYTES = 64 << 10  # reply lines are short; a payload's head may land here too


class ValueTooLarge(Exception):
    """A GET reply larger than the reader's buffer: drained, never held (its size named)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the value is {size} B; a block value is at most {limit} B")
        self.size = size


def set_values(client: redis.Redis, keys: Sequence[bytes],
               values: Sequence[tuple[bytes, Any]]) -> list[Any]:
    """SET keys[i] to values[i] = (head, body) in one pipeline, the two parts sent as they are.
    Per key: True, or the error the node answered (MOVED, OOM, ...)."""
    chunks: list[Any] = []
    for key, (head, body) in zip(keys, values, strict=True):
        size = len(head) + memoryview(body).nbytes
        chunks += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(key), key, size, head),
                   body, _CRLF]
    with _connection(client) as conn:
        conn.send_packed_command(chunks, check_health=False)
        replies: list[Any] = []
        for _ in keys:
            try:
                reply = conn.read_response()
            except ResponseError as exc:  # the node's answer for this key; the stream is intact
                reply = exc
            replies.append(reply in (b"OK", "OK") or reply)
        return replies


def get_values(client: redis.Redis, keys: Sequence[bytes],
               buffer: memoryview) -> Iterator[memoryview | Exception | None]:
    """GET `keys` in one pipeline; yields per key a view of `buffer` holding its value (valid
    until the next item), None for a miss, or the node's error (ValueTooLarge included).
    `client` must speak RESP2 (protocol=2)."""
    protocol = client.connection_pool.connection_kwargs.get("protocol")
    if str(protocol) != "2":
        raise ValueError(f"get_values reads RESP2 replies: make the client with protocol=2, "
                         f"not protocol={protocol!r}")
    chunks = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key) for key in keys]
    with _connection(client) as conn:
        conn.send_packed_command([b"".join(chunks)], check_health=False)
        reader = _ReplyReader(conn._sock)  # redis-py has no public handle for its socket
        for _ in keys:
            yield reader.bulk(buffer)
        if reader.buffered:
            raise RedisConnectionError("the node sent more than the replies asked for")


class _connection:
    """A connection from the client's pool, disconnected if the block left it mid-reply."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None

    def __enter__(self) -> Any:
        self._conn = self._pool.get_connection()
        return self._conn

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is not None:  # a failure or an abandoned generator: the stream is out of step
                self._conn.disconnect()
        finally:
            self._pool.release(self._conn)


class _ReplyReader:
    """RESP2 GET replies from a socket: lines through a small buffer, payloads with recv_into
    into the caller's buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._line = bytearray(_LINE_BYTES)
        self._start = self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def bulk(self, buffer: memoryview) -> memoryview | Exception | None:
        line = self._read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return BaseParser.parse_error(rest.decode("utf-8", "replace"))
        if line == b"$-1":
            return None
        if kind != b"$" or not rest.isdigit():
            raise RedisConnectionError(f"unexpected reply to GET: {line[:80]!r}")
        size = int(rest)
        if size > len(buffer):
            self._skip(size + 2)
            return ValueTooLarge(size, len(buffer))
        self._read_into(buffer[:size])
        end = bytearray(2)
        self._read_into(memoryview(end))
        if end != _CRLF:
            raise RedisConnectionError("a GET reply does not end in CRLF")
        return buffer[:size]

    def _read_line(self) -> bytes:
        while True:
            found = self._line.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = bytes(self._line[self._start:found])
                self._start = found + 2
                return line
            if self._start:  # keep the partial line at the front, then read more after it
                self._line[:self.buffered] = self._line[self._start:self._end]
                self._start, self._end = 0, self.buffered
            if self._end == len(self._line):
                raise RedisConnectionError("a reply line longer than 64 KiB")
            self._end += self._recv(memoryview(self._line)[self._end:])

    def _read_into(self, target: memoryview) -> None:
        held = min(self.buffered, len(target))
        target[:held] = self._line[self._start:self._start + held]
        self._start += held
        while held < len(target):
            held += self._recv(target[held:])

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            part = scratch[:min(count, len(scratch))]
            self._read_into(part)
            count -= len(part)

    def _recv(self, into: memoryview) -> int:
        received = self._sock.recv_into(into)
        if not received:
            raise RedisConnectionError("the node closed the connection mid-reply")
        return received
