"""The daemon's large unpins, applied a slice per turn of its loop (in process, each frame
handed to the daemon as its loop would): a commit is not held behind another engine's unpin,
while a client's own later verbs, and any store's placement, see its unpins applied."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

import transfer.shared.daemon as daemon_module
from transfer.keys import Namespace
from transfer.shared import protocol as p
from transfer.shared.daemon import UNPIN_SLICE, PoolDaemon, _Client

NS = Namespace(model="m", dtype="bf16", block_size=4, block_layout="x")
SLOT = 4096
BIG = 2 * UNPIN_SLICE + 100  # three slices


@pytest.fixture
def daemon() -> Iterator[PoolDaemon]:
    pool = PoolDaemon(f"u{uuid.uuid4().hex[:10]}", 2 * BIG * (SLOT + 4096), SLOT)
    try:
        yield pool
    finally:
        pool.close()


class Peer:
    """One connection, its frames handed straight to the daemon; answers read back."""

    def __init__(self, daemon: PoolDaemon) -> None:
        self.daemon = daemon
        ours, theirs = socket.socketpair(socket.AF_UNIX)
        self.sock = ours
        daemon._admit(theirs)
        self.client: _Client = daemon._clients[max(daemon._clients)]
        self.ask(p.HELLO, [NS.digest], SLOT)

    def send(self, verb: str, *args: Any) -> None:
        self.daemon._handle(self.client, msgpack.packb([verb, *args]))

    def ask(self, verb: str, *args: Any) -> Any:
        self.send(verb, *args)
        ok, answer = msgpack.unpackb(self.sock.recv(1 << 24))
        assert ok, answer
        return answer

    def pins(self) -> dict[bytes, int]:
        return dict(self.daemon.index.leases[self.client.id].pins)


def stored(peer: Peer, first: int, count: int) -> list[bytes]:
    keys = [NS.key(first + i) for i in range(count)]
    (plan,) = peer.ask(p.PREPARE_STORES, [keys])
    assert plan[0] == keys
    peer.send(p.COMPLETE_STORE, keys, [True] * count, [[i] for i in range(count)])
    return keys


def test_a_large_unpin_goes_a_slice_a_turn_and_a_commit_meanwhile_at_once(
        daemon: PoolDaemon) -> None:
    reader, writer = Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    assert reader.ask(p.PREPARE_LOAD, keys) is not None
    reader.send(p.COMPLETE_LOAD, keys)
    assert daemon.stats()["unpins_queued"] == BIG and len(reader.pins()) == BIG
    more = [NS.key(10_000 + i) for i in range(3)]
    (plan,) = writer.ask(p.PREPARE_STORES, [more])  # placement: every unpin applied first
    assert daemon.stats()["unpins_queued"] == 0 and reader.pins() == {}
    assert reader.ask(p.PREPARE_LOAD, keys) is not None
    reader.send(p.COMPLETE_LOAD, keys)
    writer.send(p.COMPLETE_STORE, plan[0], [True] * 3, [[1], [2], [3]])  # not held back
    assert daemon.stats()["unpins_queued"] == BIG
    assert writer.ask(p.LOOKUP, more) == 3  # another client's answer: not held back either
    assert daemon.stats()["unpins_queued"] == BIG and len(reader.pins()) == BIG
    daemon._unpin_slice()
    assert daemon.stats()["unpins_queued"] == BIG - UNPIN_SLICE
    assert sorted(reader.pins()) == sorted(keys[UNPIN_SLICE:])
    assert reader.ask(p.STATS)["pinned"] == 0  # its own request: its unpins applied first
    assert daemon.stats()["unpins_queued"] == 0 and reader.pins() == {}


def test_a_key_named_twice_is_unpinned_once_whatever_slice_it_falls_in(
        daemon: PoolDaemon) -> None:
    reader, writer = Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    reader.ask(p.PREPARE_LOAD, keys)
    reader.ask(p.PREPARE_LOAD, keys[:1])  # keys[0] pinned twice
    reader.send(p.COMPLETE_LOAD, [*keys, keys[0]])  # its second naming in the last slice
    while daemon.stats()["unpins_queued"]:
        daemon._unpin_slice()
    assert reader.pins() == {keys[0]: 1}


def test_a_malformed_unpin_drops_its_client_alone_with_its_pins(daemon: PoolDaemon) -> None:
    reader, other, writer = Peer(daemon), Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    reader.ask(p.PREPARE_LOAD, keys)
    other.ask(p.PREPARE_LOAD, keys[:5])
    foreign = Namespace(model="x", dtype="bf16", block_size=4, block_layout="x").key(1)
    reader.send(p.COMPLETE_LOAD, [*keys[:-1], foreign])  # bad in its last slice
    other.send(p.COMPLETE_LOAD, keys[5:6])  # not pinned by it: ignored
    while daemon.stats()["unpins_queued"]:
        daemon._unpin_slice()
    assert reader.client.closed and reader.client.id not in daemon.index.leases
    assert daemon.dropped == 1 and other.pins() == {k: 1 for k in keys[:5]}
    assert daemon.stats()["pinned"] == 5
    with pytest.raises(ValueError, match="an array of 1 items"):  # not keys: never queued,
        other.send(p.COMPLETE_LOAD, [[1]] * (UNPIN_SLICE + 1))  # refused whole (the loop drops it)
    oversized = [NS.key(i) + b"k" * p.MAX_KEY_BYTES for i in range(UNPIN_SLICE + 1)]
    with pytest.raises(ValueError, match="a key: 17 to 256 bytes"):  # never queued either
        other.send(p.COMPLETE_LOAD, oversized)
    assert other.pins() == {k: 1 for k in keys[:5]} and daemon.stats()["unpins_queued"] == 0


def test_only_a_notice_of_more_than_a_slice_of_distinct_keys_waits(daemon: PoolDaemon) -> None:
    """A flood of notices naming one key many times queues nothing (each is applied at once)."""
    reader, writer = Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    reader.ask(p.PREPARE_LOAD, keys)
    for key in keys[:3]:
        reader.send(p.COMPLETE_LOAD, [key] * (UNPIN_SLICE + 1))
    assert daemon.stats()["unpins_queued"] == 0 and len(reader.pins()) == BIG - 3


def test_an_unpin_failing_for_any_reason_drops_only_its_client(
        daemon: PoolDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug met while a queued unpin is applied (outside the client's own frames) must not end
    the loop nor drop the client whose request happened to apply it."""
    reader, writer = Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    reader.ask(p.PREPARE_LOAD, keys)
    reader.send(p.COMPLETE_LOAD, keys)

    def broken(client: int, unpinned: list[bytes]) -> None:
        raise KeyError("a broken invariant")

    monkeypatch.setattr(daemon.index, "complete_load", broken)
    writer.ask(p.PREPARE_STORES, [[NS.key(10_000)]])  # applies every queued unpin first
    assert reader.client.closed and not writer.client.closed
    assert daemon.stats()["unpins_queued"] == 0 and daemon.stats()["pinned"] == 0


def test_queued_unpins_are_bounded_and_go_with_their_client(
        daemon: PoolDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_module, "MAX_QUEUED_UNPINS", BIG + 1)
    first, second, writer = Peer(daemon), Peer(daemon), Peer(daemon)
    keys = stored(writer, 0, BIG)
    first.ask(p.PREPARE_LOAD, keys)
    second.ask(p.PREPARE_LOAD, keys)
    first.send(p.COMPLETE_LOAD, keys)
    assert daemon.stats()["unpins_queued"] == BIG
    second.send(p.COMPLETE_LOAD, keys)  # past the bound: every queued unpin applied at once
    assert daemon.stats()["unpins_queued"] == 0 and first.pins() == second.pins() == {}
    first.ask(p.PREPARE_LOAD, keys)
    first.send(p.COMPLETE_LOAD, keys)
    daemon._drop(first.client)  # its lease released: nothing of it stays queued
    assert daemon.stats()["unpins_queued"] == 0 and daemon.stats()["pinned"] == 0
