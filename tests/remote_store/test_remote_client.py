"""The client against a scripted fake store: it never marks a slot valid with unverified bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

import transfer.remote.store.connection as connection_module
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient, StoreError
from transfer.remote.store.connection import Connection, Exchange
from transfer.remote.store.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    Op,
    Request,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
)
from transfer.remote.store.security import Security

BLOCK = 64 << 10
NONE = Security.none()
NS = Namespace("model-a", "bfloat16", 16, "BLNHC")
KEYS = NS.keys([b"k%d" % i for i in range(4)])
POISON = 0xA5
Respond = Callable[[Request, list[bytes]], list[bytes] | None]


class FakeStore:
    """A ROUTER on a thread answering each request with `respond(request, blocks)` (None: no
    answer); with `stale_first`, each answer is preceded by a zeroed copy under another id."""

    def __init__(self, respond: Respond, stale_first: bool = False) -> None:
        self.respond = respond
        self.stale_first = stale_first
        self.requests: list[Request] = []
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind("tcp://127.0.0.1:*")
        self.url = self._sock.last_endpoint.decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, header, *blocks = self._sock.recv_multipart()
            request = decode_request(header, Limits())
            if request.op is Op.PING:  # a client's first call asks for the workers: just one
                self._sock.send_multipart([identity, encode_reply(request.request_id,
                                                                  protocol=PROTOCOL_VERSION)])
                continue
            self.requests.append(request)
            reply = self.respond(request, blocks)
            if reply is not None and self.stale_first:
                header = decode_reply(reply[0])
                stale = encode_reply(header.request_id + 1000, **header.fields)
                self._sock.send_multipart([identity, stale, *(bytes(len(f)) for f in reply[1:])])
            if reply is not None:
                self._sock.send_multipart([identity, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


def _blocks(count: int = 4, seed: int = 0) -> list[bytes]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=generator)
            .numpy().tobytes() for _ in range(count)]


STORED = dict(zip(KEYS, _blocks(), strict=True))


def _get_reply(request: Request, frames: dict[bytes, bytes] | None = None,
               sizes: dict[bytes, int] | None = None,
               sums: dict[bytes, int] | None = None) -> list[bytes]:
    """An honest get reply for STORED, with `frames`, `sizes`, `sums` overriding per key."""
    frames, sizes, sums = frames or {}, sizes or {}, sums or {}
    found = [k for k in request.keys if k in STORED]
    header = encode_reply(
        request.request_id,
        status=["ok" if k in STORED else "missing" for k in request.keys],
        sizes=[sizes.get(k, BLOCK) if k in STORED else 0 for k in request.keys],
        sums=[sums.get(k, block_checksum(STORED[k], k)) if k in STORED else 0
              for k in request.keys])
    return [header, *(frames.get(k, STORED[k]) for k in found)]


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeStore]]:
    stores: list[FakeStore] = []

    def make(respond: Respond, stale_first: bool = False) -> FakeStore:
        stores.append(FakeStore(respond, stale_first))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


def _fetch(url: str, keys: list[bytes] = KEYS, timeout_s: float = 5.0):
    pool = torch.full((len(keys), BLOCK), POISON, dtype=torch.uint8)
    with StoreClient(url, NONE, namespace=NS, pool=pool, timeout_s=timeout_s,
                     connections=1) as client:
        result = client.get(keys, range(len(keys)))
    for slot, (key, ok) in enumerate(zip(keys, result.ok, strict=True)):
        if ok:  # a slot reported valid holds exactly the stored bytes
            assert pool[slot].numpy().tobytes() == STORED[key]
    return result, pool


def _flip(block: bytes, index: int) -> bytes:
    flipped = bytearray(block)
    flipped[index] ^= 0x01
    return bytes(flipped)


def test_honest_reply_fills_every_slot(fake: Callable[..., FakeStore]) -> None:
    store = fake(lambda request, _: _get_reply(request))
    result, _ = _fetch(store.url, KEYS + [NS.key(b"absent")])
    assert result.statuses == (BlockStatus.OK,) * 4 + (BlockStatus.MISSING,)


def test_a_bit_flip_on_get_is_caught_by_the_client(fake: Callable[..., FakeStore]) -> None:
    store = fake(lambda request, _: _get_reply(request, frames={KEYS[1]: _flip(STORED[KEYS[1]],
                                                                               BLOCK - 1)}))
    result, _ = _fetch(store.url)
    assert result.statuses == (BlockStatus.OK, BlockStatus.CORRUPT, BlockStatus.OK,
                               BlockStatus.OK)
    assert "checksum" in result.errors[1]


@pytest.mark.parametrize("frame_size", [BLOCK - 1, BLOCK + 1, 1])
def test_short_or_long_frames_are_caught(fake: Callable[..., FakeStore],
                                         frame_size: int) -> None:
    wrong = (STORED[KEYS[2]] * 2)[:frame_size]
    store = fake(lambda request, _: _get_reply(request, frames={KEYS[2]: wrong}))
    result, _ = _fetch(store.url)
    assert result.statuses == (BlockStatus.OK, BlockStatus.OK, BlockStatus.SIZE, BlockStatus.OK)
    assert f"{frame_size} B" in result.errors[2]


def test_a_block_of_another_size_is_skipped_and_the_rest_still_lands(
        fake: Callable[..., FakeStore]) -> None:
    big = STORED[KEYS[0]] * 2
    store = fake(lambda request, _: _get_reply(request, frames={KEYS[0]: big},
                                               sizes={KEYS[0]: 2 * BLOCK},
                                               sums={KEYS[0]: block_checksum(big, KEYS[0])}))
    result, pool = _fetch(store.url)
    assert result.statuses == (BlockStatus.SIZE,) + (BlockStatus.OK,) * 3
    assert bool((pool[0] == POISON).all())  # skipped, never written


def test_a_block_served_under_another_key_is_caught(fake: Callable[..., FakeStore]) -> None:
    # the store answers key 3 with key 0's bytes and key 0's (valid) checksum
    store = fake(lambda request, _: _get_reply(request, frames={KEYS[3]: STORED[KEYS[0]]},
                                               sums={KEYS[3]: block_checksum(STORED[KEYS[0]],
                                                                             KEYS[0])}))
    result, _ = _fetch(store.url)
    assert result.statuses == (BlockStatus.OK,) * 3 + (BlockStatus.CORRUPT,)


def test_missing_frames_fail_their_blocks(fake: Callable[..., FakeStore]) -> None:
    store = fake(lambda request, _: _get_reply(request)[:3])  # header + 2 of 4 frames
    result, _ = _fetch(store.url)
    assert result.statuses == (BlockStatus.OK,) * 2 + (BlockStatus.FAILED,) * 2
    assert "fewer block frames" in result.errors[3]


@pytest.mark.parametrize(("reply", "message"), [
    ([encode_error(1, ErrorCode.LIMIT, "too many")], "refused the request (limit): too many"),
    ([b"\x00garbage"], "malformed reply"),
    ([encode_reply(1, status=["ok"])], "malformed reply"),  # 1 status for 4 keys
])
def test_error_and_malformed_replies_fail_every_block(fake: Callable[..., FakeStore],
                                                      reply: list[bytes], message: str) -> None:
    store = fake(lambda request, _: reply)
    result, pool = _fetch(store.url)
    assert result.statuses == (BlockStatus.FAILED,) * 4
    assert all(message in error for error in result.errors)
    assert bool((pool == POISON).all())


def test_replies_to_other_request_ids_are_ignored(fake: Callable[..., FakeStore]) -> None:
    store = fake(lambda request, _: _get_reply(request), stale_first=True)
    result, _ = _fetch(store.url)  # a zeroed reply under another id comes first
    assert result.all_ok


def test_timeout_then_reconnect(fake: Callable[..., FakeStore]) -> None:
    answer = threading.Event()
    store = fake(lambda request, _: _get_reply(request) if answer.is_set() else None)
    pool = torch.full((4, BLOCK), POISON, dtype=torch.uint8)
    with StoreClient(store.url, NONE, namespace=NS, pool=pool, timeout_s=0.3,
                     connections=1) as client:
        first = client.get(KEYS, range(4))
        assert first.statuses == (BlockStatus.FAILED,) * 4
        assert bool((pool == POISON).all())
        answer.set()
        assert client.get(KEYS, range(4), timeout_s=5.0).all_ok
    assert [r.op for r in store.requests] == [Op.GET, Op.GET]


def test_a_failed_put_leaves_no_slot_lent_to_zmq(monkeypatch: pytest.MonkeyPatch) -> None:
    # a peer that stops reading: zmq's queues and the socket buffers fill, frames stay unsent
    stalled = zmq.Context.instance().socket(zmq.ROUTER)
    stalled.rcvhwm, stalled.rcvbuf = 1, 64 << 10
    stalled.bind("tcp://127.0.0.1:*")
    sent: list[Exchange] = []
    unsent_at_close: list[int] = []
    send, reconnect = Connection.send, Connection.reconnect
    trackers: list[zmq.MessageTracker] = []
    monkeypatch.setattr(Connection, "send", lambda self, request, **kw: (
        sent.append(request), send(self, request, **kw), trackers.extend(request.trackers))[1])
    monkeypatch.setattr(Connection, "reconnect", lambda self: (
        unsent_at_close.append(sum(not t.done for r in sent for t in r.trackers)),
        reconnect(self))[1])
    pool = torch.zeros((512, BLOCK), dtype=torch.uint8)
    keys = NS.keys([b"p%d" % i for i in range(512)])

    def answer_the_ping() -> None:  # the client's first call asks for the store's workers
        identity, header = stalled.recv_multipart()
        rid = decode_request(header, Limits()).request_id
        stalled.send_multipart([identity, encode_reply(rid, protocol=PROTOCOL_VERSION)])

    pinger = threading.Thread(target=answer_the_ping)
    pinger.start()
    try:
        with StoreClient(stalled.last_endpoint.decode(), NONE, namespace=NS, pool=pool,
                         timeout_s=0.5, put_batch_bytes=32 * BLOCK, max_in_flight=16,
                         connections=1) as client:
            result = client.put(keys, range(512))
            pinger.join()
            assert result.statuses == (BlockStatus.FAILED,) * 512
            assert unsent_at_close[0] > 0  # zmq still held frames when the put gave up
            assert result.pinned_slots == () and client.pinned_slots == frozenset()
            for tracker in trackers:  # closing the socket let go of every frame
                tracker.wait(5)
    finally:
        stalled.close(linger=0)


def test_a_socket_destroyed_late_blocks_no_later_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed socket's monitor stays open until libzmq has destroyed the socket: its
    destructor sends the monitor's last event with a blocking send, and with the monitor closed
    sooner libzmq's reaper thread would hang there, destroying no later socket."""
    store = zmq.Context.instance().socket(zmq.ROUTER)
    store.bind("tcp://127.0.0.1:*")
    context = zmq.Context(io_threads=1)
    connection = Connection(store.last_endpoint.decode(), NONE, context=context, io_thread=0,
                            max_frame_bytes=1 << 20)
    destroyed = connection_module._destroyed
    late = iter([True])  # the first socket closed is "not destroyed in time"

    def destroyed_late(monitor: zmq.Socket, wait_s: float) -> bool:
        return False if next(late, False) else destroyed(monitor, wait_s)

    monkeypatch.setattr(connection_module, "_destroyed", destroyed_late)
    try:
        assert connection.reconnect() is False  # its slots would stay pinned
        assert connection.reconnect() is True  # the next one is destroyed, the late one too
        assert connection.reconnect() is True
    finally:
        connection.close()
        context.destroy(linger=0)
        store.close(linger=0)


