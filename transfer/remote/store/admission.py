"""Peer accounting for the store: what zmq holds for each connection, and who gets dropped.

zmq bounds what it buffers for a connection only in whole messages (the receive high-water mark)
and each frame's size (ZMQ_MAXMSGSIZE); a multipart message still being received is held, frame
by frame, with no limit at all, and the store cannot see it before it is complete. So the store
watches each connection's TCP counters instead: `PeerGuard.check` reads the kernel's count of
bytes received on every connection (TCP_INFO, through the file descriptor zmq's monitor names
at accept) and compares it with the bytes of the complete messages the store has read from
that connection since. What a connection has sent beyond that is what zmq (and the kernel's
socket buffer) holds for it; while the sum over all connections exceeds `budget_bytes`, the
connection holding the most is dropped. A peer that keeps sending invalid requests is dropped
too (`strike`). Dropping shuts the TCP connection down under zmq: zmq frees what it held for it
(a half-received message included) and the peer sees a disconnect.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass

import zmq

from transfer.remote.store.protocol import Limits

log = logging.getLogger(__name__)

# ROUTER socket options (docs/protocol.md, "Limits"): complete requests zmq queues per
# connection before it stops reading that connection (the store reads them in turn)
RECEIVE_HWM = 4
# invalid requests (refused whole, or a put frame of another size than declared) a connection
# may send before it is dropped; the reference client never sends one
MAX_STRIKES = 16
# How often the byte accounting runs (what arrives in between may pass the budget): every 10 ms,
# or with many connections (~20 us each) so that it takes at most a fifth of the serving thread's
# CPU time. The share is counted in the thread's CPU time, not wall time: on a busy machine the
# thread may wait for a core in the middle of a check, and that wait must not postpone the next
# one (it did, five-fold: a check preempted for 0.25 s put the next 1.2 s away while a flood went
# on arriving).
CHECK_INTERVAL_S = 0.01
_CHECK_SHARE = 0.2
_TCPI_BYTES_RECEIVED = struct.Struct("<Q")
_TCPI_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info, Linux >= 4.1
_TCP_INFO_BYTES = 256
_RECENTLY_DROPPED = 4096  # routing ids remembered, so their queued messages are discarded
# the budget is at least this and room for four of the largest requests (docs/protocol.md)
MIN_BUDGET_BYTES = 256 << 20
# the monitor events the guard needs (each names the connection's file descriptor)
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def buffer_budget(limits: Limits, budget_bytes: int | None = None) -> int:
    """The budget for what zmq holds: `budget_bytes`, by default the larger of
    MIN_BUDGET_BYTES and four of the largest requests; ValueError below one of them."""
    if budget_bytes is None:
        return max(MIN_BUDGET_BYTES, 4 * limits.max_request_bytes)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
            or budget_bytes < limits.max_request_bytes:
        raise ValueError(f"buffer_budget_bytes must be an int of at least the largest request "
                         f"({limits.max_request_bytes} B), got {budget_bytes!r}")
    return budget_bytes


@dataclass(eq=False)
class _Peer:
    """One TCP connection, by the file descriptor zmq reads it from."""

    fd: int
    address: tuple[str, int] | None = None  # the remote end, to notice a reused descriptor
    identity: bytes | None = None  # the ROUTER's routing id, once a message came
    received: int = 0  # the kernel's byte count when it was last seen making progress
    delivered: int = 0  # complete messages read from it
    seen: int = 0  # `delivered` at the last check
    held: int = 0  # bytes sent since its last complete message: what zmq holds for it
    strikes: int = 0


class PeerGuard:
    """Tracks the store's connections (fed by the serving thread; not thread-safe)."""

    def __init__(self, budget_bytes: int, max_strikes: int = MAX_STRIKES) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.max_strikes = max_strikes
        self.dropped_peers = 0
        self.interval_s = CHECK_INTERVAL_S  # until the next check
        self._peers: dict[int, _Peer] = {}
        self._dropped_ids: deque[bytes] = deque(maxlen=_RECENTLY_DROPPED)

    @property
    def peers(self) -> int:
        return len(self._peers)

    @property
    def held_bytes(self) -> int:
        """What zmq held for all connections at the last check."""
        return sum(peer.held for peer in self._peers.values())

    def connection_event(self, event: int, fd: int) -> bool:
        """A monitor event: a connection accepted on `fd` (a reused descriptor starts afresh)
        or closed; False for any other event."""
        if event == zmq.EVENT_ACCEPTED:
            self._peers[fd] = _Peer(fd, _remote(fd))
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            self._peers.pop(fd, None)
        else:
            return False
        return True

    def delivered(self, fd: int, identity: bytes) -> bool:
        """A complete message came from connection `fd` with routing id `identity`; False when
        that peer was dropped (its queued messages are discarded unread)."""
        if identity in self._dropped_ids:
            return False
        peer = self._peers.get(fd)
        if peer is not None:
            peer.delivered += 1
            peer.identity = identity
        return True

    def strike(self, fd: int, identity: bytes, why: str) -> bool:
        """The peer sent an invalid request; True when this one got it dropped."""
        peer = self._peers.get(fd)
        if peer is None or peer.identity != identity:
            return False
        peer.strikes += 1
        if peer.strikes == 1:
            log.warning("peer %s sent an invalid request: %s", _name(peer), why)
        if peer.strikes < self.max_strikes:
            return False
        self._drop(peer, f"{peer.strikes} invalid requests (the last: {why})")
        return True

    def check(self) -> int:
        """Account each connection's bytes; drop the largest holders while over the budget.
        Returns how many were dropped."""
        started = time.thread_time()
        for peer in list(self._peers.values()):
            received = _bytes_received(peer.fd, peer.address)
            if received is None:  # gone, or the descriptor now names another connection
                self._peers.pop(peer.fd, None)
                continue
            if peer.delivered != peer.seen:  # it completed messages: zmq holds less now
                peer.seen, peer.received, peer.held = peer.delivered, received, 0
            else:
                peer.held = received - peer.received
        dropped = 0
        total = self.held_bytes
        while total > self.budget_bytes:
            peer = max(self._peers.values(), key=lambda p: p.held)
            total -= peer.held
            self._drop(peer, f"{peer.held} B sent without completing a request; zmq held "
                             f"{total + peer.held} B for all peers, over the "
                             f"{self.budget_bytes} B budget")
            dropped += 1
        self.interval_s = max(CHECK_INTERVAL_S, (time.thread_time() - started) / _CHECK_SHARE)
        return dropped

    def _drop(self, peer: _Peer, why: str) -> None:
        self._peers.pop(peer.fd, None)
        if peer.identity is not None:
            self._dropped_ids.append(peer.identity)
        self.dropped_peers += 1
        log.warning("dropped peer %s: %s", _name(peer), why)
        _shutdown(peer.fd, peer.address)


