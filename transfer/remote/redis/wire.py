"""Block values over a Redis node connection without copying them through Python objects.

redis-py hands every GET reply over as a new `bytes`, grown through hiredis's buffer: two 2 MB
copies made holding the GIL (profiled: ~45% of the GIL time of a 4-thread get), and it wants a
SET's value as one buffer, so header and block were joined (another copy under the GIL, 25% of
a put's). Here pipelines run on a connection checked out once from the node client's own pool
(redis-py made it: AUTH, TLS, timeouts) for a run of them (`checked_out`): a SET pipeline goes
out in one sendmsg, the headers and the pool slots as separate buffers, and each GET reply is
read with recv_into straight into the calling thread's reused buffer, so the kernel copies with
the GIL released and the bytes are checked while still in cache. Only the RESP2 a GET's reply
needs is read here (a string, nil or an error; the backend's connections speak RESP2, so no push
message can arrive between replies); anything else, a short read or a timeout disconnects the
connection and fails the run.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_CRLF = b"\r\n"
_LINE_BYTES = 64 << 10  # reply lines are short; a payload's head may land here too
_IOV_MAX = 1024  # Linux's limit on one sendmsg's buffers


class ValueTooLarge(Exception):
    """A GET reply larger than the reader's buffer: drained, never held (its size named)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the value is {size} B; a block value is at most {limit} B")
        self.size = size


def set_values(conn: Any, keys: Sequence[bytes],
               values: Sequence[tuple[bytes, Any]]) -> list[Any]:
    """SET keys[i] to values[i] = (head, body) in one pipeline on `conn` (from `checked_out`),
    the two parts sent as they are. Per key: True, or the error the node answered (MOVED,
    OOM, ...)."""
    chunks: list[Any] = []
    for key, (head, body) in zip(keys, values, strict=True):
        size = len(head) + memoryview(body).nbytes
        chunks += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(key), key, size, head),
                   body, _CRLF]
    _send(conn, chunks)
    replies: list[Any] = []
    for _ in keys:
        try:
            reply = conn.read_response()
        except ResponseError as exc:  # the node's answer for this key; the stream is intact
            reply = exc
        replies.append(reply in (b"OK", "OK") or reply)
    return replies


def get_values(conn: Any, keys: Sequence[bytes],
               buffer: memoryview) -> Iterator[memoryview | Exception | None]:
    """GET `keys` in one pipeline on `conn` (from `checked_out`, speaking RESP2: protocol=2);
    yields per key a view of `buffer` holding its value (valid until the next item), None for
    a miss, or the node's error (ValueTooLarge included). A read left halfway disconnects
    `conn`: its stream is out of step."""
    if str(conn.protocol) != "2":
        raise ValueError(f"get_values reads RESP2 replies: make the client with protocol=2, "
                         f"not protocol={conn.protocol!r}")
    chunks = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key) for key in keys]
    conn.send_packed_command([b"".join(chunks)], check_health=False)
    reader = _ReplyReader(conn._sock)  # redis-py has no public handle for its socket
    try:
        for _ in keys:
            yield reader.bulk(buffer)
        if reader.buffered:
            raise RedisConnectionError("the node sent more than the replies asked for")
    except BaseException:  # a failure, or the caller left (GeneratorExit)
        conn.disconnect()
        raise


def _send(conn: Any, parts: list[Any]) -> None:
    """Send a pipeline's parts with one sendmsg on a plain socket: redis-py's
    send_packed_command makes a syscall (and, with TCP_NODELAY, a packet) of each part. TLS
    sockets have no sendmsg: those go through redis-py."""
    sock = conn._sock
    if sock is None or isinstance(sock, ssl.SSLSocket):
        conn.send_packed_command(parts, check_health=False)
        return
    views = [memoryview(part).cast("B") for part in parts]
    try:
        while views:
            sent = sock.sendmsg(views[:_IOV_MAX])
            while sent:  # drop what went; a part sent in part keeps its tail
                if sent < len(views[0]):
                    views[0], sent = views[0][sent:], 0
                else:
                    sent -= len(views.pop(0))
    except TimeoutError:  # socket.timeout
        conn.disconnect()
        raise RedisTimeoutError("timeout writing to the node's socket") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"error writing to the node's socket: {exc}") from None


class checked_out:
    """A connection from a node client's pool for a run of pipelines; disconnected if the run
    failed (its stream may be out of step) before it goes back."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None

    def __enter__(self) -> Any:
        self._conn = self._pool.get_connection()
        return self._conn

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is not None:
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
