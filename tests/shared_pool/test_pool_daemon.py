"""The pool daemon as a process: owner-only files, peers of another uid refused, one daemon per
name (a killed one's leftovers cleaned up), a misbehaving client dropped alone, `pool stats`."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import socket
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from pool_attackers import wait_for

from kvconnector.cli import main as cli_main
from kvconnector.layout.allocator import SHM_DIR
from kvconnector.servers.pool import PoolProcess
from transfer.keys import Namespace
from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError, SharedIndex

NS = Namespace(model="m", dtype="bf16", block_size=4, block_layout="x")
NOBODY = 65534


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", f"d{uuid.uuid4().hex[:10]}") as process:
        yield process


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_the_daemon_runs_the_parents_tree_whatever_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` would import a tree in the working directory before the parent's (another
    checkout, a benchmark's variant): the child must run the code its parent runs."""
    decoy = tmp_path / "cwd" / "kvconnector"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy tree was imported')\n")
    monkeypatch.chdir(decoy.parent)
    with PoolProcess(tmp_path / "pool.log", f"d{uuid.uuid4().hex[:10]}") as process:
        client = PoolClient(process.name, [NS], 100)
        try:
            assert client.info.slot_bytes > 0
        finally:
            client.close()
    assert "decoy" not in (tmp_path / "pool.log").read_text()


def segments_of(name: str) -> list[str]:
    return [f for f in os.listdir(SHM_DIR) if f.startswith(protocol.segment_prefix(name))]


def test_socket_and_segment_are_owner_only(pool: PoolProcess) -> None:
    assert stat.S_IMODE(os.stat(pool.path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o600
    (segment,) = segments_of(pool.name)
    assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, segment)).st_mode) == 0o600


def test_the_peer_check() -> None:
    protocol.check_peer(1000, 1000)
    with pytest.raises(PermissionError, match="uid 1001 may not use this pool: it belongs to "
                                              "uid 1000"):
        protocol.check_peer(1001, 1000)
    left, right = socket.socketpair(socket.AF_UNIX)
    try:
        assert protocol.peer_uid(left) == os.geteuid()
    finally:
        left.close()
        right.close()


def _connect_as_nobody(name: str, conn: mp.connection.Connection) -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        PoolClient(name, [NS], 100)
        conn.send("connected")
    except PoolError as exc:
        conn.send(str(exc))


def _as_nobody(name: str) -> str:
    ctx = mp.get_context("fork")  # the child needs no import: it may not read the tree as nobody
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_connect_as_nobody, args=(name, theirs))
    child.start()
    assert ours.poll(60), "the child did not answer"
    answer = ours.recv()
    child.join(60)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a process of another uid")
