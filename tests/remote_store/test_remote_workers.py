"""A store of several worker processes (`store serve --workers N`), as real processes: every byte
through every worker, each key on its own worker, combined lookups, exists, deletes and stats,
misrouted keys refused, security on every worker, a flood at one worker (its own admission
limits), workers gone with their parent, a client finding a restarted store's new workers (an
idle lookup client too), and a call to workers that are gone failing at one timeout in all."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
from store_bystander import Bystander, memory
from store_peers import RawPeer
from test_remote_flood import BUFFER_BOUND, CAPACITY, _flood

from kvconnector.servers.store import StoreProcess
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.admission import buffer_budget
from transfer.remote.store.client import StoreClient, StoreError
from transfer.remote.store.connection import Exchange
from transfer.remote.store.lanes import Lanes
from transfer.remote.store.protocol import (
    PROTOCOL_VERSION,
    Limits,
    Op,
    ProtocolError,
    decode_reply,
    encode_request,
)
from transfer.remote.store.security import Security
from transfer.remote.store.shards import shard_of, split, sum_stats, worker_urls
from transfer.remote.store.workers import default_workers, worker_settings

BLOCK = 64 << 10
COUNT = 96
WORKERS = 3
NONE = Security.none()
NS = Namespace("model-a", "bfloat16", 16, "workers")
KEYS = NS.keys([b"w-%d" % i for i in range(COUNT)])
POISON = 0xA5
OPTIONS = {"namespace": NS, "timeout_s": 30.0, "connections": 2,
           "put_batch_bytes": 2 * BLOCK, "get_batch_bytes": 4 * BLOCK}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    log = tmp_path_factory.mktemp("workers") / "store.log"
    with StoreProcess(log, capacity="96MiB",
                      extra_args=("--workers", str(WORKERS), "--io-threads", "3")) as proc:
        yield proc


@pytest.fixture(scope="module")
def source() -> torch.Tensor:
    generator = torch.Generator().manual_seed(33)
    return torch.randint(0, 256, (COUNT, BLOCK), dtype=torch.uint8, generator=generator)


def _ports(url: str, security: Security = NONE) -> list[int]:
    peer = RawPeer(url, security)
    try:
        reply = peer.request([encode_request(1, Op.PING)], timeout_s=30.0)
    finally:
        peer.close()
    assert reply is not None
    return decode_reply(reply[0]).fields["shards"]


def _forget(store: StoreProcess) -> None:
    with StoreClient(store.url, NONE, namespace=NS) as admin:
        admin.delete(KEYS)


def test_keys_split_by_hash_and_answers_combine() -> None:
    owners = [shard_of(key, WORKERS) for key in KEYS]
    assert set(owners) == set(range(WORKERS))  # 96 keys reach every worker
    assert shard_of(KEYS[0], 1) == 0
    positions = split(KEYS, WORKERS)
    assert sorted(sum(positions, [])) == list(range(COUNT))
    assert all(owners[i] == worker for worker, mine in enumerate(positions) for i in mine)
    assert all(mine == sorted(mine) for mine in positions)  # in the keys' order
    assert worker_urls("tcp://10.0.0.5:7000", None) == ["tcp://10.0.0.5:7000"]
    assert worker_urls("tcp://10.0.0.5:7000", [7000, 41000, 41001]) == [
        "tcp://10.0.0.5:7000", "tcp://10.0.0.5:41000", "tcp://10.0.0.5:41001"]
    assert worker_urls("tcp://[::1]:7000", [7000, 9]) == ["tcp://[::1]:7000", "tcp://[::1]:9"]
    for bad in ([7000], [7000, 0], [7000, 70000], [7000, True], "7000,7001", {}):
        with pytest.raises(ProtocolError, match="ping reply shards must be a list"):
            worker_urls("tcp://10.0.0.5:7000", bad)
    total = sum_stats([{"protocol": 1, "workers": 2, "worker": 0, "blocks": 3, "security": "none",
                        "capacity_bytes": 10},
                       {"protocol": 1, "workers": 2, "worker": 1, "blocks": 4, "security": "none",
                        "capacity_bytes": 10}])
    assert total == {"protocol": 1, "workers": 2, "blocks": 7, "security": "none",
                     "capacity_bytes": 20}


def test_worker_settings_split_the_store() -> None:
    assert [default_workers(cores) for cores in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8, 8]
    limits = Limits()
    first, *others = worker_settings("tcp://0.0.0.0:7000", 1000, NONE, workers=4, io_threads=8,
                                     verify_threads=4, buffer_budget_bytes=8 << 30)
    assert first.listen == "tcp://0.0.0.0:7000" and first.shard == (0, 4)
    assert [s.listen for s in others] == ["tcp://0.0.0.0:*"] * 3
    assert [s.shard for s in others] == [(1, 4), (2, 4), (3, 4)]
    assert {(s.capacity_bytes, s.io_threads, s.verify_threads, s.buffer_budget_bytes)
            for s in (first, *others)} == {(250, 2, 1, 8 << 30)}
    # each worker the whole budget (one connection may hold four of the largest requests)
    eight = worker_settings("tcp://127.0.0.1:*", 1 << 30, NONE, workers=8, io_threads=8,
                            verify_threads=4)
    assert {s.buffer_budget_bytes for s in eight} == {buffer_budget(limits)}
    assert {(s.io_threads, s.verify_threads) for s in eight} == {(1, 0)}  # puts checked inline
    assert worker_settings("tcp://[::1]:5", 10, NONE, workers=2)[1].listen == "tcp://[::1]:*"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"workers must be an int >= 1, got {bad!r}"):
            worker_settings("tcp://127.0.0.1:*", 1000, NONE, workers=bad)
    with pytest.raises(ValueError, match="capacity must be at least one byte per worker"):
        worker_settings("tcp://127.0.0.1:*", 3, NONE, workers=4)


def test_every_byte_through_every_worker(store: StoreProcess, source: torch.Tensor) -> None:
    _forget(store)
    ports = _ports(store.url)
    assert len(ports) == WORKERS and ports[0] == int(store.url.rsplit(":", 1)[1])
    with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
        put = writer.put(KEYS, range(COUNT))
        assert writer.connections == 2  # lanes, each with a connection to every worker
    assert put.statuses == (BlockStatus.OK,) * COUNT and put.pinned_slots == ()
    target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
    slots = torch.randperm(COUNT, generator=torch.Generator().manual_seed(5)).tolist()
    with StoreClient(store.url, NONE, pool=target, **OPTIONS) as reader:
        got = reader.get(KEYS, slots)
        stats = reader.stats()
    assert got.statuses == (BlockStatus.OK,) * COUNT
    assert torch.equal(target[slots], source)  # every byte, each in its own slot
    assert stats["workers"] == WORKERS and "worker" not in stats
    assert stats["blocks"] == COUNT and stats["used_bytes"] == COUNT * BLOCK
    assert stats["capacity_bytes"] == WORKERS * ((96 << 20) // WORKERS)
    assert stats["get_blocks"] >= COUNT and stats["requests_ping"] >= 1
    # each worker holds exactly its own keys: asked directly, one worker at a time
    host = store.url.rsplit(":", 1)[0]
    for worker, port in enumerate(ports):
        peer = RawPeer(f"{host}:{port}")
        try:
            mine = [key for key in KEYS if shard_of(key, WORKERS) == worker]
            reply = decode_reply(peer.request([encode_request(2, Op.EXISTS, NS.digest, mine)],
                                              timeout_s=30.0)[0])
            assert reply.ok and reply.fields["found"] == [True] * len(mine)
            raw = peer.request([encode_request(3, Op.STATS)], timeout_s=30.0)
            worker_stats = msgpack.unpackb(raw[0])["stats"]
            assert worker_stats["worker"] == worker and worker_stats["blocks"] == len(mine)
        finally:
            peer.close()


def test_misrouted_keys_are_refused(store: StoreProcess, source: torch.Tensor) -> None:
    _forget(store)
    ports = _ports(store.url)
    host = store.url.rsplit(":", 1)[0]
    foreign = next(key for key in KEYS if shard_of(key, WORKERS) == 0)
    peer = RawPeer(f"{host}:{ports[1]}")
    try:
        header = encode_request(7, Op.PUT, NS.digest, [foreign], [BLOCK], [0])
        reply = decode_reply(peer.request([header, bytes(BLOCK)], timeout_s=30.0)[0])
    finally:
        peer.close()
    assert not reply.ok and reply.code == "shard" and reply.request_id == 7
    assert f"belongs to worker 0 of {WORKERS}, not to this worker 1" in reply.error
    with StoreClient(store.url, NONE, namespace=NS) as admin:
        assert admin.exists([foreign]) == [False]  # nothing stored by the refused put
        assert admin.stats()["request_errors"] >= 1
    # a client pointed at a worker that is not the first takes it for a whole store: refused
    with StoreClient(f"{host}:{ports[1]}", NONE, namespace=NS, timeout_s=30.0) as lost, \
            pytest.raises(StoreError, match=r"the store refused the request \(shard\)"):
        lost.exists(KEYS)


def test_lookup_exists_delete_combine_workers(store: StoreProcess,
                                              source: torch.Tensor) -> None:
    _forget(store)
    held = [i for i in range(COUNT) if i not in (40, 70)]
    with StoreClient(store.url, NONE, pool=source, **OPTIONS) as client:
        assert client.put([KEYS[i] for i in held], held).all_ok
        assert client.lookup(KEYS) == 40  # the first key missing, whichever worker has it
        assert client.lookup(KEYS[41:]) == 70 - 41
        assert client.lookup(KEYS[71:]) == COUNT - 71
        assert client.exists(KEYS) == [i in held for i in range(COUNT)]
        gone = [3, 39, 95]
        assert client.delete([KEYS[i] for i in (*gone, 40)]) == [True, True, True, False]
        assert client.lookup(KEYS) == 3
        assert client.exists(KEYS) == [i in held and i not in gone for i in range(COUNT)]
        assert client.stats()["blocks"] == len(held) - len(gone)


def test_workers_end_with_their_parent(tmp_path: Path) -> None:
    proc = StoreProcess(tmp_path / "store.log", capacity="16MiB", extra_args=("--workers", "3"))
    proc.start()
    try:
        children = _children(proc.process.pid)
        assert len(children) >= WORKERS - 1  # the workers (and multiprocessing's helper)
        proc.kill()  # SIGKILL: no cleanup in the parent
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in children):
            assert time.monotonic() < deadline, f"workers {children} outlived their parent"
            time.sleep(0.1)
    finally:
        proc.stop()


def test_the_store_ends_when_a_worker_dies(tmp_path: Path) -> None:
    proc = StoreProcess(tmp_path / "store.log", capacity="16MiB", extra_args=("--workers", "3"))
    proc.start()
    try:
        workers = [pid for pid in _children(proc.process.pid) if _is_worker(pid)]
        assert len(workers) == WORKERS - 1
        os.kill(workers[0], signal.SIGKILL)  # its keys are gone: the store must not go on
        assert proc.process.wait(60) == 1
        for pid in workers[1:]:  # the other workers went with it
            deadline = time.monotonic() + 60
            while os.path.exists(f"/proc/{pid}") and not _zombie(pid):
                assert time.monotonic() < deadline, f"worker {pid} outlived the store"
                time.sleep(0.1)
        log = (tmp_path / "store.log").read_text()
        assert re.search(r"store worker kvconnector-store-[12] ended \(exit code -9\): "
                         r"stopping the store", log), log[-2000:]
    finally:
        proc.stop()


def test_a_client_finds_a_restarted_stores_workers(tmp_path: Path,
                                                   source: torch.Tensor) -> None:
    proc = StoreProcess(tmp_path / "store.log", capacity="32MiB", extra_args=("--workers", "2"))
    proc.start()
    options = {**OPTIONS, "timeout_s": 5.0}
    try:
        with StoreClient(proc.url, NONE, pool=source, **options) as client:
            assert client.put(KEYS, range(COUNT)).all_ok and client.connections == 2
            proc.kill()
            proc.extra_args = ("--workers", "3")
            proc.start()  # same first port, new workers on other ports
            client.put(KEYS, range(COUNT))  # may fail where it still used the old workers
            assert client.put(KEYS, range(COUNT)).all_ok
            assert client.stats()["workers"] == WORKERS
        target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
        with StoreClient(proc.url, NONE, pool=target, **options) as reader:
            assert reader.get(KEYS, range(COUNT)).all_ok
        assert torch.equal(target, source)
    finally:
        proc.stop()


def test_an_idle_lookup_client_finds_a_restarted_stores_workers(tmp_path: Path,
                                                               source: torch.Tensor) -> None:
    """A scheduler's lookup client, idle while its store is killed and restarted on the same
    address: its next lookup asks the store for its workers again (they listen on new ports) and
    is answered. With the old ports kept, it waited out its timeout at each dead worker in turn,
    then failed, and a shutdown joining its thread waited as long."""
    proc = StoreProcess(tmp_path / "store.log", capacity="32MiB",
                        extra_args=("--workers", str(WORKERS)))
    proc.start()
    try:
        with StoreClient(proc.url, NONE, pool=source, **OPTIONS) as writer:
            assert writer.put(KEYS, range(COUNT)).all_ok
        with StoreClient(proc.url, NONE, namespace=NS, timeout_s=10.0) as lookups:
            assert lookups.lookup(KEYS) == COUNT and lookups.connections == 1
            old_ports = _ports(proc.url)
            workers = [pid for pid in _children(proc.process.pid) if _is_worker(pid)]
            assert len(workers) == WORKERS - 1
            proc.kill()
            deadline = time.monotonic() + 60
            while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in workers):
                assert time.monotonic() < deadline, f"workers {workers} outlived their parent"
                time.sleep(0.1)
            proc.start()  # empty, the same first port, the other workers elsewhere
            new_ports = _ports(proc.url)
            assert new_ports[0] == old_ports[0] and len(new_ports) == WORKERS
            assert lookups.lookup(KEYS) == 0  # answered by the new workers: none held
            assert lookups.exists(KEYS[:4]) == [False] * 4
    finally:
        proc.stop()


def test_a_call_to_workers_that_are_gone_fails_at_one_timeout(tmp_path: Path) -> None:
    """Requests to several workers nobody listens for any more (one lane, so sent in turn)
    all fail by the call's timeout: a request that waits for a connection does not start a
    timeout of its own after the previous one's ran out."""
    ports = []
    for _ in range(4):  # free ports, closed again: connections to them are refused
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    timeout_s = 2.0
    lanes = Lanes([f"tcp://127.0.0.1:{port}" for port in ports], NONE, count=1,
                  max_frame_bytes=1 << 20, max_in_flight=8)
    requests = [Exchange(shard + 1, encode_request(shard + 1, Op.PING), shard=shard)
                for shard in range(len(ports))]
    answered = []
    started = time.monotonic()
    try:
        lanes.exchange(requests, lambda _, request, __: answered.append(request), timeout_s)
    finally:
        lanes.close()
    waited = time.monotonic() - started
    assert not answered
    assert all("no connection to the store" in request.error for request in requests), \
        [request.error for request in requests]
    # one timeout, not one per worker (4 x 2 s before)
    assert timeout_s * 0.9 <= waited < 2 * timeout_s, waited


