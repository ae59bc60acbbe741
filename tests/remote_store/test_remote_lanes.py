"""A client spreading each put and get over several connections, against a real store process:
every byte compared after poisoning, statuses per block in the keys' order, and a connection cut
mid-job failing the blocks of its own lane only."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvconnector.servers.store import StoreProcess
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient, blocks_per_batch
from transfer.remote.store.connection import Connection, Exchange
from transfer.remote.store.lanes import deal, default_connections, spread_batch
from transfer.remote.store.security import Security
from transfer.remote.store.shards import shard_of

BLOCK = 256 << 10
COUNT = 128
LANES = 4
BATCH_BYTES = 2 * BLOCK  # two blocks per request: 64 requests, 16 per lane
NONE = Security.none()
NS = Namespace("model-a", "bfloat16", 16, "lanes")
KEYS = NS.keys([b"lane-%d" % i for i in range(COUNT)])
POISON = 0xA5
OPTIONS = {"namespace": NS, "timeout_s": 30.0, "connections": LANES,
           "put_batch_bytes": BATCH_BYTES, "get_batch_bytes": BATCH_BYTES, "max_in_flight": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    log = tmp_path_factory.mktemp("lanes") / "store.log"
    # One worker on any machine (the default is half the cores): the relay tests count the
    # connections to it, a lane each.
    with StoreProcess(log, capacity="256MiB",
                      extra_args=("--io-threads", "2", "--workers", "1")) as proc:
        yield proc


@pytest.fixture(scope="module")
def source() -> torch.Tensor:
    generator = torch.Generator().manual_seed(24)
    return torch.randint(0, 256, (COUNT, BLOCK), dtype=torch.uint8, generator=generator)


class Relay:
    """A TCP relay in front of the store: forwards each connection both ways, counts what each
    carried, and cuts connection `cut` (accept order; None: the first to get there) once it has
    carried `after` bytes in `direction` ("up": client to store, "down": store to client), as a
    failing link would."""

    def __init__(self, store_url: str, cut: int | None, direction: str, after: int) -> None:
        host, port = store_url[len("tcp://"):].rsplit(":", 1)
        self._target = (host, int(port))
        self._cut, self._direction, self._after = cut, direction, after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.carried: list[dict[str, int]] = []  # per connection, bytes per direction
        self.was_cut = threading.Event()
        self._cutting = threading.Lock()  # one connection is cut, the first to get there
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            index = len(self.carried)
            self.carried.append({"up": 0, "down": 0})
            self._sockets += [client, upstream]
            for direction, src, dst in (("up", client, upstream), ("down", upstream, client)):
                thread = threading.Thread(target=self._pump, daemon=True,
                                          args=(index, direction, src, dst, (client, upstream)))
                self._threads.append(thread)
                thread.start()

    def _pump(self, index: int, direction: str, src: socket.socket, dst: socket.socket,
              pair: tuple[socket.socket, socket.socket]) -> None:
        with suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
                self.carried[index][direction] += len(data)
                if (direction == self._direction and self._cut in (index, None)
                        and self.carried[index][direction] >= self._after):
                    with self._cutting:
                        cut = not self.was_cut.is_set()
                        self.was_cut.set()
                    if cut:
                        break
        for sock in pair:  # one side gone: drop the whole connection, both ways
            _close(sock)

    def cut_now(self) -> None:
        """Cut every connection carried so far (those made later are carried on)."""
        self.was_cut.set()
        for sock in list(self._sockets):
            _close(sock)

    def close(self) -> None:
        with suppress(OSError):  # wakes the accepting thread (closing alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(10)


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _lane_of_block(count: int) -> list[int]:
    """Which lane the client deals each block to (request k to lane k % LANES)."""
    step = spread_batch(count, blocks_per_batch(BATCH_BYTES, BLOCK), LANES)
    requests = [range(start, min(start + step, count)) for start in range(0, count, step)]
    lanes = [0] * count
    for lane, share in enumerate(deal(requests, LANES)):
        for request in share:
            for index in request:
                lanes[index] = lane
    return lanes


def _check_in_store(store: StoreProcess, source: torch.Tensor) -> tuple[BlockStatus, ...]:
    """Every key's block fetched afresh into a poisoned pool: the exact bytes or MISSING."""
    target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
    with StoreClient(store.url, NONE, pool=target, **OPTIONS) as reader:
        result = reader.get(KEYS, range(COUNT))
    for index, status in enumerate(result.statuses):
        assert status in (BlockStatus.OK, BlockStatus.MISSING), (index, result.errors[index])
        expected = source[index] if status is BlockStatus.OK else torch.full_like(
            source[index], POISON)
        assert torch.equal(target[index], expected), index
    return result.statuses


