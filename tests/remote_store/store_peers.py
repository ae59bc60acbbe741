"""Bare peers of a store in tests: a DEALER that may mis-speak the protocol, and ZMTP by hand."""

from __future__ import annotations

import socket
import struct
import time

import zmq

from transfer.remote.store.security import Security


class RawPeer:
    """A bare DEALER for speaking (or mis-speaking) the protocol to a store in tests."""

    def __init__(self, url: str, security: Security | None = None) -> None:
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.linger = 0
        (security or Security.none()).apply_client(self._sock, url)
        self._sock.connect(url)

    def request(self, frames: list[bytes], timeout_s: float = 10.0) -> list[bytes] | None:
        """Send one multipart message; the reply's frames, or None if none came in time.

        None also when the message could not even be queued: a DEALER whose handshake was
        refused has no peer left, and a plain send would wait for one forever.
        """
        deadline_ms = int(timeout_s * 1000)
        if not self._sock.poll(deadline_ms, zmq.POLLOUT):
            return None
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the peer went between the poll and the send
            return None
        if not self._sock.poll(deadline_ms):
            return None
        return self._sock.recv_multipart()

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmtpPeer:
    """A DEALER spoken by hand over plain TCP (ZMTP 3.0, NULL mechanism: `--security none`).

    It can send what a zmq socket never would: a frame cut short, a message never finished, a
    frame header with no bytes behind it; and it sees the store hang up on it.
    """

    def __init__(self, url: str, receive_buffer: int | None = None) -> None:
        """Connect and shake hands; `receive_buffer`: SO_RCVBUF, set before connecting (a peer
        that reads nothing then holds little of what the store sends it)."""
        host, port = url[len("tcp://"):].rsplit(":", 1)
        address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
        self._sock = socket.socket(address[0], socket.SOCK_STREAM)
        try:
            if receive_buffer is not None:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            self._sock.settimeout(10.0)
            self._sock.connect(address[4])
        except OSError:
            self._sock.close()
            raise
        self._sock.sendall(_ZMTP_GREETING)
        body = (b"\x05READY" + bytes([len(b"Socket-Type")]) + b"Socket-Type"
                + struct.pack(">I", len(b"DEALER")) + b"DEALER")
        self._sock.sendall(_frame_head(len(body), more=False, command=True) + body)
        # the store's greeting and READY: a message frame sent before them is a protocol error
        self._receive(len(_ZMTP_GREETING))
        flags = self._receive(1)[0]
        size = struct.unpack(">Q", self._receive(8))[0] if flags & 2 else self._receive(1)[0]
        self._receive(size)

    def set_timeout(self, seconds: float) -> None:
        """How long a send may wait for room (TimeoutError past it)."""
        self._sock.settimeout(seconds)

    def send_frame(self, data: bytes | memoryview, *, more: bool) -> None:
        """One frame of a message (`more`: another frame follows)."""
        self._sock.sendall(_frame_head(len(data), more=more, command=False))
        self._sock.sendall(data)

    def send_message(self, frames: list[bytes]) -> None:
        for index, frame in enumerate(frames):
            self.send_frame(frame, more=index < len(frames) - 1)

    def send_frame_head(self, size: int, *, more: bool) -> None:
        """A frame's header declaring `size` bytes; its bytes follow through `send_raw`."""
        self._sock.sendall(_frame_head(size, more=more, command=False))

    def send_raw(self, data: bytes | memoryview) -> None:
        self._sock.sendall(data)

    def _receive(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self._sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError("the store closed the connection during the handshake")
            data += chunk
        return data

    def hung_up(self, timeout_s: float) -> bool:
        """Whether the store closed the connection within `timeout_s` (what it sent is read
        and dropped)."""
        deadline = time.monotonic() + timeout_s
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                self._sock.settimeout(remaining)
                if not self._sock.recv(1 << 16):
                    return True
        except (TimeoutError, BlockingIOError):
            return False
        except OSError:  # reset
            return True
        return False

    def abort(self) -> None:
        """Close abruptly: a TCP reset, nothing flushed."""
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._sock.close()

    def close(self) -> None:
        self._sock.close()


_ZMTP_GREETING = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0")
                  + bytes(32))


def _frame_head(size: int, *, more: bool, command: bool) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if size > 255:
        return struct.pack(">BQ", flags | 2, size)
    return struct.pack(">BB", flags, size)
