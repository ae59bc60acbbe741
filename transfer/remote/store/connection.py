"""A client's socket to the store: one DEALER, its requests and replies, failures, reconnects.

A lane (transfer.remote.store.lanes) drives one or several of them from one thread, with several
requests in flight.

The DEALER is `immediate` (nothing is queued for a store that is not connected, so a send waits
for a live connection instead) and watched by a zmq monitor: a connection lost during a call, or
a handshake the store refuses, fails the call's requests at once rather than at their timeout.
After any failure the socket is closed (unsent frames are dropped) and a fresh one connects, so
a late reply can never reach a slot the caller took back and a restarted store is found again;
once libzmq has destroyed the old socket, no frame sent on it is read again, so the failed
requests' slots are free even where libzmq never reports a frame done.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer.remote.backend import BlockStatus
from transfer.remote.store.protocol import ProtocolError, Reply, decode_reply
from transfer.remote.store.security import Security

# plain ints: operators on pyzmq's enum flags run Python code, a cost on every request
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_SNDMORE, _NOBLOCK, _RCVMORE = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.RCVMORE)
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_MONITOR_STOPPED)
# libzmq destroys a closed socket on its reaper thread, within a millisecond or so
_DESTROY_WAIT_S = 1.0
_monitor_ids = count()


class StoreError(Exception):
    """A request without a usable reply: timeout, lost connection, refusal, malformed reply."""


@dataclass(eq=False)
class Exchange:
    """One request in flight: its header and block frames, and what became of it."""

    request_id: int
    # the header, or a function building it just before the send (a put computes its checksums
    # then, overlapping the frames already on their way)
    header: bytes | Callable[[], bytes]
    indices: Sequence[int] = ()  # the caller's positions of the request's keys
    frames: list[Any] = field(default_factory=list)  # buffers sent zero-copy after the header
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    deadline: float = 0.0
    error: str = ""  # set when no usable reply came
    shard: int = 0  # the store worker it goes to (transfer.remote.store.shards)


# takes a reply to one of its requests and reads the reply's block frames from the connection
Complete = Callable[["Connection", Exchange, Reply], None]


class Connection:
    """One DEALER socket to the store, in `context`, on IO thread `io_thread` of it; used by
    one thread at a time."""

    def __init__(self, url: str, security: Security, *, context: zmq.Context, io_thread: int,
                 max_frame_bytes: int) -> None:
        self.url = url
        self._io_thread = io_thread
        self._security = security
        self._max_frame_bytes = max_frame_bytes
        self._context = context
        self._sock: zmq.Socket | None = None
        # monitors of closed sockets libzmq has not destroyed yet: each is closed only after
        # its socket's last event, which the socket's destructor sends with a blocking send, so
        # closing the monitor sooner would block libzmq's reaper thread (and every later
        # socket's destruction) until the context ends
        self._retiring: list[zmq.Socket] = []
        self._connect()

    @property
    def socket(self) -> zmq.Socket:
        if self._sock is None:
            raise ValueError(f"the connection to {self.url} is closed")
        return self._sock

    @property
    def monitor(self) -> zmq.Socket:
        return self._monitor

    def prepare(self) -> None:
        """Before a call: catch up with what happened while idle; a refused handshake gets a
        fresh attempt (zmq may not retry it)."""
        if self._sock is None:
            raise ValueError(f"the connection to {self.url} is closed")
        self.read_monitor(raise_failures=False)
        if self._refusal:
            self.reconnect()

    def receive_block(self, buffer: Any, size: int) -> tuple[BlockStatus, str]:
        """Receive the reply's next block frame, of declared `size`, straight into `buffer`
        (a pool slot); a frame missing or of another size is not OK (and the slot untouched
        where the size was known to differ)."""
        if not self._sock.get(_RCVMORE):
            return BlockStatus.FAILED, "the reply carries fewer block frames than it declares"
        if size != buffer.nbytes:
            self._sock.recv(copy=False)
            return BlockStatus.SIZE, (f"the store holds {size} B under this key; a pool slot "
                                      f"is {buffer.nbytes} B")
        received = self._sock.recv_into(buffer)  # the frame's full size, even when truncated
        if received != size:
            return BlockStatus.SIZE, f"block frame of {received} B where {size} B were declared"
        return BlockStatus.OK, ""

    def close(self) -> None:
        """Close the socket; frames not yet sent are dropped. The context is ended next (the
        lanes' close), which frees a reaper blocked on a retiring monitor closed here."""
        if self._sock is not None:
            _close_at_once(self._sock, self._monitor)
            self._sock = None
        for monitor in self._retiring:
            monitor.close(linger=0)
        self._retiring = []

    @property
    def lost(self) -> bool:
        """The store dropped this connection and it is not back (as of the last monitor read):
        the worker may be gone, or listen elsewhere after a restart."""
        return self._lost

    def send(self, request: Exchange, connect_by: float | None = None) -> None:
        """Send a request, its frames zero-copy; waits only while there is no live connection
        yet, StoreError at its deadline or at `connect_by` if sooner (a call's requests to
        several dead workers wait one deadline in all, not one each in turn)."""
        if callable(request.header):
            request.header = request.header()
        flags = _SNDMORE if request.frames else 0
        while True:
            try:  # poll only when the send cannot go at once (no live connection yet)
                self._sock.send(request.header, flags | _NOBLOCK)
                break
            except zmq.Again:
                self._wait_writable(request.deadline if connect_by is None
                                    else min(request.deadline, connect_by))
        # the rest of a multipart message never blocks: zmq admits messages whole
        for index, frame in enumerate(request.frames):
            more = _SNDMORE if index < len(request.frames) - 1 else 0
            request.trackers.append(self._sock.send(frame, more, copy=False, track=True))

    def receive_reply(self, pending: dict[int, Exchange], complete: Complete) -> None:
        """Read one reply: `complete` takes it (and its block frames) for its request, taken out
        of `pending`; StoreError where the connection can no longer be trusted."""
        try:
            reply = decode_reply(self._sock.recv())
        except ProtocolError as exc:
            raise StoreError(f"malformed reply from the store at {self.url}: {exc}") from None
        request = pending.pop(reply.request_id, None)
        try:
            if request is None and not reply.ok and reply.request_id is None:
                raise StoreError(f"the store could not read a request ({reply.code}): "
                                 f"{reply.error}")
            if request is None:
                return  # a reply to a request given up on
            if not reply.ok:
                request.error = f"the store refused the request ({reply.code}): {reply.error}"
            else:
                complete(self, request, reply)
        except ProtocolError as exc:
            request.error = f"malformed reply from the store at {self.url}: {exc}"
        finally:
            while self._sock.get(_RCVMORE):  # frames nobody read
                self._sock.recv(copy=False)

    def _wait_writable(self, deadline: float) -> None:
        """Until a send can go (a live connection); replies are read by the lane's poller."""
        self._poller.register(self._sock, _POLLOUT)
        while True:
            remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise StoreError(f"no connection to the store at {self.url} within the timeout")
            ready = dict(self._poller.poll(remaining_ms))
            if self._monitor in ready:
                self.read_monitor(raise_failures=True)
            if ready.get(self._sock, 0) & _POLLOUT:
                return

    def read_monitor(self, raise_failures: bool) -> None:
        """Handshakes and disconnects since the last look; StoreError for a lost connection or
        a refused handshake if `raise_failures`."""
        while self._monitor.poll(0):
            message = recv_monitor_message(self._monitor)
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected, self._refusal, self._lost = True, "", False
                continue
            if event == zmq.EVENT_MONITOR_STOPPED:  # the context is ending
                continue
            if event == zmq.EVENT_DISCONNECTED:
                lost, self._connected = self._connected, False
                self._lost = self._lost or lost
                if lost and raise_failures:
                    raise StoreError(f"lost the connection to the store at {self.url}")
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refusal = (f"the store at {self.url} refused this client's credentials "
                                 f"(authentication failed, ZAP status {int(value)})")
            else:
                self._refusal = (f"security handshake with the store at {self.url} failed "
                                 f"({zmq.Event(event).name}): do both sides use the same "
                                 f"security mode and keys?")
            if raise_failures:
                raise StoreError(self._refusal)

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        monitor = None
        try:
            sock.linger = 0
            sock.immediate = 1
            # libzmq gives a new connection the least loaded IO thread by a count it updates
            # later: connections made at once can share one (and halve their speed), so each
            # lane names its own
            sock.affinity = 1 << self._io_thread
            sock.maxmsgsize = self._max_frame_bytes
            self._security.apply_client(sock, self.url)
            # an address of its own: pyzmq's default names the socket's fd, which the next
            # socket may reuse while libzmq still tears down the old one's monitor
            monitor = sock.get_monitor_socket(
                _MONITOR_EVENTS, f"inproc://kvconnector.monitor.{next(_monitor_ids)}")
            sock.connect(self.url)
        except Exception:
            _close_at_once(sock, monitor)
            raise
        self._sock, self._monitor = sock, monitor
        self._connected, self._refusal, self._lost = False, "", False
        self._poller = zmq.Poller()
        self._poller.register(self._monitor, _POLLIN)

    def reconnect(self) -> bool:
        """Drop the socket (unsent frames are discarded) and connect a fresh one. True once
        libzmq has destroyed the old socket, its pipes, sessions and engines: nothing reads a
        frame sent on it any more, even one whose tracker never finishes (libzmq drops the
        parts already queued of a multipart message whose connection ends mid-message without
        releasing them: one cut in about 150 left a put's slot pinned for good). False after
        _DESTROY_WAIT_S: the old socket's slots then stay pinned."""
        destroyed = False
        if self._sock is not None:
            closed = self._monitor
            self._retiring.append(closed)
            self._sock.close(linger=0)
            self._sock = None
            retiring = []
            for monitor in self._retiring:
                if _destroyed(monitor, _DESTROY_WAIT_S if monitor is closed else 0.0):
                    monitor.close(linger=0)
                    destroyed |= monitor is closed
                else:
                    retiring.append(monitor)
            self._retiring = retiring
        self._connect()
        return destroyed


def _close_at_once(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a socket and its monitor without waiting for libzmq to destroy the socket: the
    monitor is stopped first (its last event sent now, while the monitor is open)."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)


def _destroyed(monitor: zmq.Socket, wait_s: float) -> bool:
    """Whether the closed socket `monitor` watches is destroyed, waiting up to `wait_s`: its
    monitor's last event (EVENT_MONITOR_STOPPED) is sent by the socket's destructor, which runs
    once every session (and so every engine and pipe) of the socket is gone."""
    deadline = time.monotonic() + wait_s
    while monitor.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_MONITOR_STOPPED:
            return True
    return False
