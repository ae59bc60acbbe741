"""The shared pool's daemon: owns the segment and the index, answers its clients.

One thread, one `selectors` loop: requests are short (index work only: writers send their
blocks' checksums with the commit, readers check them), so clients are served in turn. Every
client is a unix-socket connection of this uid; its lease goes with the connection
(SharedBlockIndex.release on EOF or any error).

Any client may be hostile or buggy (a same-uid process with a bug), and none may stop the loop
or hold what others need for long; the bounds are PoolLimits':
- connections: at most `max_clients` (1024; fewer where RLIMIT_NOFILE leaves less than that
  plus FD_RESERVE, the soft limit raised to fit them where the hard one allows); one more is
  told why and closed at once. An accept() that fails (EMFILE, ENFILE, ECONNABORTED, ...) is
  survived: out of descriptors, the connections waiting are closed through a spare descriptor
  (their clients hear at once) and accepting pauses for ACCEPT_PAUSE_S.
- input: a request is read only once its whole frame is there (msgpack's `skip` finds where it
  ends; nothing is built from a partial frame) and is unpacked by protocol.read_request, at most
  `max_request_bytes`; unfinished requests hold at most `max_pending_bytes` of all clients
  together (past it the largest is dropped), and one begun must be whole within
  `partial_timeout_s`. A connection says hello within `hello_timeout_s`, and once.
- output: answers are sent without blocking; while a client's answer is unsent the daemon reads
  nothing more from it, unsent answers hold at most `max_unsent_bytes` together (past it the
  largest goes), and a client that leaves an answer unread for `reply_timeout_s` is dropped.
- unpins: a finished load's notice of over UNPIN_SLICE distinct keys, all bytes (each at most
  MAX_KEY_BYTES: at most MAX_QUEUED_UNPINS of them held), is applied UNPIN_SLICE keys a turn of
  the loop, so a commit another engine sends meanwhile waits for one slice, not the whole (a
  3276-key unpin held a commit 1.5-2.6 ms on an H200 host); any other notice is applied at once.
  A client's later verbs see its unpins applied, a store's placement sees every unpin received
  (room), and past MAX_QUEUED_UNPINS keys queued every one is applied at once.
- errors: a client whose request or notice is malformed is dropped (its lease released), one
  whose request is refused gets `[False, why]`; texts and log lines quote at most a short
  prefix of a bad value (protocol.brief), and log lines are rate-limited.

Start: a live daemon of the same name is refused; a stale socket or segment (a killed daemon's)
is removed first. Each start makes a segment with a new name, so an engine that mapped the old
one never mistakes its slots for the new daemon's. Stop (SIGINT/SIGTERM, or `stop()`): the socket
and the segment's name go; engines that mapped it keep their mapping until they unmap.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import secrets
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from kvconnector.layout.allocator import (
    SHM_DIR,
    SlotBuffer,
    allocate_slots,
    slot_stride,
    slots_in,
    unlink_shared,
)
from transfer.shared import protocol as p
from transfer.shared.index import SharedBlockIndex

log = logging.getLogger("kvconnector.pool")

FD_RESERVE = 32  # descriptors besides the clients': listener, spare, selector, log, imports
READ_BYTES = 256 << 10  # one recv
SCAN_BYTES = 16 << 10  # fed to a client's frame scanner at a time: its buffer stays this small
TICK_S = 0.2  # the loop wakes at least this often to check deadlines
ACCEPT_PAUSE_S = 0.1  # after an accept() failed for want of descriptors or memory
LOG_BURST = 20  # warnings per LOG_WINDOW_S; the rest are counted and summed up
LOG_WINDOW_S = 10.0
UNPIN_SLICE = 512  # keys of a queued unpin applied per turn of the loop
MAX_QUEUED_UNPINS = 1 << 16  # keys queued in all (bounds what a flood of notices holds)
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class PoolLimits:
    """What the daemon gives one client and all of them (see module doc). The defaults hold
    any engine's traffic with a wide margin; tests shorten the timeouts."""

    max_clients: int = 1024
    max_request_bytes: int = p.MAX_REQUEST_BYTES
    max_pending_bytes: int = 32 << 20
    max_unsent_bytes: int = 64 << 20
    reply_timeout_s: float = 20.0
    partial_timeout_s: float = 20.0
    hello_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"PoolLimits.{name} must be a positive number, got {value!r}")