def test_every_worker_checks_the_secret(tmp_path: Path, source: torch.Tensor) -> None:
    (tmp_path / "secret").write_text("correct horse battery staple\n")
    (tmp_path / "wrong").write_text("correct horse battery stapler\n")
    good = Security.shared_secret(tmp_path / "secret")
    args = ("--security", "secret", "--secret-file", str(tmp_path / "secret"))
    with StoreProcess(tmp_path / "store.log", capacity="32MiB", security_args=args,
                      extra_args=("--workers", str(WORKERS))) as proc:
        with StoreClient(proc.url, good, pool=source, **OPTIONS) as client:
            assert client.put(KEYS, range(COUNT)).all_ok
        ports = _ports(proc.url, good)
        host = proc.url.rsplit(":", 1)[0]
        for port in ports:
            for security in (Security.shared_secret(tmp_path / "wrong"), NONE):
                peer = RawPeer(f"{host}:{port}", security)
                try:  # refused before any request is read
                    assert peer.request([encode_request(1, Op.STATS)], timeout_s=3.0) is None
                finally:
                    peer.close()
        with StoreClient(proc.url, Security.shared_secret(tmp_path / "wrong"), pool=source,
                         **{**OPTIONS, "timeout_s": 10.0}) as intruder:
            result = intruder.put(KEYS[:4], range(4))
        assert result.statuses == (BlockStatus.FAILED,) * 4
        assert "refused this client's credentials" in result.errors[0]
        with StoreClient(proc.url, good, namespace=NS) as admin:
            stats = admin.stats()
            deadline = time.monotonic() + 60  # a worker counts a refusal once its monitor says
            while stats["auth_refused"] <= WORKERS and time.monotonic() < deadline:
                time.sleep(0.2)
                stats = admin.stats()
        assert stats["workers"] == WORKERS and stats["blocks"] == COUNT
        # the wrong secret at each worker and the intruder's ping; a peer of another mode may
        # hang up before its worker's monitor names the failure (test_remote_security: same)
        assert stats["auth_refused"] >= WORKERS + 1
        assert stats["protocol"] == PROTOCOL_VERSION and stats["security"] == "secret"