def test_get_refuses_slots_still_lent_to_zmq(fake: Callable[..., FakeStore]) -> None:
    class Unsent:
        done = False

    store = fake(lambda request, _: _get_reply(request))
    pool = torch.zeros((4, BLOCK), dtype=torch.uint8)
    with StoreClient(store.url, NONE, namespace=NS, pool=pool, connections=1) as client:
        client._sending[2] = [Unsent()]  # as if a put's frame were still queued in zmq
        with pytest.raises(ValueError, match=r"slots \[2\] are still being sent"):
            client.get(KEYS, range(4))
        assert store.requests == []


def test_async_lookup_and_deadlines(fake: Callable[..., FakeStore]) -> None:
    def respond(request: Request, _: list[bytes]) -> list[bytes] | None:
        if request.op is Op.LOOKUP:
            return [encode_reply(request.request_id, prefix=len(request.keys) - 1)]
        return None  # puts are never answered

    store = fake(respond)
    pool = torch.zeros((4, BLOCK), dtype=torch.uint8)
    with AsyncRemoteClient(store.url, NONE, namespace=NS, pool=pool, timeout_s=1.0,
                           connections=1) as client:
        assert client.lookup(KEYS, deadline_s=5.0).result(timeout=10) == 3
        with pytest.raises(ValueError, match="not in this client's namespace"):
            client.lookup([Namespace("other", "bfloat16", 16, "x").key(1)])
        stalled = client.put(KEYS, range(4))  # holds the thread for its 1 s timeout
        late = client.lookup(KEYS, deadline_s=0.05)
        assert stalled.result(timeout=10).statuses == (BlockStatus.FAILED,) * 4
        with pytest.raises(StoreError, match="deadline passed before the request"):
            late.result(timeout=10)
        with pytest.raises(StoreError, match="no reply"):
            client.exists(KEYS, deadline_s=0.2).result(timeout=10)
    with pytest.raises(ValueError, match="closed"):
        client.lookup(KEYS)


def test_lookup_errors_raise(fake: Callable[..., FakeStore]) -> None:
    store = fake(lambda request, _: [encode_reply(request.request_id, prefix=99)])
    with StoreClient(store.url, NONE, namespace=NS, timeout_s=2.0) as client, \
            pytest.raises(StoreError, match="prefix must be an int in 0..4"):
        client.lookup(KEYS)
