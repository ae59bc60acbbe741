"""Fuzzing the store: malformed frames, wrong types, truncated and oversized messages and wrong
checksums all get error replies (never an internal error), while a bystander keeps being served.

And a fuzz run: every attack of store_abuse.py at once against one store process, each attacker
a process of its own, for FUZZ_S seconds (KVCONNECTOR_STORE_FUZZ_S lengthens it), while a
well-behaved client checks every byte it puts and gets; then the store's memory, its stats at
once, and nothing left held. Its figures are printed (`pytest -s`; docs/protocol.md, "Limits").
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from store_bystander import DEADLINE_S, MiB, finish_attack, memory, start_attack, wait_for
from store_bystander import Bystander as RoundTrips
from store_peers import RawPeer

from kvconnector.servers.store import StoreProcess
from transfer.checksums import block_checksum
from transfer.keys import DIGEST_BYTES, Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient
from transfer.remote.store.protocol import (
    Limits,
    Op,
    Reply,
    decode_reply,
    encode_request,
    reply_statuses,
)
from transfer.remote.store.security import Security

MAX_BLOCK = 1 << 20  # the fuzzed store's block limit, and so its transport frame limit
NONE = Security.none()
NS = Namespace("fuzz", "bfloat16", 16, "BLNHC")
OTHER = Namespace("other", "bfloat16", 16, "BLNHC")
REFERENCE = NS.keys([b"reference-%d" % i for i in range(4)])
FUZZ = settings(max_examples=25, deadline=None, database=None)
_ABSENT = object()


class Bystander:
    """Another client getting the reference blocks over and over while the fuzzing runs."""

    def __init__(self, url: str, reference: torch.Tensor) -> None:
        self.url, self.reference, self.served, self.failures = url, reference, 0, []
        self._pool = torch.zeros_like(reference)
        self._client = StoreClient(url, NONE, namespace=NS, pool=self._pool)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for _ in range(100_000):  # bounded; stopped long before
            if self._stop.wait(0.002):
                break
            self._pool.zero_()
            result = self._client.get(REFERENCE, range(4))
            if result.all_ok and torch.equal(self._pool, self.reference):
                self.served += 1
            else:
                self.failures.append(result.errors)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "store.log"
    with StoreProcess(log, capacity="64MiB",
                      extra_args=("--max-block-size", str(MAX_BLOCK))) as proc:
        yield proc


@pytest.fixture(scope="module")
def bystander(store: StoreProcess) -> Iterator[Bystander]:
    reference = torch.randint(0, 256, (4, 4096), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(3))
    with StoreClient(store.url, NONE, namespace=NS, pool=reference) as writer:
        assert writer.put(REFERENCE, range(4)).all_ok
    watcher = Bystander(store.url, reference)
    yield watcher
    watcher.stop()


class FreshPeer:
    """A new connection per request: the store drops a connection that keeps sending invalid
    requests (test_remote_flood.py), and each example here sends one or two."""

    def __init__(self, url: str) -> None:
        self.url = url

    def request(self, frames: list[bytes], timeout_s: float) -> list[bytes] | None:
        peer = RawPeer(self.url)
        try:
            return peer.request(frames, timeout_s)
        finally:
            peer.close()


@pytest.fixture(scope="module")
def peer(store: StoreProcess, bystander: Bystander) -> FreshPeer:
    return FreshPeer(store.url)


def _ask(peer: FreshPeer, frames: list[bytes]) -> Reply:
    answer = peer.request(frames, timeout_s=10.0)
    assert answer is not None, "the store did not answer"
    assert len(answer) == 1, f"an error or put reply is one frame, got {len(answer)}"
    reply = decode_reply(answer[0])
    assert reply.code != "internal", reply.error
    return reply


def _put(keys: list[bytes], blocks: list[bytes],
         overrides: dict[str, Any] | None = None) -> list[bytes]:
    """A put request for `blocks` under `keys`, with header fields replaced (or _ABSENT)."""
    header = {"v": 1, "id": 77, "op": "put", "ns": NS.digest, "keys": keys,
              "sizes": [len(b) for b in blocks],
              "sums": [block_checksum(b, k) for b, k in zip(blocks, keys, strict=True)]}
    for name, value in (overrides or {}).items():
        if value is _ABSENT:
            del header[name]
        else:
            header[name] = value
    return [msgpack.packb(header, use_bin_type=True), *blocks]


_key_numbers = itertools.count()


def _fresh_keys(count: int) -> list[bytes]:
    """Keys no earlier example used, so what one example stored cannot blur the next."""
    return NS.keys([b"fuzz-%d" % next(_key_numbers) for _ in range(count)])


blocks_st = st.lists(st.binary(min_size=1, max_size=2048), min_size=1, max_size=4)
hashes_st = st.binary(min_size=1, max_size=40)
not_an_int = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=6),
                       st.binary(max_size=6), st.lists(st.integers(0, 3), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2))
WRONG_TYPES = {
    "v": not_an_int | st.just(_ABSENT),
    "id": not_an_int | st.integers(-(2**63), -1) | st.just(_ABSENT),
    "op": not_an_int.filter(lambda v: not isinstance(v, str)) | st.just(_ABSENT),
    "ns": st.one_of(not_an_int.filter(lambda v: not isinstance(v, bytes)),
                    st.binary(max_size=40).filter(lambda b: len(b) != DIGEST_BYTES),
                    st.just(_ABSENT)),
    "keys": st.one_of(not_an_int.filter(lambda v: not isinstance(v, list)),
                      st.lists(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3),
                               min_size=1, max_size=3),
                      st.just(_ABSENT)),
    "sizes": st.one_of(not_an_int.filter(lambda v: not isinstance(v, list)),
                       st.lists(st.floats() | st.text(max_size=2), min_size=1, max_size=3),
                       st.just(_ABSENT)),
    "sums": st.one_of(not_an_int.filter(lambda v: not isinstance(v, list)),
                      st.lists(st.integers(-(2**63), -1), min_size=1, max_size=3),
                      st.just(_ABSENT)),
}


@FUZZ
@given(header=st.binary(max_size=300), extra=st.lists(st.binary(max_size=64), max_size=3))
def test_garbage_headers(peer: FreshPeer, header: bytes, extra: list[bytes]) -> None:
    reply = _ask(peer, [header, *extra])
    assert not reply.ok and reply.code in {"malformed", "version", "frames"}


@FUZZ
@given(data=st.data(), field=st.sampled_from(sorted(WRONG_TYPES)), blocks=blocks_st)
def test_fields_of_the_wrong_type(peer: FreshPeer, data: st.DataObject, field: str,
                                  blocks: list[bytes]) -> None:
    keys = _fresh_keys(len(blocks))
    value = data.draw(WRONG_TYPES[field], label=field)
    reply = _ask(peer, _put(keys, blocks, {field: value}))
    assert (reply.ok, reply.code) == (False, "malformed")
    assert reply.request_id == (None if field == "id" else 77)


@FUZZ
@given(blocks=blocks_st.filter(lambda b: len(b) > 1), data=st.data())
def test_truncated_messages(store: StoreProcess, peer: FreshPeer, blocks: list[bytes],
                            data: st.DataObject) -> None:
    keys = _fresh_keys(len(blocks))
    frames = _put(keys, blocks)
    kept = data.draw(st.integers(0, len(blocks) - 1), label="frames kept")
    reply = _ask(peer, frames[:1 + kept])
    assert (reply.ok, reply.code) == (False, "frames")
    cut = data.draw(st.integers(0, len(blocks) - 1), label="block cut short")
    frames[1 + cut] = frames[1 + cut][:-1]
    statuses = reply_statuses(_ask(peer, frames), len(blocks))
    assert statuses[cut] is BlockStatus.SIZE
    with StoreClient(store.url, NONE, namespace=NS) as check:
        assert check.exists([keys[cut]]) == [False]


@FUZZ
@given(size=st.integers(MAX_BLOCK + 1, 2**40), count=st.integers(4097, 5000))
def test_oversized_declarations(peer: FreshPeer, size: int, count: int) -> None:
    key = NS.key(b"oversized")
    reply = _ask(peer, [encode_request(5, Op.PUT, NS.digest, [key], [size], [0]), b"x"])
    assert (reply.request_id, reply.ok, reply.code) == (5, False, "limit")
    keys = [NS.digest + i.to_bytes(4, "little") for i in range(count)]
    reply = _ask(peer, [encode_request(6, Op.GET, NS.digest, keys)])
    assert (reply.request_id, reply.ok, reply.code) == (6, False, "limit")


@FUZZ
@given(blocks=blocks_st, flips=st.lists(st.integers(1, 2**64 - 1), min_size=4, max_size=4))
def test_wrong_checksums(store: StoreProcess, peer: FreshPeer, blocks: list[bytes],
                         flips: list[int]) -> None:
    keys = _fresh_keys(len(blocks))
    frames = _put(keys, blocks)
    header = msgpack.unpackb(frames[0])
    header["sums"] = [s ^ f for s, f in zip(header["sums"], flips, strict=False)]
    frames[0] = msgpack.packb(header, use_bin_type=True)
    assert reply_statuses(_ask(peer, frames), len(blocks)) == [BlockStatus.CORRUPT] * len(blocks)
    with StoreClient(store.url, NONE, namespace=NS) as check:
        assert check.exists(keys) == [False] * len(blocks)


@FUZZ
@given(version=st.integers(2, 2**32), hashes=st.lists(hashes_st, min_size=1, max_size=3))
def test_version_and_namespace_mismatches(peer: FreshPeer, version: int,
                                          hashes: list[bytes]) -> None:
    frames = _put(NS.keys(hashes), [b"v"] * len(hashes), {"v": version})
    reply = _ask(peer, frames)
    assert (reply.ok, reply.code) == (False, "version")
    assert f"version {version}" in reply.error
    reply = _ask(peer, [encode_request(9, Op.GET, NS.digest, OTHER.keys(hashes))])
    assert (reply.request_id, reply.ok, reply.code) == (9, False, "namespace")


def test_a_frame_over_the_transport_limit_drops_only_that_peer(store: StoreProcess,
                                                               bystander: Bystander) -> None:
    key = NS.key(b"huge")
    huge = bytes(Limits(max_block_bytes=MAX_BLOCK).max_frame_bytes + 1)
    fuzzer = RawPeer(store.url)
    try:
        header = encode_request(1, Op.PUT, NS.digest, [key], [MAX_BLOCK], [0])
        assert fuzzer.request([header, huge], timeout_s=2.0) is None  # disconnected, no reply
        reply = decode_reply(fuzzer.request([encode_request(2, Op.PING)])[0])  # reconnected
        assert (reply.request_id, reply.ok) == (2, True)
    finally:
        fuzzer.close()


def test_the_bystander_was_served_throughout(bystander: Bystander) -> None:
    served_before = bystander.served
    with StoreClient(bystander.url, NONE) as client:
        stats = client.stats()
    assert stats["internal_errors"] == 0
    assert stats["request_errors"] > 0  # the fuzzing did reach the store
    assert stats["dropped_peers"] == 0  # one or two invalid requests per connection
    assert bystander.failures == []
    assert served_before > 0


FUZZ_S = float(os.environ.get("KVCONNECTOR_STORE_FUZZ_S", "12"))
ATTACKS = ("raw_bytes", "garbage", "msgpack", "huge_frames", "connections", "half_frames",
           "non_readers", "well_formed", "sigkill")
RUN_CAPACITY = 64 * MiB
RUN_BUDGET = 128 * MiB
# docs/protocol.md, "Memory bound": beyond capacity and budget, replies under 4 KiB (32 a
# connection, 1,024 connections: 128 MiB), zmq's memory per connection (~32 MiB), the request
# being served and what arrives between two checks, and the freed memory glibc keeps for the next
# put (transfer.remote.store.heap). Measured on the 2-core dev VM: 237-431 MiB over idle.
RUN_SLACK = 384 * MiB


def test_a_fuzz_run_of_every_attack_at_once(tmp_path: Path) -> None:
    with StoreProcess(tmp_path / "store.log", capacity=f"{RUN_CAPACITY}B",
                      extra_args=("--max-block-size", "1MiB", "--buffer-budget",
                                  f"{RUN_BUDGET}B")) as store:
        pid = store.process.pid
        idle = memory(pid)["VmRSS"]
        bystander = RoundTrips(store.url)  # connected before the attackers
        started = time.monotonic()
        attackers = [start_attack(kind, store.url, FUZZ_S, seed=seed)
                     for seed, kind in enumerate(ATTACKS)]
        try:
            runs = {summary["kind"]: summary for summary in (
                finish_attack(attacker, timeout_s=FUZZ_S + 120, terminate=False)
                for attacker in attackers)}
        finally:
            for attacker in attackers:
                if attacker.poll() is None:
                    attacker.kill()
                    attacker.wait()
            bystander.stop()
        duration = time.monotonic() - started
        peak = memory(pid)["VmHWM"] - idle
        asked = time.monotonic()
        with StoreClient(store.url, NONE, timeout_s=DEADLINE_S) as client:
            stats = client.stats()  # at once, the attackers gone
            answered_s = time.monotonic() - asked

            def released() -> bool:
                now = client.stats()
                return (now["pinned_blocks"], now["pending_bytes"], now["peers"]) == (0, 0, 1)

            assert wait_for(released, timeout_s=DEADLINE_S), client.stats()
            after = client.stats()
        figures = {
            "seconds": round(duration, 1), "messages": sum(r["messages"] for r in runs.values()),
            "connections": sum(r["opened"] for r in runs.values()),
            "most_held": runs["connections"]["most_held"],
            "rss_idle_mib": round(idle / MiB), "peak_over_idle_mib": round(peak / MiB),
            "rss_after_mib": round(memory(pid)["VmRSS"] / MiB),
            "stats_answered_s": round(answered_s, 3), "bystander_rounds": bystander.rounds,
            **{name: stats[name] for name in ("request_errors", "dropped_peers", "stalled_peers",
                                              "refused_peers", "dropped_replies",
                                              "internal_errors")}}
        print(f"store fuzz run: {json.dumps(figures)}")
        print(f"store fuzz attacks: {json.dumps(runs)}")
        assert bystander.failures == [] and bystander.rounds >= 3, (bystander.failures, figures)
        assert stats["internal_errors"] == 0 and runs["well_formed"]["internal"] == 0
        assert peak <= RUN_CAPACITY + RUN_BUDGET + RUN_SLACK, figures
        assert all(run["opened"] >= 1 for run in runs.values()), runs
        assert stats["request_errors"] > 0 and stats["dropped_peers"] >= 1
        assert runs["non_readers"]["hung_up"] >= 1  # dropped: over the budget, or stalled
        if runs["connections"]["most_held"] > stats["max_peers"]:
            assert stats["refused_peers"] >= 1
        # every connection holding a message begun was hung up on in time: dropped as stalled,
        # over the budget, or refused. Whether one lives to its stall timeout depends on the other
        # attacks' drops and refusals (test_remote_admission.py makes one stall); one that did
        # was dropped as stalled.
        assert runs["half_frames"]["outlived_stall"] == 0, runs["half_frames"]
        if runs["half_frames"]["past_stall"]:
            assert stats["stalled_peers"] >= 1, figures
        # held_bytes is the last 10 ms check's: it may count the observer's own stats request
        # (tens of bytes) if a check ran while it was being served; anything more was leaked
        assert after["held_bytes"] < 4096 and after["internal_errors"] == 0, after
        assert store.process.poll() is None