def test_another_uid_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="kvc-uid-", dir="/tmp"))
    os.chmod(runtime, 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with PoolProcess(tmp_path / "pool.log", f"u{uuid.uuid4().hex[:10]}") as pool:
        # The socket's directory and file keep other users out...
        assert "Permission denied" in _as_nobody(pool.name)
        # ... and were they opened up, the daemon's SO_PEERCRED check still refuses them.
        os.chmod(pool.path.parent, 0o711)
        os.chmod(pool.path, 0o666)
        assert f"uid {NOBODY} may not use this pool: it belongs to uid 0" in \
            _as_nobody(pool.name)
        client = PoolClient(pool.name, [NS], 100)  # its owner still gets in
        assert client.request(protocol.STATS)["refused"] == 1
        client.close()


def test_one_daemon_per_name_and_a_killed_ones_leftovers_go(pool: PoolProcess,
                                                            tmp_path: Path) -> None:
    from transfer.shared.daemon import PoolDaemon

    with pytest.raises(ValueError, match="already serves"):
        PoolDaemon(pool.name, 1 << 20, 4096)
    (first,) = segments_of(pool.name)
    pool.kill()
    assert pool.path.exists() and segments_of(pool.name) == [first]  # left behind
    pool.start()
    (second,) = segments_of(pool.name)
    assert second != first
    assert PoolClient(pool.name, [NS], 100).info.segment == second


def test_a_block_larger_than_a_slot_is_refused_at_hello(pool: PoolProcess) -> None:
    with pytest.raises(PoolError, match="--slot-bytes 65537 or more"):
        PoolClient(pool.name, [NS], 65537)


def test_a_misbehaving_client_is_dropped_alone(pool: PoolProcess) -> None:
    good = PoolClient(pool.name, [NS], 100)
    keys = NS.keys([b"g0"])
    placed = good.request(protocol.PREPARE_STORES, [keys])[0][0]
    good.notify(protocol.COMPLETE_STORE, placed, [True], [[7]])
    bad = socket.socket(socket.AF_UNIX)
    bad.connect(str(pool.path))
    bad.sendall(msgpack.packb([protocol.LOOKUP, keys]))  # before hello
    assert bad.recv(100) == b""  # dropped
    bad.close()
    rude = PoolClient(pool.name, [NS], 100)
    with pytest.raises(PoolError):  # another protocol's verb: dropped
        rude.request("format_disk")
    rude = PoolClient(pool.name, [NS], 100)
    with pytest.raises(ValueError, match="not of a namespace this client declared"):
        rude.request(protocol.LOOKUP, ["not a key"])  # a bad request: refused, still connected
    with pytest.raises(PoolError):  # a bad notice drops the connection
        rude.notify(protocol.COMPLETE_LOAD, "not a list of keys")
        rude.request(protocol.STATS)
    rude = PoolClient(pool.name, [NS], 100)
    unsummed = NS.keys([b"u0"])
    assert rude.request(protocol.PREPARE_STORES, [unsummed])[0][0] == unsummed
    with pytest.raises(PoolError):  # a commit without checksums drops it; its store fails
        rude.notify(protocol.COMPLETE_STORE, unsummed, [True], [None])
        rude.request(protocol.STATS)
    assert good.request(protocol.LOOKUP, keys) == 1  # unaffected
    assert good.request(protocol.LOOKUP, unsummed) == 0
    assert good.request(protocol.CHECKSUMS, keys) == [[7]]
    stats = good.request(protocol.STATS)
    assert (stats["clients"], stats["stored"], stats["storing"]) == (1, 1, 0)
    good.close()


def test_a_commit_by_slots_reaches_the_daemon_and_a_bad_one_drops_its_client(
        pool: PoolProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU writer's usual commit goes by the slots its plan gave (the client keeps them), its
    row sums as bytes; any other goes a key and a list a key. A commit by slots naming a slot
    past the pool's is a bad notice: its client goes, its store fails, the other's stand."""
    sent: list[str] = []
    notify = PoolClient.notify
    monkeypatch.setattr(PoolClient, "notify",
                        lambda self, verb, *args: (sent.append(verb), notify(self, verb, *args)))
    index = SharedIndex(pool.name, NS, 100, retry_s=0.0, row_sum_reader=True, needs_xxh3=False)
    keys, others = NS.keys([b"w0", b"w1"]), NS.keys([b"x0", b"x1"])
    index.prepare_stores([keys, others])
    index.complete_store(keys, True, [[None, 7], [None, (1 << 64) - 1]])
    index.complete_store(others, [True, False], [[None, 5], None])  # one failed: by keys
    assert sent[-2:] == [protocol.COMMIT_ROW_SUMS, protocol.COMPLETE_STORE]
    rude = PoolClient(pool.name, [NS], 100)
    theirs = NS.keys([b"r0"])
    assert rude.request(protocol.PREPARE_STORES, [theirs])[0][0] == theirs
    with pytest.raises(PoolError):
        rude.notify(protocol.COMMIT_ROW_SUMS, *protocol.pack_row_sums_commit([256], [[None, 1]]))
        rude.request(protocol.STATS)
    assert index.checksums(keys + others + theirs) == [[None, 7], [None, (1 << 64) - 1],
                                                       [None, 5], None, None]
    assert index.lookup_prefix(keys + others) == 3
    stats = index._client.request(protocol.STATS)  # type: ignore[union-attr]
    assert (stats["clients"], stats["stored"], stats["storing"]) == (1, 3, 0)
    assert index._placed == {}  # every store completed: no slot left to commit
    index.close()


def test_a_late_completion_after_close_commits_nothing_of_the_next_lease(
        pool: PoolProcess) -> None:
    """Closing the index ends its lease and forgets the slots its stores were given: a
    completion that comes after, of a store of the old lease, must not commit (by that slot)
    the block the next lease placed there."""
    index = SharedIndex(pool.name, NS, 100, retry_s=0.0, row_sum_reader=True, needs_xxh3=False)
    old, new = NS.keys([b"old"]), NS.keys([b"new"])
    first = index.prepare_store(old)
    index.close()
    watcher = PoolClient(pool.name, [NS], 100)
    wait_for(lambda: watcher.request(protocol.STATS)["clients"] == 1, "the closed lease to go")
    watcher.close()
    second = index.prepare_store(new)  # a new lease
    assert second.slots == first.slots  # the freed slot, handed out again
    index.complete_store(old, True, [[None, 7]])
    assert index.lookup_prefix(new) == 0 and index.checksums(new) == [None]
    index.complete_store(new, True, [[None, 8]])
    assert index.lookup_prefix(new) == 1 and index.checksums(new) == [[None, 8]]
    index.close()


def test_pool_stats_cli(pool: PoolProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["pool", "stats", "--name", pool.name]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["name"], stats["num_slots"], stats["slot_bytes"]) == (pool.name, 256, 65536)
    assert cli_main(["pool", "stats", "--name", "nonesuch"]) == 1
    assert "no pool daemon for 'nonesuch'" in capsys.readouterr().err


def test_serve_takes_what_lives_as_long_as_the_daemon_out_of_the_collectors_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What is alive when `pool serve` starts serving (torch's and numpy's imports, the empty
    index) is frozen: a full collection walks every tracked object, and over those it stopped
    every client's requests for 68-81 ms (an H200 machine's host) whenever Python ran one."""
    import transfer.shared.daemon as daemon_module
    from kvconnector.cli import pool as pool_cli

    frozen_when_serving: list[int] = []
    frozen_before: list[int] = []  # when the daemon is made and the signals are set: nothing yet

    class Daemon:  # the real one's startup is tested above; here, what runs around it
        path = "pool.sock"
        info = SimpleNamespace(segment="segment", num_slots=16, slot_bytes=65536)

        def __init__(self, *args: object, **kwargs: object) -> None:
            frozen_before.append(gc.get_freeze_count())

        def stop(self) -> None:
            pass

        def serve_forever(self) -> None:
            frozen_when_serving.append(gc.get_freeze_count())

    monkeypatch.setattr(daemon_module, "PoolDaemon", Daemon)
    monkeypatch.setattr(pool_cli, "stop_on_signals",
                        lambda stop: frozen_before.append(gc.get_freeze_count()))
    monkeypatch.setattr(pool_cli, "log_to_stderr", lambda: None)
    before = gc.get_freeze_count()
    try:
        assert pool_cli.main(["pool", "serve", "--name", "frozen", "--capacity", "1MiB",
                              "--slot-bytes", "64KiB"]) == 0
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector
    assert frozen_before == [before, before]
    assert len(frozen_when_serving) == 1
    assert frozen_when_serving[0] > before + 10_000  # pytest's and torch's objects at least


def test_an_engine_started_without_its_daemon_is_told_which() -> None:
    from transfer.shared.client import SharedIndex

    with pytest.raises(PoolError, match="no pool daemon for 'absent' at .*pool-absent.sock"):
        SharedIndex("absent", NS, 100)