def _forget(store: StoreProcess) -> None:
    with StoreClient(store.url, NONE, namespace=NS) as admin:
        admin.delete(KEYS)


def test_defaults_and_dealing() -> None:
    assert [default_connections(cores) for cores in (1, 2, 3, 4, 8, 16, 64)] == \
        [1, 1, 1, 2, 4, 8, 8]
    assert deal(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert spread_batch(1000, 2, 8) == 2  # a large job keeps the request size
    assert spread_batch(8, 8, 4) == 2  # a small one is split so every lane gets some
    assert spread_batch(3, 8, 4) == 1
    assert _lane_of_block(8) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_connection_counts_are_refused(bad: object) -> None:
    pool = torch.zeros((2, BLOCK), dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"connections must be an int >= 1, got {bad!r}"):
        StoreClient("tcp://127.0.0.1:1", NONE, namespace=NS, pool=pool, connections=bad)


def test_every_byte_round_trips_over_four_connections(store: StoreProcess,
                                                      source: torch.Tensor) -> None:
    _forget(store)
    relay = Relay(store.url, cut=-1, direction="up", after=0)  # counts, never cuts
    try:
        with StoreClient(relay.url, NONE, pool=source, **OPTIONS) as writer:
            assert writer.connections == LANES
            put = writer.put(KEYS, range(COUNT))
        assert put.statuses == (BlockStatus.OK,) * COUNT and put.pinned_slots == ()
        assert len(relay.carried) == LANES
        for carried in relay.carried:  # every connection carried its quarter of the blocks
            assert carried["up"] >= COUNT // LANES * BLOCK

        target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
        slots = torch.randperm(COUNT, generator=torch.Generator().manual_seed(3)).tolist()
        with StoreClient(relay.url, NONE, pool=target, **OPTIONS) as reader:
            got = reader.get(KEYS, slots)
        assert got.statuses == (BlockStatus.OK,) * COUNT
        assert torch.equal(target[slots], source)  # every byte, each in its own slot
        for carried in relay.carried[LANES:]:
            assert carried["down"] >= COUNT // LANES * BLOCK
    finally:
        relay.close()


def test_statuses_come_back_in_key_order(store: StoreProcess, source: torch.Tensor) -> None:
    _forget(store)
    stored = [i for i in range(COUNT) if i % 3 != 1]
    with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
        assert writer.put([KEYS[i] for i in stored], stored).all_ok
    target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
    with StoreClient(store.url, NONE, pool=target, **OPTIONS) as reader:
        got = reader.get(KEYS, range(COUNT))
    assert got.statuses == tuple(BlockStatus.MISSING if i % 3 == 1 else BlockStatus.OK
                                 for i in range(COUNT))
    assert got.errors[1] == "the store does not hold this key" and got.errors[0] == ""
    assert torch.equal(target[stored], source[stored])
    assert bool((target[1::3] == POISON).all())  # a missing block's slot is left alone


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_connection_cut_mid_job_fails_its_own_blocks_only(op: str, store: StoreProcess,
                                                            source: torch.Tensor) -> None:
    _forget(store)
    if op == "get":
        with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
            assert writer.put(KEYS, range(COUNT)).all_ok
    # each lane carries 16 requests of 512 KiB: the cut lands after 3 of its 8 MiB
    relay = Relay(store.url, cut=1, direction="up" if op == "put" else "down", after=3 << 20)
    target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
    try:
        with StoreClient(relay.url, NONE, pool=source if op == "put" else target,
                         **OPTIONS) as client:
            result = getattr(client, op)(KEYS, range(COUNT))
            assert relay.was_cut.is_set()
            failed = [i for i, status in enumerate(result.statuses) if status is not BlockStatus.OK]
            assert failed, "the cut connection's blocks cannot all have made it"
            lanes = _lane_of_block(COUNT)
            cut_lane = lanes[failed[0]]
            assert {lanes[i] for i in failed} == {cut_lane}  # one lane's blocks, no other's
            assert 0 < len(failed) < COUNT // LANES  # its blocks after the cut, not before
            assert all(result.statuses[i] is BlockStatus.FAILED for i in failed)
            assert result.errors[failed[0]] == f"lost the connection to the store at {relay.url}"
            assert result.pinned_slots == ()
            # the same client goes on: the cut lane reconnected
            again = getattr(client, op)(KEYS[:8], range(8))
            assert again.statuses == (BlockStatus.OK,) * 8
    finally:
        relay.close()
    if op == "put":  # nothing corrupt stored: every key holds its bytes or nothing
        statuses = _check_in_store(store, source)
        assert all(statuses[i] is BlockStatus.OK for i in range(COUNT) if i not in failed)
    else:  # a failed block's slot is untouched, the others hold exactly their bytes
        ok = [i for i in range(COUNT) if i not in failed]
        assert torch.equal(target[ok], source[ok])
        assert bool((target[failed] == POISON).all())


def test_a_cut_between_the_frames_of_a_request_leaves_no_slot_pinned(
        store: StoreProcess, source: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """libzmq drops, without ever releasing them, the frames already queued of a message whose
    connection ends before its last frame: their trackers never finish. Nothing reads them once
    the closed socket is destroyed, so the put leaves none of its slots pinned."""
    _forget(store)
    relay = Relay(store.url, cut=-1, direction="up", after=0)  # cut by hand, below
    first_request: list[zmq.MessageTracker] = []
    send = Connection.send

    class CutAfterTheFirstFrame(list):
        def __init__(self, frames: list[Any], connection: Connection) -> None:
            super().__init__(frames)
            self.connection = connection

        def __iter__(self) -> Iterator[Any]:
            frames = super().__iter__()
            yield next(frames)
            relay.cut_now()
            # zmq's IO thread saw the cut once the monitor has its event (left unread); the
            # socket takes the news at its next send, the next frame's, once 1 ms has passed
            assert self.connection.monitor.poll(10_000)
            time.sleep(0.05)
            yield from frames

    def send_and_cut(connection: Connection, request: Exchange, **kwargs: Any) -> None:
        if request.frames and not first_request:
            request.frames = CutAfterTheFirstFrame(request.frames, connection)
            send(connection, request, **kwargs)
            first_request.extend(request.trackers)
        else:
            send(connection, request, **kwargs)

    monkeypatch.setattr(Connection, "send", send_and_cut)
    options = {**OPTIONS, "connections": 1, "timeout_s": 5.0}
    try:
        with StoreClient(relay.url, NONE, pool=source, **options) as client:
            result = client.put(KEYS, range(COUNT))
            assert result.statuses[:2] == (BlockStatus.FAILED,) * 2
            assert len(first_request) == 2
            first_request[1].wait(5)  # the frame after the cut was dropped and let go
            with pytest.raises(zmq.NotDone):
                first_request[0].wait(0.5)  # the one before it was dropped and never let go
            assert result.pinned_slots == () and client.pinned_slots == frozenset()
            again = client.put(KEYS[:8], range(8))  # the same client goes on
            assert again.statuses == (BlockStatus.OK,) * 8 and again.pinned_slots == ()
    finally:
        relay.close()
    statuses = _check_in_store(store, source)  # nothing corrupt stored
    assert statuses[:8] == (BlockStatus.OK,) * 8


def test_requests_are_dealt_by_their_blocks() -> None:
    sizes = {"a": 4, "b": 4, "c": 1, "d": 4, "e": 2, "f": 1}
    assert deal(list(sizes), 2, sizes.__getitem__) == [["a", "c", "e", "f"], ["b", "d"]]
    assert deal(list(sizes), 3, sizes.__getitem__) == [["a", "e"], ["b", "f"], ["c", "d"]]
    assert deal(list(sizes), 3) == [["a", "d"], ["b", "e"], ["c", "f"]]  # by count


def test_every_lane_carries_its_share_whatever_worker_the_keys_fall_on(
        tmp_path: Path, source: torch.Tensor) -> None:
    """Each lane has a connection to every worker: a job whose keys all fall on the first of
    three workers is still dealt evenly over the four lanes (with connections bound to one
    worker each, one connection carried it all)."""
    log = tmp_path / "store.log"
    with StoreProcess(log, capacity="96MiB", extra_args=("--workers", "3")) as store:
        relay = Relay(store.url, cut=-1, direction="up", after=0)  # before worker 0 only
        mine = [i for i in range(COUNT) if shard_of(KEYS[i], 3) == 0]
        share = (len(mine) // LANES - 2) * BLOCK  # a lane's blocks, give or take a request
        try:
            with StoreClient(relay.url, NONE, pool=source, **OPTIONS) as writer:
                assert writer.put([KEYS[i] for i in mine], mine).all_ok
            carried = sorted((c["up"] for c in relay.carried), reverse=True)
            assert len(mine) >= 2 * LANES and min(carried[:LANES]) >= share, carried

            target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
            start = len(relay.carried)
            with StoreClient(relay.url, NONE, pool=target, **OPTIONS) as reader:
                got = reader.get([KEYS[i] for i in mine], mine)
            assert got.statuses == (BlockStatus.OK,) * len(mine)
            assert torch.equal(target[mine], source[mine])
            others = [i for i in range(COUNT) if i not in mine]
            assert bool((target[others] == POISON).all())
            carried = sorted((c["down"] for c in relay.carried[start:]), reverse=True)
            assert min(carried[:LANES]) >= share, carried
        finally:
            relay.close()


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_cut_connection_to_one_worker_fails_its_own_blocks_only(
        op: str, tmp_path: Path, source: torch.Tensor) -> None:
    """One lane's connection to the first of three workers is cut mid-job: only blocks of
    that worker fail, not all of them (the other lanes' connections to it carry theirs), and
    every block of the other workers, sent or queued on the same lanes, arrives."""
    log = tmp_path / "store.log"
    with StoreProcess(log, capacity="96MiB", extra_args=("--workers", "3")) as store:
        if op == "get":
            with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
                assert writer.put(KEYS, range(COUNT)).all_ok
        first = {i for i in range(COUNT) if shard_of(KEYS[i], 3) == 0}
        # the first connection to carry 1 MiB of blocks is cut (a lane's share to worker 0
        # is about 2.7 MiB)
        relay = Relay(store.url, cut=None, direction="up" if op == "put" else "down",
                      after=1 << 20)
        target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
        try:
            with StoreClient(relay.url, NONE, pool=source if op == "put" else target,
                             **OPTIONS) as client:
                result = getattr(client, op)(KEYS, range(COUNT))
                assert relay.was_cut.is_set()
                failed = {i for i, s in enumerate(result.statuses) if s is not BlockStatus.OK}
                assert failed and failed < first, (sorted(failed), sorted(first))
                assert all(result.errors[i] == f"lost the connection to the store at "
                           f"{relay.url}" for i in failed)
                if op == "get":  # a failed block's slot is untouched, the others exact
                    ok = [i for i in range(COUNT) if i not in failed]
                    assert torch.equal(target[ok], source[ok])
                    assert bool((target[sorted(failed)] == POISON).all())
                again = getattr(client, op)(KEYS, range(COUNT))  # it reconnected
                assert again.statuses == (BlockStatus.OK,) * COUNT
        finally:
            relay.close()
        if op == "put":
            assert _check_in_store(store, source) == (BlockStatus.OK,) * COUNT
        else:
            assert torch.equal(target, source)