def _name(peer: _Peer) -> str:
    address = f"{peer.address[0]}:{peer.address[1]}" if peer.address else "?"
    return f"{address} (fd {peer.fd})"


def _dup(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves zmq's open
    except OSError:
        return None


def _remote(fd: int) -> tuple[str, int] | None:
    sock = _dup(fd)
    if sock is None:
        return None
    with sock:
        try:
            return sock.getpeername()[:2]
        except OSError:
            return None


def _bytes_received(fd: int, address: tuple[str, int] | None) -> int | None:
    """The kernel's count of bytes received on `fd`, or None when `fd` is closed or now names
    another connection."""
    sock = _dup(fd)
    if sock is None:
        return None
    with sock:
        try:
            if sock.getpeername()[:2] != address:
                return None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
    if len(info) < _TCPI_BYTES_RECEIVED_OFFSET + _TCPI_BYTES_RECEIVED.size:
        return 0  # a kernel without the counter: only strikes apply
    return _TCPI_BYTES_RECEIVED.unpack_from(info, _TCPI_BYTES_RECEIVED_OFFSET)[0]


def _shutdown(fd: int, address: tuple[str, int] | None) -> None:
    """End the TCP connection under zmq, unless `fd` names another connection by now."""
    sock = _dup(fd)
    if sock is None:
        return
    with sock:
        try:
            if sock.getpeername()[:2] == address:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
