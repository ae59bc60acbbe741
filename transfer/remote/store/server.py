"""The store server: one ROUTER socket, one thread, blocks in memory (transfer.remote.store.memory).

Requests are served one message at a time in arrival order by one thread, the only one that
touches the index, so clients interleave at request granularity. zmq's IO threads do the socket
work (kernel copies, CURVE), each connection on one of them: several connections, of one client
or of many, are received and sent in parallel. Blocks are received zero-copy (the store keeps
the frame) and sent zero-copy with a MessageTracker that keeps them pinned until zmq is done.
A put's checksums are checked first (transfer.remote.store.puts: large ones on threads while the
loop goes on receiving); puts are stored and answered in arrival order once checked.
Run it in a thread (`start()`, for tests and benchmarks) or in the foreground (`serve_forever()`,
the `kvconnector store serve` command).

What zmq may hold for the connections, in requests and in replies, is bounded, and so are the
connections and the time one may stall holding something; a peer that keeps sending invalid
requests is dropped (transfer.remote.store.admission; docs/protocol.md, "Limits"). Nothing a peer
sends is quoted at more than a short prefix (protocol.quoted), and internal errors are logged at
1, 2, 4, ... occurrences, so no peer can flood the log.

A server may be one worker of several (transfer.remote.store.shards, .workers): it then holds
only the keys that hash to it and refuses the others; the first worker's `ping` names them all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer.checksums import block_checksum
from transfer.remote.backend import BlockStatus
from transfer.remote.store.admission import (
    CHECK_INTERVAL_S,
    CONNECTION_EVENTS,
    COPIED_FRAME_BYTES,
    FRAME_MEMORY_BYTES,
    RECEIVE_HWM,
    SEND_HWM,
    STALL_TIMEOUT_S,
    TRACKED_REPLY_BYTES,
    PeerGuard,
    buffer_budget,
    peer_limit,
)
from transfer.remote.store.heap import keep_received_memory
from transfer.remote.store.memory import BlockStore, StoredBlock
from transfer.remote.store.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    Op,
    Request,
    RequestError,
    decode_request,
    encode_error,
    encode_reply,
)
from transfer.remote.store.puts import (
    DEFAULT_VERIFY_THREADS,
    PendingPut,
    PutChecker,
)
from transfer.remote.store.security import Security, tcp_host
from transfer.remote.store.shards import shard_of

log = logging.getLogger(__name__)

# plain ints: operators on pyzmq's enum flags run Python code, a cost on every request
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
_MESSAGES_PER_WAKE = 256  # then look at the stop flag and the send trackers again
_IDLE_POLL_MS = 100
_BUSY_POLL_MS = 5  # while replies are in flight, release their pins promptly
COUNTERS = (*(f"requests_{op.value}" for op in Op), "put_blocks", "put_bytes", "put_existing",
            "put_corrupt", "put_size", "put_full", "get_blocks", "get_bytes", "get_missing",
            "request_errors", "internal_errors", "dropped_replies", "auth_refused",
            "discarded_requests")
_NO_BLOCKS: tuple[StoredBlock, ...] = ()
# one of these per refused handshake (each also comes with a HANDSHAKE_FAILED_NO_DETAIL)
_AUTH_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_SRCFD = int(zmq.SRCFD)
# One TCP stream is what one IO thread copies (~4 GB/s on the GPU machine); half the cores, up
# to 8, spread the connections (the serving and verifier threads need the rest).
DEFAULT_IO_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))


@dataclass(eq=False)
class _SentReply:
    """A tracked reply zmq is sending: its blocks stay pinned until the tracker (of its last
    frame: zmq frees a message's frames in order) says zmq is done with it."""

    identity: bytes
    tracker: zmq.MessageTracker
    blocks: Sequence[StoredBlock]
    nbytes: int  # its memory, as counted by the peer guard


class StoreServer:
    """A block store listening on `listen` (tcp://HOST:PORT; PORT may be * for a free port)."""

    def __init__(self, listen: str, capacity_bytes: int, security: Security, *,
                 limits: Limits | None = None, verify_threads: int | None = None,
                 buffer_budget_bytes: int | None = None,
                 io_threads: int | None = None, shard: tuple[int, int] = (0, 1),
                 max_peers: int | None = None,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        tcp_host(listen)  # ValueError for anything but tcp://HOST:PORT
        if not isinstance(security, Security):
            raise ValueError(f"security must be a Security, got {security!r}")
        if verify_threads is None:
            verify_threads = DEFAULT_VERIFY_THREADS
        if isinstance(verify_threads, bool) or not isinstance(verify_threads, int) \
                or verify_threads < 0:
            raise ValueError(f"verify_threads must be an int >= 0 (0: check puts inline), "
                             f"got {verify_threads!r}")
        if io_threads is None:
            io_threads = DEFAULT_IO_THREADS
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an int >= 1, got {io_threads!r}")
        self._io_threads = io_threads
        index, shards = shard
        if not 0 <= index < shards:
            raise ValueError(f"shard must be (index, workers) with 0 <= index < workers, "
                             f"got {shard!r}")
        self.shard = (index, shards)
        # the workers' ports, this one's first; set on the first of several before serving
        self.shard_ports: list[int] | None = None
        self.listen = listen
        self.limits = limits or Limits()
        self._guard = PeerGuard(buffer_budget(self.limits, buffer_budget_bytes),
                                max_peers=peer_limit(max_peers),
                                stall_timeout_s=stall_timeout_s)
        self._store = BlockStore(capacity_bytes)
        self._security = security
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._in_flight: list[_SentReply] = []
        self._copy_threshold = zmq.COPY_THRESHOLD  # the socket's, once bound
        self._puts = PutChecker(verify_threads)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context | None = None
        self._auth: Any = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self.endpoint: str | None = None

    def bind(self) -> str:
        """Set up security, bind, and return the bound endpoint (with the real port)."""
        keep_received_memory()  # puts arrive in buffers zmq mallocs
        self._context = zmq.Context(io_threads=self._io_threads)
        sock = self._context.socket(zmq.ROUTER)
        try:
            self._auth = self._security.apply_server(self._context, sock, self.listen)
            sock.router_mandatory = 1  # a reply to a vanished client fails instead of vanishing
            sock.linger = 0
            sock.maxmsgsize = self.limits.max_frame_bytes
            sock.rcvhwm = RECEIVE_HWM
            sock.sndhwm = SEND_HWM
            self._copy_threshold = sock.copy_threshold
            self._monitor = sock.get_monitor_socket(_AUTH_FAILURES | CONNECTION_EVENTS)
            sock.bind(self.listen)
        except Exception:
            sock.close(linger=0)
            self._shutdown()
            raise
        self._sock = sock
        self.endpoint = sock.last_endpoint.decode()
        return self.endpoint

    def start(self) -> str:
        """Bind and serve on a background thread; returns the bound endpoint."""
        endpoint = self.bind()
        self._thread = threading.Thread(target=self._serve, name="kvconnector-store", daemon=True)
        self._thread.start()
        return endpoint

    def serve_forever(self) -> None:
        """Bind (unless already bound) and serve in this thread until `stop()`."""
        if self.endpoint is None:
            self.bind()
        self._serve()

    def stop(self) -> None:
        """Stop serving (from any thread or a signal handler) and wait for the thread if any."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> StoreServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """Counters, sizes and limits, as the stats op returns them."""
        store = self._store
        return {
            "protocol": PROTOCOL_VERSION, "security": self._security.mode.value,
            "blocks": len(store), "used_bytes": store.used_bytes,
            "capacity_bytes": store.capacity_bytes, "pinned_blocks": store.pinned_blocks,
            "evictions": store.evictions, "max_block_bytes": self.limits.max_block_bytes,
            "max_batch_blocks": self.limits.max_batch_blocks, **self._counters,
            "peers": self._guard.peers, "dropped_peers": self._guard.dropped_peers,
            "held_bytes": self._guard.held_bytes, "buffer_budget_bytes": self._guard.budget_bytes,
            "pending_bytes": self._guard.pending_bytes, "stalled_peers": self._guard.stalled_peers,
            "refused_peers": self._guard.refused_peers, "max_peers": self._guard.max_peers,
            "worker": self.shard[0], "workers": self.shard[1],
        }

    def _serve(self) -> None:
        wake_read = self._puts.start()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(wake_read, zmq.POLLIN)
        next_check = 0.0
        try:
            while not self._stop.is_set():
                timeout = _BUSY_POLL_MS if self._in_flight else _IDLE_POLL_MS
                if self._guard.peers:  # bytes may arrive that make no message (yet)
                    timeout = min(timeout, int(CHECK_INTERVAL_S * 1000))
                ready = dict(poller.poll(timeout))
                if wake_read in ready:
                    self._puts.drain_wakeups()
                if self._monitor in ready:
                    self._read_monitor()
                if self._sock in ready:
                    for _ in range(_MESSAGES_PER_WAKE):
                        try:
                            frames = self._sock.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                        self._finish_puts()
                        if time.monotonic() >= next_check:  # also amid a stream of requests
                            break
                self._finish_puts()
                self._release_sent()
                if time.monotonic() >= next_check:
                    self._read_monitor()  # connections made or gone since
                    self._guard.check()
                    next_check = time.monotonic() + self._guard.interval_s
        finally:
            self._puts.close()  # puts still being checked are dropped unanswered
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._shutdown()

    def _shutdown(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._context is not None:
            self._context.destroy(linger=0)

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            kind, value = event["event"], int(event["value"])
            if not self._guard.connection_event(kind, value):
                self._counters["auth_refused"] += 1
                refused = self._counters["auth_refused"]
                if refused & (refused - 1) == 0:  # 1, 2, 4, ...: a flood cannot flood the log
                    log.warning("refused a peer's handshake on %s: %s (%s; %d so far)",
                                event["endpoint"].decode(), zmq.Event(kind).name, value,
                                refused)

    def _release_sent(self) -> None:
        if not self._in_flight:
            return
        waiting = []
        for sent in self._in_flight:
            if sent.tracker.done:
                for block in sent.blocks:
                    self._store.unpin(block)
                self._guard.replied(sent.identity, sent.nbytes)
            else:
                waiting.append(sent)
        self._in_flight = waiting

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, header, blocks = frames[0].bytes, frames[1], frames[2:]
        try:
            fd = header.get(_SRCFD)
        except zmq.ZMQError:  # EINVAL: no descriptor on record (a ZMTP 1.0 peer's message)
            fd = -1
        if not self._guard.delivered(fd, identity):  # from a peer dropped meanwhile
            self._counters["discarded_requests"] += 1
            return
        request_id = None
        try:
            request = decode_request(header.buffer, self.limits)
            request_id = request.request_id
            if request.op is not Op.PUT and blocks:
                raise RequestError(ErrorCode.FRAMES, f"{request.op.value} carries no block "
                                   f"frames, got {len(blocks)}", request_id)
            self._counters[f"requests_{request.op.value}"] += 1
            if self.shard[1] > 1:
                self._check_shard(request)
            if request.op is Op.PUT and any(frame.buffer.nbytes != size for frame, size
                                            in zip(blocks, request.sizes, strict=False)):
                self._guard.strike(fd, identity, "a put's block frame is not its declared size")
            self._dispatch(identity, request, blocks)
        except RequestError as exc:
            self._counters["request_errors"] += 1
            log.debug("refused a request: %s: %s", exc.code.value, exc)
            self._reply(identity, encode_error(exc.request_id, exc.code, str(exc)))
            self._guard.strike(fd, identity, f"{exc.code.value}: {exc}")
        except Exception:  # a bug must cost one request, not the store
            self._internal_error("serving a request")
            self._reply(identity, encode_error(request_id, ErrorCode.INTERNAL, "internal error"))

    def _internal_error(self, doing: str) -> None:
        """Count an internal error; log it (with its traceback) at 1, 2, 4, ... of them."""
        self._counters["internal_errors"] += 1
        errors = self._counters["internal_errors"]
        if errors & (errors - 1) == 0:
            log.exception("internal error %s (%d so far)", doing, errors)

    def _dispatch(self, identity: bytes, request: Request, blocks: list[zmq.Frame]) -> None:
        store, rid = self._store, request.request_id
        if request.op is Op.PUT:
            self._put(identity, request, blocks)
        elif request.op is Op.GET:
            self._get(identity, request)
        elif request.op is Op.LOOKUP:
            self._reply(identity, encode_reply(rid, prefix=store.prefix_length(request.keys)))
        elif request.op is Op.EXISTS:
            self._reply(identity, encode_reply(rid, found=[k in store for k in request.keys]))
        elif request.op is Op.DELETE:
            self._reply(identity, encode_reply(rid, deleted=[store.delete(k)
                                                             for k in request.keys]))
        elif request.op is Op.STATS:
            self._reply(identity, encode_reply(rid, stats=self.stats()))
        elif self.shard_ports is None:
            self._reply(identity, encode_reply(rid, protocol=PROTOCOL_VERSION))
        else:
            self._reply(identity, encode_reply(rid, protocol=PROTOCOL_VERSION,
                                               shards=self.shard_ports))

    def _check_shard(self, request: Request) -> None:
        index, shards = self.shard
        for position, key in enumerate(request.keys):
            owner = shard_of(key, shards)
            if owner != index:
                raise RequestError(ErrorCode.SHARD, f"key {position} ({key.hex()}) belongs to "
                                   f"worker {owner} of {shards}, not to this worker {index}: "
                                   f"the store's ping names every worker's port",
                                   request.request_id)

    def _put(self, identity: bytes, request: Request, blocks: list[zmq.Frame]) -> None:
        """Check the blocks' checksums (on the verifier when large), then `_finish_puts`."""
        if len(blocks) != len(request.keys):
            raise RequestError(ErrorCode.FRAMES, f"put declares {len(request.keys)} blocks but "
                               f"carries {len(blocks)} frames", request.request_id)
        self._guard.checking(identity, sum(request.sizes))  # until stored (`_finish_puts`)
        self._puts.submit(identity, request, blocks, self._store.__contains__)

    def _finish_puts(self) -> None:
        """Store and answer the checked puts at the head of the queue, in arrival order."""
        for pending in self._puts.ready():
            self._guard.checked(pending.identity, sum(pending.request.sizes))
            rid = pending.request.request_id
            try:
                if pending.failed:
                    raise RuntimeError("a verifier task failed")
                reply = encode_reply(rid, status=self._store_put(pending))
            except Exception:  # a bug must cost one request, not the store
                self._internal_error("storing a put")
                reply = encode_error(rid, ErrorCode.INTERNAL, "internal error")
            self._reply(pending.identity, reply)

    def _store_put(self, pending: PendingPut) -> list[str]:
        request = pending.request
        statuses = []
        for index, (key, size, checksum, frame) in enumerate(zip(
                request.keys, request.sizes, request.checksums, pending.blocks, strict=True)):
            view = frame.buffer
            valid = pending.valid[index]
            if view.nbytes != size:
                status, counter = BlockStatus.SIZE, "put_size"
            elif self._store.get(key) is not None:  # already held: same key, same bytes
                status, counter = BlockStatus.OK, "put_existing"
            elif not (block_checksum(view, key) == checksum if valid is None else valid):
                # (None: it was held when the put arrived and has gone since; check it now)
                status, counter = BlockStatus.CORRUPT, "put_corrupt"
            elif self._store.insert(key, frame, checksum):
                status, counter = BlockStatus.OK, "put_blocks"
                self._counters["put_bytes"] += size
            else:
                status, counter = BlockStatus.FULL, "put_full"
            self._counters[counter] += 1
            statuses.append(status.value)
        return statuses

    def _get(self, identity: bytes, request: Request) -> None:
        statuses, sizes, sums, found = [], [], [], []
        for key in request.keys:
            block = self._store.get(key)
            if block is None:
                statuses.append(BlockStatus.MISSING.value)
                sizes.append(0)
                sums.append(0)
                continue
            statuses.append(BlockStatus.OK.value)
            sizes.append(block.size)
            sums.append(block.checksum)
            found.append(block)
        if sum(sizes) > self.limits.max_message_bytes:  # as a put's; a key may repeat
            raise RequestError(ErrorCode.LIMIT, f"the blocks found come to {sum(sizes)} B; the "
                               f"limit is {self.limits.max_message_bytes} B per message",
                               request.request_id)
        self._counters["get_blocks"] += len(found)
        self._counters["get_missing"] += len(request.keys) - len(found)
        self._counters["get_bytes"] += sum(sizes)
        header = encode_reply(request.request_id, status=statuses, sizes=sizes, sums=sums)
        self._reply(identity, header, found, tracked=True)

    def _reply(self, identity: bytes, header: bytes, blocks: Sequence[StoredBlock] = _NO_BLOCKS,
               *, tracked: bool = False) -> None:
        """Send a reply without waiting (dropped if its peer is gone or has SEND_HWM replies
        unread). Replies with blocks, and large ones, are tracked: their memory counts as held
        by the peer until zmq is done with them (transfer.remote.store.admission)."""
        try:
            self._sock.send(identity, _SNDMORE | _NOBLOCK)
        except zmq.ZMQError as exc:  # the client is gone (EHOSTUNREACH) or not reading (EAGAIN)
            self._counters["dropped_replies"] += 1
            dropped = self._counters["dropped_replies"]
            if dropped & (dropped - 1) == 0:  # 1, 2, 4, ...: a flood cannot flood the log
                log.warning("dropped a reply: %s (%d so far)", exc, dropped)
            return
        if not (tracked or blocks or len(header) >= TRACKED_REPLY_BYTES):
            self._sock.send(header)
            return
        # frames under pyzmq's copy threshold are copied; the last is sent zero-copy, tracked
        nbytes = len(header) + FRAME_MEMORY_BYTES + sum(
            COPIED_FRAME_BYTES + block.size if block.size < self._copy_threshold
            else FRAME_MEMORY_BYTES for block in blocks)
        frames = [header, *(block.view for block in blocks)]
        for frame in frames[:-1]:
            self._sock.send(frame, _SNDMORE, copy=False)
        last = zmq.Frame(frames[-1], copy=False, track=True)  # tracked, whatever its size
        tracker = self._sock.send(last, 0, copy=False, track=True)
        for block in blocks:
            self._store.pin(block)
        self._guard.replying(identity, nbytes)
        self._in_flight.append(_SentReply(identity, tracker, blocks, nbytes))