def connection_cap(wanted: int) -> int:
    """Connections this process can hold: `wanted`, or fewer when RLIMIT_NOFILE's hard limit
    leaves less than `wanted` + FD_RESERVE (the soft limit is raised to fit when it can)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FD_RESERVE))


class _Gone(Exception):
    """The client closed its end (or it broke): dropped without a warning."""


class _Client:
    def __init__(self, sock: socket.socket, client_id: int, pid: int, now: float,
                 limits: PoolLimits) -> None:
        self.sock = sock
        self.id = client_id
        self.pid = pid
        self.max_request_bytes = limits.max_request_bytes
        self.frames = self.scanner()
        self.pending = bytearray()  # bytes received and not yet handled
        self.offset = 0  # the stream offset of pending[0] (frames.tell() counts from it)
        self.scanned = 0  # bytes of `pending` fed to `frames`
        self.unsent: memoryview | None = None  # the rest of an answer the client has not read
        self.events = selectors.EVENT_READ
        self.greeted = False
        self.connected_at = now
        self.partial_since: float | None = None  # a request begun and not yet whole
        self.unsent_since: float | None = None
        self.closed = False

    def scanner(self) -> msgpack.Unpacker:
        """Finds where each request ends (`skip` builds nothing), so a partial frame costs
        only its bytes, kept in `pending` until it is whole."""
        self.offset = 0
        return msgpack.Unpacker(max_buffer_size=self.max_request_bytes + SCAN_BYTES,
                                read_size=SCAN_BYTES)


class PoolDaemon:
    """Serves pool `name`: `capacity` bytes of `slot_bytes` slots (see module doc)."""

    def __init__(self, name: str, capacity: int, slot_bytes: int, *, policy: str = "lru",
                 directory: Path | None = None, limits: PoolLimits | None = None) -> None:
        self.name = p.check_name(name)
        self.limits = limits or PoolLimits()
        self.path = p.socket_path(name, directory)
        self.owner = os.geteuid()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        self._remove_stale()
        segment = p.segment_prefix(name) + secrets.token_hex(8)
        # the engines give the slots' bytes meaning: the segment is slots of a size, page-aligned
        num_slots = slots_in(capacity, slot_bytes)
        if num_slots == 0:
            raise ValueError(f"capacity {capacity} B holds no slot of {slot_bytes} B (slots are "
                             f"{slot_stride(slot_bytes)} B apart)")
        self.buffer: SlotBuffer = allocate_slots(num_slots, slot_bytes, shared_name=segment)
        self.info = p.PoolInfo(segment, num_slots, slot_bytes)
        self.index = SharedBlockIndex(self.info.num_slots, slot_bytes, policy)
        self.max_clients = connection_cap(self.limits.max_clients)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)  # the socket is created 0600
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old_mask)
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._accepting_after: float | None = None  # accepting paused until then
        self._spare: int | None = _open_spare()  # closed to shed a connection without fds
        self._clients: dict[int, _Client] = {}
        self._next_id = 0
        self._running = True
        self._pending_bytes = 0  # every client's `pending`
        # unpins not yet applied, in arrival order: [client, keys, keys applied so far]
        self._unpins: deque[list[Any]] = deque()
        self._queued_unpins = 0  # their keys not yet applied
        self._unsent_bytes = 0  # every client's `unsent`
        self._next_expiry = 0.0
        self._log_window = (0.0, 0)  # (start, warnings in it)
        self._log_suppressed = 0
        self.refused = 0  # connections of another uid
        self.refused_busy = 0  # connections over max_clients or without a descriptor
        self.dropped = 0  # clients dropped for what they sent or left unread
        self.accept_errors = 0

    def _remove_stale(self) -> None:
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # nobody listens: a killed daemon's
            else:
                raise ValueError(f"a pool daemon already serves {self.name!r} at {self.path}")
            finally:
                probe.close()
        prefix = p.segment_prefix(self.name)
        for entry in os.scandir(SHM_DIR):
            if entry.name.startswith(prefix) and entry.stat().st_uid == self.owner:
                unlink_shared(entry.name)

    # ---- the loop ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while self._running:
                timeout = 0.0 if self._unpins else TICK_S
                for key, events in self._selector.select(timeout=timeout):
                    if key.data is None:
                        self._accept()
                    elif not key.data.closed:  # one dropped earlier in this round is gone
                        self._serve(key.data, events)
                self._unpin_slice()
                self._expire(time.monotonic())
        finally:
            self.close()

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._running = False

    # ---- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, then the clients' turn
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            try:
                self._admit(sock)
            except Exception as exc:  # e.g. the peer went before we looked at it
                sock.close()
                self._warn(f"a connection lost while admitted: {type(exc).__name__}: {exc}")

    def _accept_failed(self, exc: OSError) -> None:
        self.accept_errors += 1
        if exc.errno in _OUT_OF_RESOURCES:
            # Connections wait in the backlog: close some through the spare descriptor (their
            # clients hear at once), and pause accepting so the loop serves those it has.
            self._shed_waiting()
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._accepting_after = time.monotonic() + ACCEPT_PAUSE_S
        self._warn(f"accept failed: {exc} ({self.accept_errors} so far)")

    def _shed_waiting(self) -> None:
        if self._spare is None:
            self._spare = _open_spare()
            return
        os.close(self._spare)
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except OSError:
                break
            self.refused_busy += 1
            sock.close()
        self._spare = _open_spare()

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, _ = p.peer_credentials(sock)
        try:
            p.check_peer(uid, self.owner)
        except PermissionError as exc:
            self.refused += 1
            self._warn(f"refused a connection: {exc}")
            _refuse(sock, str(exc))
            return
        if len(self._clients) >= self.max_clients:
            self.refused_busy += 1
            self._warn(f"refused a connection of pid {pid}: {self.max_clients} clients connected")
            _refuse(sock, f"the pool daemon serves its maximum of {self.max_clients} "
                          f"connections: try again later")
            return
        sock.setblocking(False)
        client = _Client(sock, self._next_id, pid, time.monotonic(), self.limits)
        self._next_id += 1
        self._clients[client.id] = client
        self._selector.register(sock, selectors.EVENT_READ, client)

    def _drop(self, client: _Client, why: str | None = None) -> None:
        """Close the connection and release its lease; `why`: a warning for the log."""
        if client.closed:
            return
        client.closed = True
        self._take_unpins(client)  # forgotten: release drops all its pins
        self._pending_bytes -= len(client.pending)
        self._unsent_bytes -= 0 if client.unsent is None else len(client.unsent)
        client.pending = bytearray()
        client.unsent = None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        client.sock.close()
        del self._clients[client.id]
        try:
            self.index.release(client.id)
        except Exception as exc:  # a bug: say so, keep serving the others
            log.error("pool %s: releasing client %d's lease failed: %s", self.name, client.id,
                      p.clip(repr(exc)))
        if why is not None:
            self.dropped += 1
            self._warn(f"client {client.id} (pid {client.pid}) dropped: {why}")

    def _expire(self, now: float) -> None:
        """Drop the clients past a deadline; resume accepting after a pause."""
        if self._accepting_after is not None and now >= self._accepting_after:
            self._accepting_after = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        if now < self._next_expiry:
            return
        self._next_expiry = now + TICK_S
        limits = self.limits
        for client in list(self._clients.values()):
            if client.unsent_since is not None:
                if now - client.unsent_since > limits.reply_timeout_s:
                    self._drop(client, f"left an answer unread for {limits.reply_timeout_s} s")
            elif client.partial_since is not None:
                if now - client.partial_since > limits.partial_timeout_s:
                    self._drop(client, f"sent {len(client.pending)} B of a request and not the "
                                       f"rest within {limits.partial_timeout_s} s")
            elif not client.greeted and now - client.connected_at > limits.hello_timeout_s:
                self._drop(client, f"no hello within {limits.hello_timeout_s} s")

    # ---- one client's traffic ----------------------------------------------------------------

    def _serve(self, client: _Client, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(client)
                self._take_requests(client)  # those that waited for the answer to go
            if events & selectors.EVENT_READ and client.unsent is None and not client.closed:
                self._receive(client)
        except (_Gone, ConnectionError):
            self._drop(client)
        except Exception as exc:  # anything a client sent: it goes, the loop and the rest stay
            self._drop(client, p.clip(f"{type(exc).__name__}: {exc}"))

    def _receive(self, client: _Client) -> None:
        try:
            data = client.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise _Gone
        client.pending += data
        self._pending_bytes += len(data)
        self._take_requests(client)
        if client.unsent is None and len(client.pending) > self.limits.max_request_bytes:
            raise ValueError(f"a request over {self.limits.max_request_bytes} B")
        while self._pending_bytes > self.limits.max_pending_bytes and self._clients:
            largest = max(self._clients.values(), key=lambda c: len(c.pending))
            self._drop(largest, f"the daemon holds {self._pending_bytes} B of unfinished "
                                f"requests, over its {self.limits.max_pending_bytes} B: this "
                                f"client's {len(largest.pending)} B are the most")

    def _take_requests(self, client: _Client) -> None:
        """Handle each whole request received, in order, until one's answer waits unsent."""
        progress = False
        while client.unsent is None and not client.closed:
            try:
                client.frames.skip()
            except msgpack.OutOfData:
                if client.scanned == len(client.pending):
                    break
                end = min(len(client.pending), client.scanned + SCAN_BYTES)
                with memoryview(client.pending) as view:
                    try:
                        client.frames.feed(view[client.scanned:end])
                    except msgpack.BufferFull:
                        raise ValueError(f"a request over {self.limits.max_request_bytes} "
                                         f"B") from None
                client.scanned = end
                continue
            size = client.frames.tell() - client.offset
            frame = bytes(client.pending[:size])
            del client.pending[:size]  # a prefix: O(1) for a bytearray
            client.offset += size
            client.scanned -= size
            self._pending_bytes -= size
            progress = True
            self._handle(client, frame)
        if client.closed:
            return
        if not client.pending:
            client.partial_since = None
            if client.offset > 4 * SCAN_BYTES:  # all handled: a fresh scanner, a small buffer
                client.frames = client.scanner()
        elif progress or client.partial_since is None:
            client.partial_since = time.monotonic()

    def _handle(self, client: _Client, frame: bytes) -> None:
        # Malformed: ValueError, the client is dropped.
        verb, args = p.read_request(frame, self.limits.max_request_bytes)
        if not client.greeted and verb != p.HELLO:
            raise ValueError(f"{verb!r} before hello")
        if verb == p.COMPLETE_LOAD and isinstance(args[0], list | tuple) \
                and len(args[0]) > UNPIN_SLICE:
            self._queue_unpin(client, args[0])
            return
        # what this client unpinned first; a store's placement after every unpin received
        self._apply_unpins(None if verb == p.PREPARE_STORES else client)
        if client.closed:  # one of its unpins was malformed
            return
        if verb in p.NOTICES:
            self._notice(client.id, verb, args)  # a bad notice drops the client (ValueError)
            return
        try:
            reply = [True, self._request(client, verb, args)]
        except (ValueError, TypeError) as exc:
            reply = [False, p.clip(f"{verb}: {exc}")]
        self._answer(client, verb, reply)

    def _answer(self, client: _Client, verb: str, reply: list[Any]) -> None:
        data = msgpack.packb(reply)
        if len(data) > p.MAX_MESSAGE_BYTES:
            data = msgpack.packb([False, f"{verb}: an answer of {len(data)} B is over the "
                                         f"limit of {p.MAX_MESSAGE_BYTES} B: ask for less"])
        client.unsent = memoryview(data)
        self._unsent_bytes += len(data)
        self._flush(client)
        while self._unsent_bytes > self.limits.max_unsent_bytes and self._clients:
            largest = max(self._clients.values(),
                          key=lambda c: 0 if c.unsent is None else len(c.unsent))
            self._drop(largest, f"the daemon holds {self._unsent_bytes} B of unread answers, "
                                f"over its {self.limits.max_unsent_bytes} B: this client's are "
                                f"the most")

    def _flush(self, client: _Client) -> None:
        """Send what the socket takes now; wait for it to take more (EVENT_WRITE, reading
        nothing meanwhile), or go back to reading."""
        while client.unsent is not None:
            try:
                sent = client.sock.send(client.unsent)
            except (BlockingIOError, InterruptedError):
                break
            self._unsent_bytes -= sent
            client.unsent = client.unsent[sent:] if sent < len(client.unsent) else None
        if client.unsent is None:
            client.unsent_since = None
            self._watch(client, selectors.EVENT_READ)
        else:
            if client.unsent_since is None:
                client.unsent_since = time.monotonic()
            self._watch(client, selectors.EVENT_WRITE)

    def _watch(self, client: _Client, events: int) -> None:
        if client.events != events:
            self._selector.modify(client.sock, events, client)
            client.events = events

    # ---- unpins in slices -------------------------------------------------------------------

    def _queue_unpin(self, client: _Client, keys: list[Any] | tuple[Any, ...]) -> None:
        # Only keys are held (a non-bytes value could be a large array), and only a notice of
        # more than a slice: at most MAX_QUEUED_UNPINS / UNPIN_SLICE entries wait.
        if set(map(type, keys)) != {bytes} or max(map(len, keys)) > p.MAX_KEY_BYTES or \
                len(unique := list(dict.fromkeys(keys))) <= UNPIN_SLICE:
            self._notice(client.id, p.COMPLETE_LOAD, (keys,))  # a bad one drops the client
            return
        self._unpins.append([client, unique, 0])  # named twice: unpinned once, in any slice
        self._queued_unpins += len(unique)
        if self._queued_unpins > MAX_QUEUED_UNPINS:
            self._apply_unpins(None)

    def _unpin_slice(self) -> None:
        """Apply the next UNPIN_SLICE keys of the oldest queued unpin."""
        if not self._unpins:
            return
        entry = self._unpins[0]
        client, keys, start = entry
        end = min(start + UNPIN_SLICE, len(keys))
        if end == len(keys):
            self._unpins.popleft()
        else:
            entry[2] = end
        self._queued_unpins -= end - start
        self._unpin(client, keys[start:end])

    def _apply_unpins(self, client: _Client | None) -> None:
        """Apply the rest of every queued unpin of `client` (None: of every client)."""
        for entry in self._take_unpins(client):
            self._unpin(entry[0], entry[1][entry[2]:])

    def _take_unpins(self, client: _Client | None) -> list[list[Any]]:
        """Remove and return the queued unpins of `client` (None: every one)."""
        if not self._unpins:
            return []
        if client is None:
            taken, self._unpins = list(self._unpins), deque()
        else:
            taken = [e for e in self._unpins if e[0] is client]
            self._unpins = deque(e for e in self._unpins if e[0] is not client)
        self._queued_unpins -= sum(len(e[1]) - e[2] for e in taken)
        return taken

    def _unpin(self, client: _Client, keys: list[Any]) -> None:
        """Apply an unpin of the client's; whatever fails, only that client goes (this runs
        outside its own frames: in the loop, or in another client's request)."""
        if client.closed:
            return
        try:
            self.index.complete_load(client.id, keys)
        except (ValueError, TypeError) as exc:  # a malformed notice
            self._drop(client, p.clip(f"{type(exc).__name__}: {exc}"))
        except Exception as exc:  # a bug: say so, keep serving the others
            log.error("pool %s: client %d's unpin failed: %s", self.name, client.id,
                      p.clip(repr(exc)))
            self._drop(client)

    # ---- the verbs -------------------------------------------------------------------------

    def _request(self, client: _Client, verb: str, args: tuple[Any, ...]) -> Any:
        index = self.index
        if verb == p.HELLO:
            index.open(client.id, args[0], args[1])
            client.greeted = True
            return self.info.as_list()
        if verb == p.LOOKUP:
            return index.lookup(client.id, args[0])
        if verb == p.PREPARE_STORES:
            plans = index.prepare_stores(client.id, args[0])
            return [[plan.keys, plan.slots, plan.not_placed, plan.evicted, plan.evicted_slots,
                     [index.evicted_sums.get(key) for key in plan.evicted], plan.hash_later]
                    for plan in plans]
        if verb == p.PREPARE_LOAD:
            return index.prepare_load(client.id, args[0])
        if verb == p.CHECKSUMS:
            return index.checksums(client.id, args[0])
        if verb == p.CHANGES:
            return index.changes(client.id, args[0])
        if verb == p.ADD_SUMS:
            return index.add_sums(client.id, args[0], args[1], args[2])
        return self.stats()

    def _notice(self, client: int, verb: str, args: tuple[Any, ...]) -> None:
        if verb == p.COMPLETE_STORE:
            self.index.complete_store(client, args[0], args[1], args[2])
        elif verb == p.COMMIT_ROW_SUMS:
            self.index.commit_row_sums(client, args[0], args[1], args[2])
        elif verb == p.COMPLETE_LOAD:
            self.index.complete_load(client, args[0])
        elif verb == p.DISCARD:
            self.index.discard(client, args[0])
        elif verb == p.READS:
            self.index.reads(client, args[0], args[1])
        else:
            self.index.clear(client)

    def stats(self) -> dict[str, Any]:
        """The pool's counters, and what each client holds (`leases`, by client id and pid:
        keys it is storing, its pins and the keys they pin). `busy_slots`: slots neither free
        nor evictable (being stored, pinned, or removed and waiting for those): a slot no lease
        accounts for would show there."""
        index = self.index.index
        counters = index.stats
        leases = self.index.leases
        held = [{"client": client, "pid": self._clients[client].pid, **holds}
                for client, holds in sorted(self.index.held().items())
                if client in self._clients]
        return {"name": self.name, "segment": self.info.segment, "num_slots": index.num_slots,
                "slot_bytes": self.info.slot_bytes, "stored": len(index), "free": index.num_free,
                "busy_slots": index.num_slots - index.num_reclaimable,
                "draining": index.num_draining,
                "clients": len(self._clients), "max_clients": self.max_clients,
                "refused": self.refused, "refused_busy": self.refused_busy,
                "dropped": self.dropped, "accept_errors": self.accept_errors,
                "pending_bytes": self._pending_bytes, "unsent_bytes": self._unsent_bytes,
                "unpins_queued": self._queued_unpins,
                "unhashed": self.index.unhashed, "orphans": self.index.orphans,
                "pinned": sum(sum(lease.pins.values()) for lease in leases.values()),
                "storing": self.index.storing,
                "leases": held,
                "stores": counters.stores, "failed_stores": counters.failed_stores,
                "evictions": counters.evictions, "hits": counters.hits,
                "misses": counters.misses}

    def _warn(self, text: str) -> None:
        """A warning, at most LOG_BURST per LOG_WINDOW_S (a flood of bad clients must not
        flood the log); the ones held back are counted in the next window's first line."""
        now = time.monotonic()
        start, count = self._log_window
        if now - start > LOG_WINDOW_S:
            if self._log_suppressed:
                log.warning("pool %s: %d more warnings held back", self.name,
                            self._log_suppressed)
                self._log_suppressed = 0
            start, count = now, 0
        if count < LOG_BURST:
            log.warning("pool %s: %s", self.name, p.clip(text))
        else:
            self._log_suppressed += 1
        self._log_window = (start, count + 1)

    def close(self) -> None:
        for client in list(self._clients.values()):
            self._drop(client)
        self._selector.close()
        self._listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.buffer.close(unlink=True)


def _open_spare() -> int | None:
    """A descriptor held to be closed when the process runs out (accept's EMFILE)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _refuse(sock: socket.socket, why: str) -> None:
    """Tell a connection why it is refused (if its buffer takes it now) and close it."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(msgpack.packb([False, why]))
    sock.close()
