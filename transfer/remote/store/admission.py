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

What the store holds for a peer beyond that counts too: the store reports each reply large
enough to matter (`replying`, `replied`: get replies, and headers of TRACKED_REPLY_BYTES or
more), held until zmq has written it out, and each put being checked on the verifier threads
(`checking`, `checked`). Smaller replies are bounded by the send high-water mark.

A connection that makes no progress for `stall_timeout_s` while the store holds something for
it (a message begun, answers it does not read) is dropped, whatever the budget. No more than
`max_peers` connections are kept (newer ones are shut down at once), so the store does not run
out of descriptors and each check stays short; and the guard reads the connections'
descriptors in place (no duplicate), so it keeps counting them if descriptors do run out.
"""

from __future__ import annotations

import fcntl
import logging
import resource
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from transfer.remote.store.protocol import Limits

log = logging.getLogger(__name__)

# ROUTER socket options (docs/protocol.md, "Limits"): complete requests zmq queues per
# connection before it stops reading that connection (the store reads them in turn), and replies
# it queues for one before the store drops further replies (a client has 8 requests in flight)
RECEIVE_HWM = 4
SEND_HWM = 32
# Replies with blocks, or with a header of this size or more, are tracked until zmq has written
# them and count as held by their peer; smaller ones are bounded by SEND_HWM per connection.
TRACKED_REPLY_BYTES = 4096
# what zmq and pyzmq keep per frame of a reply being sent (measured: ~1.4 KiB per tracked
# zero-copy frame, the tracker included; ~75 B per copied frame beside its bytes)
FRAME_MEMORY_BYTES = 1536
COPIED_FRAME_BYTES = 128
# connections kept (each worker); newer ones are shut down at once. Each costs a descriptor, tens
# of KiB in zmq and ~20 us of every check.
DEFAULT_MAX_PEERS = 1024
# descriptors the store keeps for itself beyond its connections (zmq's, the log, pipes)
RESERVED_FDS = 64
# a connection that holds something (a message begun, answers unread) and makes no progress for
# this long is dropped; what it has sent of a message counts from this many bytes (the handshake
# of any security mode is less)
STALL_TIMEOUT_S = 10.0
STALL_ALLOWANCE_BYTES = 4096
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
_TCPI_BYTES = struct.Struct("<QQ")  # bytes_acked, bytes_received
_TCPI_BYTES_OFFSET = 120  # struct tcp_info, Linux >= 4.1
_OUTQ = struct.Struct("i")
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


def peer_limit(max_peers: int | None = None) -> int:
    """Connections a store keeps: `max_peers` (default DEFAULT_MAX_PEERS), and no more than the
    descriptors this process may open leave beside RESERVED_FDS; the soft limit on descriptors
    is raised (up to the hard one) to make room for them. ValueError for a bad `max_peers`."""
    if max_peers is None:
        max_peers = DEFAULT_MAX_PEERS
    if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
        raise ValueError(f"max_peers must be an int >= 1, got {max_peers!r}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_peers + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_peers
    return max(1, min(max_peers, soft - RESERVED_FDS))


@dataclass(eq=False)
class _Peer:
    """One TCP connection, by the file descriptor zmq reads it from."""

    fd: int
    address: tuple[str, int] | None = None  # the remote end, to notice a reused descriptor
    identity: bytes | None = None  # the ROUTER's routing id, once a message came
    received: int = 0  # the kernel's byte count when it last completed a message
    delivered: int = 0  # complete messages read from it
    seen: int = 0  # `delivered` at the last check
    held: int = 0  # bytes sent since its last complete message, and its replies not yet written
    strikes: int = 0
    last_received: int = 0  # the kernel's counts at the last check
    last_acked: int = 0
    # when its requests and its replies last moved (or the store held nothing for them)
    received_at: float = 0.0
    acked_at: float = 0.0


class PeerGuard:
    """Tracks the store's connections (fed by the serving thread; not thread-safe)."""

    def __init__(self, budget_bytes: int, max_strikes: int = MAX_STRIKES, *,
                 max_peers: int = DEFAULT_MAX_PEERS,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise ValueError(f"max_peers must be an int >= 1, got {max_peers!r}")
        if isinstance(stall_timeout_s, bool) or not isinstance(stall_timeout_s, (int, float)) \
                or not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be a positive number, got "
                             f"{stall_timeout_s!r}")
        self.budget_bytes = budget_bytes
        self.max_strikes = max_strikes
        self.max_peers = max_peers
        self.stall_timeout_s = float(stall_timeout_s)
        self.dropped_peers = 0
        self.stalled_peers = 0  # of the dropped: no progress for stall_timeout_s
        self.refused_peers = 0  # connections shut down at once: max_peers were connected
        self._invalid_peers = 0  # peers that sent an invalid request (the log has 1, 2, 4, ...)
        self.interval_s = CHECK_INTERVAL_S  # until the next check
        self._peers: dict[int, _Peer] = {}
        self._dropped_ids: deque[bytes] = deque(maxlen=_RECENTLY_DROPPED)
        # routing id -> bytes of its replies zmq holds; of its puts being checked
        self._replies: dict[bytes, int] = {}
        self._checking: dict[bytes, int] = {}

    @property
    def peers(self) -> int:
        return len(self._peers)

    @property
    def held_bytes(self) -> int:
        """What zmq held for all connections at the last check."""
        return sum(peer.held for peer in self._peers.values())

    @property
    def pending_bytes(self) -> int:
        """The tracked replies zmq has not written yet and the puts being checked (all peers,
        the dropped included)."""
        return sum(self._replies.values()) + sum(self._checking.values())

    def connection_event(self, event: int, fd: int) -> bool:
        """A monitor event: a connection accepted on `fd` (a reused descriptor starts afresh;
        past `max_peers` it is shut down at once) or closed; False for any other event."""
        if event == zmq.EVENT_ACCEPTED:
            address = _remote(fd)
            self._peers.pop(fd, None)  # a reused descriptor: that connection is gone
            if len(self._peers) >= self.max_peers:
                self.refused_peers += 1
                if self.refused_peers & (self.refused_peers - 1) == 0:  # 1, 2, 4, ...
                    log.warning("refused a connection from %s: %d connections are the limit "
                                "(%d refused so far)", _address(address), self.max_peers,
                                self.refused_peers)
                _shutdown(fd, address)
            else:
                now = time.monotonic()
                self._peers[fd] = _Peer(fd, address, received_at=now, acked_at=now)
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

    def replying(self, identity: bytes, nbytes: int) -> None:
        """A tracked reply of about `nbytes` of memory went to zmq for peer `identity`."""
        _add(self._replies, identity, nbytes)

    def replied(self, identity: bytes, nbytes: int) -> None:
        """zmq is done with a tracked reply (written out, or dropped with its connection)."""
        _add(self._replies, identity, -nbytes)

    def checking(self, identity: bytes, nbytes: int) -> None:
        """A put of `nbytes` of blocks from peer `identity` waits for its checksums."""
        _add(self._checking, identity, nbytes)

    def checked(self, identity: bytes, nbytes: int) -> None:
        _add(self._checking, identity, -nbytes)

    def strike(self, fd: int, identity: bytes, why: str) -> bool:
        """The peer sent an invalid request; True when this one got it dropped."""
        peer = self._peers.get(fd)
        if peer is None or peer.identity != identity:
            return False
        peer.strikes += 1
        if peer.strikes == 1:
            self._invalid_peers += 1
            if self._invalid_peers & (self._invalid_peers - 1) == 0:  # 1, 2, 4, ...
                log.warning("peer %s sent an invalid request: %s (%d peers so far)",
                            _name(peer), why, self._invalid_peers)
        if peer.strikes < self.max_strikes:
            return False
        self._drop(peer, f"{peer.strikes} invalid requests (the last: {why})")
        return True

    def check(self) -> int:
        """Account each connection's bytes; drop those that stalled holding something, then
        the largest holders while over the budget. Returns how many were dropped."""
        started = time.thread_time()
        now = time.monotonic()
        dropped = 0
        for peer in list(self._peers.values()):
            counts = _tcp_counts(peer.fd, peer.address)
            if counts is None:  # gone, or the descriptor now names another connection
                self._peers.pop(peer.fd, None)
                continue
            received, acked, queued = counts
            # each direction must move while the store holds something for it: a peer that
            # goes on sending requests but reads no replies stalls all the same
            if received != peer.last_received or peer.delivered != peer.seen:
                peer.received_at = now
            if acked != peer.last_acked:
                peer.acked_at = now
            peer.last_received, peer.last_acked = received, acked
            if peer.delivered != peer.seen:  # it completed messages: zmq holds less now
                peer.seen, peer.received = peer.delivered, received
            incoming = received - peer.received
            replies = self._replies.get(peer.identity, 0)
            peer.held = incoming + replies + self._checking.get(peer.identity, 0)
            if incoming <= STALL_ALLOWANCE_BYTES:
                peer.received_at = now
            if not (replies or queued):
                peer.acked_at = now
            stalled = now - min(peer.received_at, peer.acked_at)
            if stalled > self.stall_timeout_s:
                self.stalled_peers += 1
                self._drop(peer, f"no progress for {stalled:.1f} s while the store holds "
                                 f"{incoming} B of a message begun and {replies} B of replies "
                                 f"for it ({queued} B in the kernel's send queue)")
                dropped += 1
        total = self.held_bytes
        while total > self.budget_bytes:
            peer = max(self._peers.values(), key=lambda p: p.held)
            total -= peer.held
            self._drop(peer, f"{peer.held} B held for it (a request begun, replies unread); "
                             f"zmq held {total + peer.held} B for all peers, over the "
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


def _add(ledger: dict[bytes, int], identity: bytes, nbytes: int) -> None:
    left = ledger.get(identity, 0) + nbytes
    if left > 0:
        ledger[identity] = left
    else:
        ledger.pop(identity, None)


def _address(address: tuple[str, int] | None) -> str:
    return f"{address[0]}:{address[1]}" if address else "?"


def _name(peer: _Peer) -> str:
    return f"{_address(peer.address)} (fd {peer.fd})"


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """zmq's socket `fd` as a Python socket, in place: a duplicate would need a descriptor, and
    a store out of descriptors lost count of its connections. None if `fd` is not a socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()  # never closed here: the descriptor stays zmq's


def _remote(fd: int) -> tuple[str, int] | None:
    with _borrowed(fd) as sock:
        if sock is None:
            return None
        try:
            return sock.getpeername()[:2]
        except OSError:
            return None


def _tcp_counts(fd: int, address: tuple[str, int] | None) -> tuple[int, int, int] | None:
    """The kernel's counts for `fd`: bytes received, bytes the peer acknowledged and bytes in
    the send queue; None when `fd` is closed or now names another connection."""
    with _borrowed(fd) as sock:
        if sock is None:
            return None
        try:
            if sock.getpeername()[:2] != address:
                return None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            queued = _OUTQ.unpack(fcntl.ioctl(fd, termios.TIOCOUTQ, bytes(_OUTQ.size)))[0]
        except OSError:
            return None
    if len(info) < _TCPI_BYTES_OFFSET + _TCPI_BYTES.size:
        return 0, 0, 0  # a kernel without the counters: only strikes and replies apply
    acked, received = _TCPI_BYTES.unpack_from(info, _TCPI_BYTES_OFFSET)
    return received, acked, queued


def _shutdown(fd: int, address: tuple[str, int] | None) -> None:
    """End the TCP connection under zmq, unless `fd` names another connection by now."""
    with _borrowed(fd) as sock:
        if sock is None:
            return
        try:
            if sock.getpeername()[:2] == address:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