@pytest.mark.parametrize("kind", ["garbage", "big_frames"])
def test_a_flood_at_one_worker_is_dropped_there(kind: str, tmp_path: Path) -> None:
    with StoreProcess(tmp_path / "store.log", capacity=f"{CAPACITY}B",
                      extra_args=("--workers", "2")) as proc:
        workers = [proc.process.pid, *(c for c in _children(proc.process.pid) if _is_worker(c))]
        assert len(workers) == 2, workers
        host = proc.url.rsplit(":", 1)[0]
        second = SimpleNamespace(url=f"{host}:{_ports(proc.url)[1]}")
        bystander = Bystander(proc.url)  # its keys on both workers
        # Each worker's baseline once it has served requests (the request path's imports and
        # buffers), as the one-worker test's store has when it is measured.
        deadline = time.monotonic() + 60
        while bystander.rounds < 2 and not bystander.failures and time.monotonic() < deadline:
            time.sleep(0.1)
        idle = {pid: memory(pid)["VmRSS"] for pid in workers}
        try:
            summary = _flood(kind, second, bystander)
        finally:
            bystander.stop()
        assert bystander.failures == []
        with StoreClient(proc.url, NONE, timeout_s=30.0) as client:
            stats = client.stats()  # both workers, right after the flood
        with StoreClient(second.url, NONE, timeout_s=30.0) as client:
            flooded = client.stats()  # that worker alone (its ping names no workers)
        # the flood may be stopped before it reads the hang-up: the worker's count is the proof
        assert flooded["workers"] == 2 and flooded["dropped_peers"] >= 1, (flooded, summary)
        assert stats["internal_errors"] == 0 and proc.process.poll() is None
        # The store's bound (docs/protocol.md, "Memory bound"): capacity plus each worker's own
        # buffer budget (BUFFER_BOUND: a budget and what arrives between two checks); the flooded
        # worker alone within its capacity share and its own bound.
        peaks = {pid: memory(pid)["VmHWM"] - idle[pid] for pid in workers}
        assert sum(peaks.values()) <= CAPACITY + len(workers) * BUFFER_BOUND, (kind, peaks,
                                                                              summary)
        assert peaks[workers[1]] <= CAPACITY // len(workers) + BUFFER_BOUND, (kind, peaks,
                                                                              summary)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _is_worker(pid: int) -> bool:
    try:
        return b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
            b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
