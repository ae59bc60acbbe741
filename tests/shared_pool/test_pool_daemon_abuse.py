"""The pool daemon against hostile or buggy clients, each attack from other processes against the
daemon as a process: it keeps serving, a legitimate client's blocks stay byte-exact meanwhile,
its memory stays bounded, and every slot is usable again once the attackers are gone."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pool_attackers import (
    NS,
    TIMEOUT_S,
    Attacker,
    Legit,
    Raw,
    TunedPool,
    frame,
    memory_kib,
    nested,
    reset_peak,
    wait_for,
)

from kvconnector.cli import main as cli_main
from kvconnector.servers.pool import PoolProcess
from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError

PARKED_BOUND_MIB = 128  # the daemon's peak RSS over its idle RSS under parked partial frames
BIG_SUMS = list(range(1 << 56, (1 << 56) + 128))  # 128 checksums of 9 packed bytes each


def pool_name() -> str:
    return f"a{uuid.uuid4().hex[:10]}"


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", pool_name()) as process:
        yield process


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[PoolProcess]:
    """16 slots: a leak of a few is a large share."""
    with PoolProcess(tmp_path / "pool.log", pool_name(), capacity="1MiB") as process:
        yield process


def alive(pool: PoolProcess) -> bool:
    assert pool.process is not None
    return pool.process.poll() is None


def drained(legit: Legit, clients: int = 1) -> dict[str, Any]:
    """Wait until only `clients` connections are left, then the stats."""
    return wait_for(lambda: (s := legit.stats())["clients"] == clients and s,
                    f"the daemon to hold only {clients} connection(s)")


# ---- requests the daemon must not unpack ---------------------------------------------------

@pytest.mark.parametrize(("data", "why"), [
    (nested(1000), "arrays nested deeper than 3"),
    (nested(2000), "not a request"),  # past msgpack's own stack
    (frame("lookup", nested(1000, msgpack.packb(b"k" * 20))), "arrays nested deeper than 3"),
    (msgpack.packb(["lookup", [[[b"k" * 20]]]]), "arrays nested deeper than 3"),
    (msgpack.packb(["lookup", {"a": 1}]), "exceeds max_map_len"),
    (msgpack.packb(["lookup", {}]), "a map: no request has one"),
    (msgpack.packb(["lookup", msgpack.ExtType(5, b"x")]), "exceeds max_ext_len"),
    (msgpack.packb(["lookup", msgpack.ExtType(5, b"")]), "an extension type \\(5\\)"),
    (msgpack.packb(["v" * 100_000]), "not a request"),
    (msgpack.packb("lookup"), "a request is an array"),
    (msgpack.packb([7, 8]), "a request is an array"),
    (msgpack.packb(["format_disk"]), "unknown verb 'format_disk'"),
    (msgpack.packb(["lookup"]), "lookup takes 1 arguments, got 0"),
    (msgpack.packb(["stats", 1]), "stats takes 0 arguments, got 1"),
    (b"\xc1", "not a request"),
    (b"\x92\xa6lookup", "not a request"),  # truncated
], ids=lambda value: value[:40].hex() if isinstance(value, bytes) else None)
def test_read_request_refuses_what_no_request_has(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why) as refused:
        protocol.read_request(data)
    assert len(str(refused.value)) < 400


def test_read_request_takes_every_verb_and_bounds_size() -> None:
    keys = NS.keys([b"a", b"b"])
    for verb, args in [(protocol.HELLO, [[NS.digest], 100]), (protocol.LOOKUP, [keys]),
                       (protocol.PREPARE_STORES, [[keys, keys]]),
                       (protocol.COMPLETE_STORE, [keys, [True, False], [[1, 2], None]]),
                       (protocol.STATS, []), (protocol.CLEAR, [])]:
        verb_read, args_read = protocol.read_request(msgpack.packb([verb, *args]))
        assert verb_read == verb
        assert json.dumps(args_read, default=bytes.hex) == json.dumps(args, default=bytes.hex)
    big = msgpack.packb(["lookup", [b"k" * 200] * 5])
    assert len(big) == 1019 and protocol.read_request(big, 1019)[0] == "lookup"
    with pytest.raises(ValueError, match="a request of 1019 B is over the limit of 1018 B"):
        protocol.read_request(big, 1018)


def test_brief_quotes_a_short_prefix() -> None:
    assert protocol.brief("x" * 10_000) == repr("x" * 64) + "... (a str of 10000 chars)"
    assert protocol.brief(b"\x01" * 10_000) == "10000 bytes " + "01" * 32 + "..."
    assert protocol.brief(nested_list(5000)) == "an array of 1 items"
    assert protocol.brief(7) == "7" and protocol.brief(None) == "None"


def nested_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# ---- 1: deep msgpack, before and after hello -------------------------------------------------

def send_deep(conn: Connection, path: Path) -> None:
    """Nested arrays before any hello, then after it in a lookup; reports whether each
    connection was dropped."""
    outcomes = []
    before = Raw(path)
    before.send(nested(1000))  # 1,001 bytes
    outcomes.append(before.dropped())
    after = Raw(path)
    after.hello()
    after.send(frame("lookup", nested(1000, msgpack.packb(NS.key(b"deep")))))
    outcomes.append(after.dropped())
    deeper = Raw(path)
    deeper.hello()
    deeper.send(frame("lookup", nested(5000)))
    outcomes.append(deeper.dropped())
    conn.send(outcomes)


def test_deep_msgpack_before_or_after_hello_never_stops_the_daemon(pool: PoolProcess) -> None:
    legit = Legit(pool.name)
    assert legit.round_trip() == 4
    attacker = Attacker(send_deep, pool.path)
    assert attacker.answer() == [True, True, True]  # each dropped alone
    assert alive(pool)
    assert legit.round_trip() == 4
    stats = drained(legit)
    assert stats["dropped"] == 3
    legit.every_slot_usable()
    log = pool.log_path.read_text()
    assert "arrays nested deeper than 3" in log and "RecursionError" not in log
    legit.close()


# ---- error texts and log lines quote a short prefix -------------------------------------------

def send_oversized_fields(conn: Connection, path: Path) -> None:
    """Oversized fields in an answered request, a request and a verb: the answers' lengths
    (None: dropped without one)."""
    lengths: list[int | None] = []
    client = Raw(path)
    client.hello()
    client.request(protocol.LOOKUP, [b"\x07" * 200])  # a foreign key, of a size keys may have
    ok, text = client.answer()
    lengths.append(None if ok else len(text))
    for message in (["lookup", [b"\x07" * (1 << 20)]], ["v" * (1 << 20)],
                    ["hello", ["n" * (1 << 20)], 100]):
        raw = Raw(path)
        if message[0] != "hello":
            raw.hello()
        raw.send(msgpack.packb(message))
        try:
            ok, text = raw.answer()
        except EOFError:
            lengths.append(None)
        else:
            lengths.append(len(str(text)))
        raw.close()
    conn.send(lengths)


def test_errors_and_log_lines_quote_a_short_prefix(pool: PoolProcess) -> None:
    legit = Legit(pool.name)
    log_before = pool.log_path.stat().st_size
    lengths = Attacker(send_oversized_fields, pool.path).answer()
    assert lengths[0] is not None and lengths[0] < 400  # refused: a prefix of the key
    assert all(length is None or length < 1024 for length in lengths[1:]), lengths
    assert alive(pool) and legit.round_trip() == 4
    drained(legit)
    grown = pool.log_path.stat().st_size - log_before
    assert grown < 8192, f"the log grew by {grown} B for 3 MiB of bad fields"
    legit.close()


# ---- 2: connections past the descriptor limit, and over the cap ---------------------------------

def hold_connections(conn: Connection, path: Path, count: int) -> None:
    """Open `count` connections, then say hello on each; reports (connected, answered hello,
    refused) and holds them until "close"."""
    held, answered, refused = [], 0, 0
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except OSError:  # the backlog is full
            sock.close()
            continue
        held.append(sock)
    for sock in held:
        sock.settimeout(TIMEOUT_S)
        raw = Raw(None, sock)
        raw.request(protocol.HELLO, [NS.digest], 100)
        try:
            ok, _ = raw.answer()
        except (EOFError, OSError):
            refused += 1
        else:
            answered += ok
            refused += not ok
    conn.send((len(held), answered, refused))
    conn.recv()
    for sock in held:
        sock.close()
    conn.send("closed")


def test_connections_past_the_descriptor_limit_are_survived(pool: PoolProcess) -> None:
    assert pool.process is not None
    pid = pool.process.pid
    legit = Legit(pool.name)
    # The daemon's soft limit is cut to 40 descriptors over what it has open now: accept()
    # fails with EMFILE after about 40 of the attacker's 300 connections.
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 40, hard))
    attacker = Attacker(hold_connections, pool.path, 300)
    connected, answered, refused = attacker.answer()
    assert connected > 60 and 0 < answered <= 40 and answered + refused == connected
    assert alive(pool)
    assert legit.round_trip() == 4  # served throughout
    stats = legit.stats()
    assert stats["accept_errors"] > 0 and stats["refused_busy"] > 0
    assert attacker.ask("close") == "closed"
    drained(legit)
    late = Legit(pool.name, "late")  # descriptors back: a new client gets in
    assert late.round_trip() == 4
    late.close()
    legit.every_slot_usable()
    assert legit.stats()["max_clients"] == 1024  # RLIMIT_NOFILE was 20,000 at its start
    legit.close()


def test_connections_over_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    with TunedPool(tmp_path / "pool.log", pool_name(), max_clients=8) as pool:
        legit = Legit(pool.name)
        assert legit.stats()["max_clients"] == 8
        attacker = Attacker(hold_connections, pool.path, 30)
        connected, answered, refused = attacker.answer()
        assert (connected, answered, refused) == (30, 7, 23)
        with pytest.raises(PoolError, match="maximum of 8 connections"):
            PoolClient(pool.name, [NS], 100)
        assert legit.round_trip() == 4
        attacker.ask("close")
        drained(legit)
        assert legit.stats()["refused_busy"] == 24
        legit.every_slot_usable()
        legit.close()


# ---- 3: a second hello ----------------------------------------------------------------------

def hello_twice(conn: Connection, name: str, tag: str) -> None:
    """Store a key, say hello again (the answer reported), store another; wait to be killed."""
    client = PoolClient(name, [NS], 100)
    first = client.request(protocol.PREPARE_STORES, [NS.keys([f"{tag}-a".encode()])])[0][0]
    try:
        client.request(protocol.HELLO, [NS.digest], 100)
    except ValueError as exc:
        second = str(exc)
    else:
        second = "accepted"
    after = client.request(protocol.PREPARE_STORES, [NS.keys([f"{tag}-b".encode()])])[0][0]
    conn.send((len(first), second, len(after)))
    conn.recv()


def test_a_second_hello_is_refused_and_no_lease_leaks(small_pool: PoolProcess) -> None:
    legit = Legit(small_pool.name)
    attackers = [Attacker(hello_twice, small_pool.name, f"t{i}") for i in range(7)]
    for attacker in attackers:
        placed, second, after = attacker.answer()
        assert (placed, after) == (1, 1)
        assert "already said hello" in second
    leases = {lease["pid"]: lease for lease in legit.stats()["leases"]}
    for attacker in attackers:  # each attacker's one lease holds both its stores
        assert leases[attacker.pid]["storing"] == 2
    assert legit.stats()["busy_slots"] == 14
    for attacker in attackers:
        attacker.kill()
    drained(legit)
    legit.every_slot_usable()  # all 16
    assert legit.round_trip() == 4
    legit.close()


# ---- 4: malformed commits -------------------------------------------------------------------

BAD_COMMITS = {
    "a key twice": (lambda k: ([k[0], k[0]], [True, True], [[1], [1]]), "named twice"),
    "flags short": (lambda k: (k, [True], [[1], [2]]), "one ok flag and one checksum list"),
    "a flag not a bool": (lambda k: (k, [True, 1], [[1], [2]]), "not a bool"),
    "a checksum negative": (lambda k: (k, [True, True], [[1], [-1]]), "not a uint64"),
    "checksums nested": (lambda k: (k, [True, True], [[1], [[2]]]), "nested deeper than 3"),
    "a foreign key": (lambda k: ([k[0], b"\x00" * 40], [True, True], [[1], [2]]),
                      "not of a namespace"),
}


def commit_badly(conn: Connection, name: str) -> None:
    """For each case on a new connection: begin two stores, commit them with the case's
    commit; reports the keys and whether the daemon dropped the connection for it."""
    while (case := conn.recv()) != "exit":
        client = PoolClient(name, [NS], 100)
        keys = NS.keys([f"{case}-0".encode(), f"{case}-1".encode()])
        assert client.request(protocol.PREPARE_STORES, [keys])[0][0] == keys
        client.notify(protocol.COMPLETE_STORE, *BAD_COMMITS[case][0](keys))
        try:
            client.request(protocol.STATS)
        except PoolError:
            conn.send((keys, True))
        else:
            conn.send((keys, False))


def test_a_malformed_commit_is_refused_whole(small_pool: PoolProcess) -> None:
    legit = Legit(small_pool.name)
    checker = PoolClient(small_pool.name, [NS], 100)  # the attacker's namespace
    attacker = Attacker(commit_badly, small_pool.name)
    for case, (_, why) in BAD_COMMITS.items():
        keys, dropped = attacker.ask(case)
        assert dropped, f"{case}: a malformed commit must drop its client"
        wait_for(lambda: legit.stats()["clients"] == 2, "the attacker's connection to go")
        # Nothing of the commit took: neither key is stored, neither has checksums, and both
        # can be stored afresh.
        assert checker.request(protocol.LOOKUP, keys[:1]) == 0, case
        assert checker.request(protocol.CHECKSUMS, keys) == [None, None], case
        assert checker.request(protocol.PREPARE_STORES, [keys])[0][0] == keys, case
        checker.notify(protocol.COMPLETE_STORE, keys, [False, False], [None, None])
        assert why in small_pool.log_path.read_text(), case
        legit.every_slot_usable()
        assert legit.round_trip() == 4
    attacker.conn.send("exit")
    checker.close()
    legit.close()


def commit_never_begun_and_unpin_others(conn: Connection, name: str, keys: list[bytes]) -> None:
    """A well-formed client of the same namespace: commits keys it never began, completes
    loads (and discards nothing) of keys another client pinned."""
    client = PoolClient(name, [NS], 100)
    never = NS.keys([b"never-0", b"never-1"])
    client.notify(protocol.COMPLETE_STORE, never, [True, True], [[1], [2]])
    for _ in range(5):
        client.notify(protocol.COMPLETE_LOAD, keys)
    conn.send(client.request(protocol.CHECKSUMS, never))


def test_commits_never_begun_and_others_pins_are_ignored(small_pool: PoolProcess) -> None:
    owner = PoolClient(small_pool.name, [NS], 100)
    keys = NS.keys([b"pinned-0", b"pinned-1"])
    owner.request(protocol.PREPARE_STORES, [keys])
    owner.notify(protocol.COMPLETE_STORE, keys, [True, True], [[1], [2]])
    assert owner.request(protocol.PREPARE_LOAD, keys) is not None
    assert Attacker(commit_never_begun_and_unpin_others, small_pool.name, keys).answer() \
        == [None, None]
    # Still pinned: a client storing into every slot gets all but those two.
    legit = Legit(small_pool.name)
    fill = NS.keys([f"f{i}".encode() for i in range(16)])
    placed = owner.request(protocol.PREPARE_STORES, [fill])[0][0]
    assert len(placed) == 14
    owner.notify(protocol.COMPLETE_STORE, placed, [False] * 14, [None] * 14)
    owner.close()
    drained(legit)
    legit.every_slot_usable()
    legit.close()


# ---- 5: parked partial frames, unread answers, deadlines -------------------------------------

def park_partial_frames(conn: Connection, path: Path, count: int, ints: bool) -> None:
    """`count` connections, each 4 MiB into an unfinished request (a declared 8 MiB key, or an
    array of a million ints, the kind that costs most once unpacked); holds them until told."""
    held = []
    if ints:
        header = b"\x92\xa6lookup\xdd" + (4 << 20).to_bytes(4, "big")
        body = b"\xd0\x80" * (2 << 20)
    else:
        header = b"\x92\xa6lookup\x91\xc6" + (8 << 20).to_bytes(4, "big")
        body = b"\x5a" * (4 << 20)
    for _ in range(count):
        raw = Raw(path)
        raw.hello()
        if raw.send(header) and raw.send(body):
            held.append(raw)
        else:
            raw.close()
    conn.send("parked")
    conn.recv()


def test_parked_partial_frames_hold_bounded_memory(pool: PoolProcess) -> None:
    assert pool.process is not None
    pid = pool.process.pid
    legit = Legit(pool.name)
    assert legit.round_trip() == 4
    idle = memory_kib(pid)["VmRSS"]
    reset_peak(pid)
    attackers = [Attacker(park_partial_frames, pool.path, 24, i == 0) for i in range(4)]
    for attacker in attackers:  # 96 connections, 384 MiB of unfinished requests sent
        assert attacker.answer() == "parked"
    assert alive(pool)
    assert legit.round_trip() == 4
    peak = memory_kib(pid)["VmHWM"]
    print(f"daemon RSS idle {idle >> 10} MiB, peak under parked frames {peak >> 10} MiB")
    assert peak - idle < PARKED_BOUND_MIB << 10, f"peak RSS {peak} KiB, idle {idle} KiB"
    stats = legit.stats()
    assert stats["pending_bytes"] <= 32 << 20 and stats["dropped"] > 0
    for attacker in attackers:
        attacker.kill()
    drained(legit)
    legit.every_slot_usable()
    legit.close()


def leave_answers_unread(conn: Connection, name: str, path: Path, connections: int) -> None:
    """Commit a key with 128 checksums; then say hello on `connections` connections, and on
    each ask three times for those checksums 800 times over (~1 MiB an answer), reading
    nothing."""
    client = PoolClient(name, [NS], 100)
    key = NS.key(b"big-sums")
    client.request(protocol.PREPARE_STORES, [[key]])
    client.notify(protocol.COMPLETE_STORE, [key], [True], [BIG_SUMS])
    assert client.request(protocol.CHECKSUMS, [key]) != [None]
    silent = [Raw(path) for _ in range(connections)]
    for raw in silent:
        raw.hello()
    for raw in silent:
        for _ in range(3):
            raw.request(protocol.CHECKSUMS, [key] * 800)
    conn.send("unread")
    conn.recv()


def test_answers_left_unread_never_block_the_loop(pool: PoolProcess) -> None:
    legit = Legit(pool.name)
    attacker = Attacker(leave_answers_unread, pool.name, pool.path, 4)
    assert attacker.answer() == "unread"
    started = time.monotonic()
    stats = legit.stats()
    waited = time.monotonic() - started
    # Answered while all four clients still leave their answers unread (a loop that waited on
    # them would have dropped some by now, 5 s each), and promptly.
    assert stats["clients"] == 6, stats["clients"]
    assert waited < 10.0, f"a ping waited {waited:.1f} s behind clients that do not read"
    assert stats["unsent_bytes"] > 0
    assert legit.round_trip() == 4
    attacker.kill()
    drained(legit)
    legit.every_slot_usable()
    legit.close()


def stall(conn: Connection, name: str, path: Path) -> None:
    """Three clients that stall: one holding slots leaves an answer unread, one holding slots
    stops mid-request, and a connection never says hello."""
    partial = Raw(path)
    partial.hello()
    partial.request(protocol.PREPARE_STORES, [NS.keys([b"p0", b"p1"])])
    assert len(partial.answer()[1][0][0]) == 2
    partial.send(b"\x92\xa6lookup\x92")
    unread = Raw(path)
    unread.hello()
    keys = NS.keys([b"u0", b"u1", b"u2"])
    unread.request(protocol.PREPARE_STORES, [keys])
    assert len(unread.answer()[1][0][0]) == 3
    unread.request(protocol.COMPLETE_STORE, keys[:1], [True], [BIG_SUMS])
    unread.request(protocol.CHECKSUMS, keys[:1] * 800)  # ~1 MiB, never read
    mute = Raw(path)
    conn.send("stalled")
    conn.recv()
    mute.close()


def test_clients_past_a_deadline_are_dropped_and_their_slots_come_back(tmp_path: Path) -> None:
    with TunedPool(tmp_path / "pool.log", pool_name(), capacity=1 << 20, reply_timeout_s=1.0,
                   partial_timeout_s=1.0, hello_timeout_s=1.0) as pool:
        legit = Legit(pool.name)
        attacker = Attacker(stall, pool.name, pool.path)
        assert attacker.answer() == "stalled"
        stats = drained(legit)  # the attacker still runs: the daemon dropped all three
        assert attacker.process.is_alive()
        assert stats["dropped"] == 3 and stats["unsent_bytes"] == stats["pending_bytes"] == 0
        log = pool.log_path.read_text()
        for why in ("left an answer unread for 1.0 s", "and not the rest within 1.0 s",
                    "no hello within 1.0 s"):
            assert why in log
        legit.every_slot_usable()
        assert legit.round_trip() == 4
        attacker.kill()
        legit.close()


# ---- 6: what each client holds ----------------------------------------------------------------

def hold_some(conn: Connection, name: str) -> None:
    """Store three keys, commit two, pin those (one twice); wait to be killed."""
    client = PoolClient(name, [NS], 100)
    keys = NS.keys([b"h0", b"h1", b"h2"])
    client.request(protocol.PREPARE_STORES, [keys])
    client.notify(protocol.COMPLETE_STORE, keys[:2], [True, True], [[1], [2]])
    assert client.request(protocol.PREPARE_LOAD, keys[:2]) is not None
    assert client.request(protocol.PREPARE_LOAD, keys[:1]) is not None
    conn.send("held")
    conn.recv()


def test_stats_show_what_each_client_holds(pool: PoolProcess,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    attacker = Attacker(hold_some, pool.name)
    assert attacker.answer() == "held"
    assert cli_main(["pool", "stats", "--name", pool.name]) == 0
    stats = json.loads(capsys.readouterr().out)
    (held,) = [lease for lease in stats["leases"] if lease["pid"] == attacker.pid]
    assert (held["storing"], held["pinned"], held["pinned_keys"]) == (1, 3, 2)
    assert (stats["storing"], stats["pinned"], stats["busy_slots"]) == (1, 3, 3)
    (own,) = [lease for lease in stats["leases"] if lease["pid"] == os.getpid()]
    assert (own["storing"], own["pinned"], own["pinned_keys"]) == (0, 0, 0)
    attacker.kill()
    legit = Legit(pool.name)
    stats = drained(legit)
    assert [lease["pid"] for lease in stats["leases"]] == [os.getpid()]
    assert stats["busy_slots"] == 0
    legit.close()
