"""Engines in separate processes sharing one pool daemon (a real `kvconnector pool serve`
process), through the connector's scheduler and worker cores (tests/shared_pool/pool_sides.py).

Every load poisons its destination first and compares every byte; every fault is a SIGKILL of a
real process: a writer mid-store (half of each slot written), a reader mid-load, the daemon.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pool_sides import (
    BS,
    NS,
    OTHER_NS,
    POISON,
    TIMEOUT_S,
    Child,
    Side,
    fill,
    flip,
    hashes,
    reader_child,
    writer_child,
)

from kvconnector.servers.pool import PoolProcess
from transfer.checksums import block_checksum
from transfer.shared import protocol
from transfer.shared.client import PoolClient

SLOTS = 16  # 64KiB of 4KiB slots


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", f"t{uuid.uuid4().hex[:10]}", capacity="64KiB",
                     slot_bytes="4KiB") as process:
        yield process


def stats(name: str) -> dict[str, Any]:
    client = PoolClient(name, [NS], 1)
    try:
        return client.request(protocol.STATS)
    finally:
        client.close()


def wait_for(name: str, **expected: int) -> dict[str, Any]:
    """The daemon's stats once they show `expected` (a dead peer's lease goes when the daemon
    reads its EOF); fails after a generous deadline."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        current = stats(name)
        if all(current[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            assert {k: current[k] for k in expected} == expected
            return current
        time.sleep(0.05)


def expected_rows(seed: int, count: int, row_bytes: int) -> list[torch.Tensor]:
    return fill(torch.empty(count, row_bytes, dtype=torch.uint8), list(range(count)), seed)


def assert_loaded(side: Side, blocks: list[int], want: list[torch.Tensor]) -> None:
    for block, data in zip(blocks, want, strict=True):
        assert torch.equal(side.rows[block], data), f"block {block} differs"


def store_in(writer: Child, reader: Side, tag: str, count: int, seed: int) -> list[torch.Tensor]:
    """`writer` stores `count` blocks under `tag`; the bytes they hold, in `reader`'s rows."""
    assert writer.ask(("store", tag, count, seed)) == "stored"
    return expected_rows(seed, count, reader.rows.shape[1])


def load_all(side: Side, req: str, tag: str, blocks: list[int],
             want: list[torch.Tensor]) -> None:
    """`side` loads every block of `tag` (poisoned first) into `blocks`: each is `want`'s."""
    assert side.load(req, hashes(tag, len(blocks)), blocks)[0] == len(blocks)
    assert_loaded(side, blocks, want)


@pytest.fixture
def sides(pool: PoolProcess) -> Iterator[tuple[Child, Side]]:
    """(writer, reader): an engine process that stores on command (`writer_child`), killed at
    the end, and an engine in the test process."""
    writer = Child(writer_child, pool.name)
    reader = Side(pool.name)
    try:
        yield writer, reader
    finally:
        writer.kill()
        reader.close()


def test_blocks_stored_by_one_process_load_bit_exact_in_another(
        pool: PoolProcess, sides: tuple[Child, Side]) -> None:
    writer, reader = sides
    want = store_in(writer, reader, "p", 5, 1)
    reader.rows.fill_(POISON)
    hits, events = reader.load("r", hashes("p", 5), [11, 3, 14, 7, 9])
    assert hits == 5
    assert events.finished_loads == {"r"} and not events.failed_loads
    assert_loaded(reader, [11, 3, 14, 7, 9], want)
    assert all(bool((reader.rows[b] == POISON).all()) for b in (0, 1, 2))  # untouched
    # Each block carries the checksum its writer took (one rank: one), bound to its key.
    keys = NS.keys(hashes("p", 5))
    assert reader.index.checksums(keys) == [[block_checksum(w.numpy(), k)]
                                            for w, k in zip(want, keys, strict=True)]
    writer.exit()
    # The writer is gone; its blocks stay: a restarted engine finds its prefix.
    restarted = Side(pool.name)
    try:
        load_all(restarted, "r2", "p", [0, 1, 2, 3, 4], want)
    finally:
        restarted.close()
    # Left: the reader and this query.
    assert wait_for(pool.name, pinned=0, storing=0, stored=5)["clients"] == 2


def test_a_slot_flipped_after_its_commit_is_never_loaded(sides: tuple[Child, Side]) -> None:
    writer, reader = sides
    want = store_in(writer, reader, "c", 4, 11)
    flip(reader, NS.keys(hashes("c", 4))[2], 100)  # one bit of the third block's slot
    blocks = [12, 4, 9, 1]
    hits, events = reader.load("r", hashes("c", 4), blocks)
    assert hits == 4  # the index cannot know: the load's check does
    assert events.finished_loads == events.failed_loads == {"r"}
    assert events.failed_block_ids == {9, 1}  # vLLM recomputes from the flipped block on
    assert_loaded(reader, [12, 4], want[:2])  # the head before it is good and kept
    assert bool((reader.rows[[9, 1]] == POISON).all())  # nothing copied from it on
    counters = reader.core.take_counters()
    assert (counters.checksum_failures, counters.failed_loads) == (1, 1)
    assert counters.load_bytes == 2 * reader.rows.shape[1]
    # The failed load's keys leave the pool, so the recomputed blocks are stored again.
    assert reader.core.lookup("q", hashes("c", 4), 0, 100) == 0
    store_in(writer, reader, "c", 4, 11)
    assert reader.load("r2", hashes("c", 4), blocks)[1].failed_loads == set()
    assert_loaded(reader, blocks, want)
    assert reader.core.take_counters().checksum_failures == 0


def test_writer_killed_mid_store_never_serves_its_half_written_slots(
        pool: PoolProcess, sides: tuple[Child, Side]) -> None:
    writer, reader = sides
    assert writer.ask(("hold", "k", 4, 2)) == "storing"
    assert wait_for(pool.name, storing=4)["stored"] == 4
    # Being written: never a hit, never loadable.
    assert reader.load("r", hashes("k", 4), [0, 1, 2, 3])[0] == 0
    assert reader.index.prepare_load(NS.keys(hashes("k", 1))) is None
    writer.kill()
    wait_for(pool.name, storing=0, stored=0, free=SLOTS, failed_stores=4)
    assert reader.load("r", hashes("k", 4), [0, 1, 2, 3])[0] == 0
    # The slots are free again: the reader stores the same hashes and loads them back.
    written = reader.store("a", hashes("k", 4), [4, 5, 6, 7], seed=3)
    load_all(reader, "b", "k", [8, 9, 10, 11], written)


def test_reader_killed_mid_load_releases_its_pins(pool: PoolProcess) -> None:
    writer = Side(pool.name)
    reader = Child(reader_child, pool.name, "q", 4)
    try:
        writer.store("w", hashes("q", 4), [0, 1, 2, 3], seed=4)
        assert reader.answer() == 4
        wait_for(pool.name, pinned=4)
        # Pinned blocks are never evicted: of 16 new blocks only the 12 free slots take any.
        writer.store("x", hashes("x", 16), list(range(16)), seed=5)
        counters = writer.core.take_counters()
        assert (counters.unplaced_blocks, counters.evictions) == (4, 0)
        reader.kill()
        wait_for(pool.name, pinned=0)
        # Now they are evicted like any idle block (the least recently used).
        writer.store("y", hashes("y", 4), [0, 1, 2, 3], seed=6)
        assert writer.core.take_counters().evictions == 4
        assert writer.core.lookup("z", hashes("q", 4), 0, 100) == 0
        assert writer.core.lookup("z", hashes("x", 12), 0, 100) == 12 * BS
    finally:
        reader.kill()
        writer.close()


def test_daemon_killed_loads_fail_then_both_sides_reconnect(
        pool: PoolProcess, sides: tuple[Child, Side]) -> None:
    writer, reader = sides
    want = store_in(writer, reader, "d", 3, 7)
    load_all(reader, "r0", "d", [0, 1, 2], want)  # maps the first segment
    old_segment = reader.index.segment
    # A lookup hits, then the daemon dies before the load pins: the load fails.
    reader.rows[[4, 5, 6]] = POISON
    assert reader.core.lookup("r1", hashes("d", 3), 0, 100) == 3 * BS
    pool.kill()
    reader.core.plan_load("r1", hashes("d", 3), [4, 5, 6], 3 * BS)
    events = reader.step()
    assert events.finished_loads == events.failed_loads == {"r1"}
    assert events.failed_block_ids == {4, 5, 6}
    assert bool((reader.rows[[4, 5, 6]] == POISON).all())  # nothing loaded
    # While it is down: no hits (recompute), no stores.
    assert reader.core.lookup("r2", hashes("d", 3), 0, 100) == 0
    reader.store("s", hashes("s", 2), [8, 9], seed=8)
    assert reader.core.take_counters().unplaced_blocks == 2
    pool.start()  # a stale socket and segment are cleaned up
    assert reader.core.lookup("r3", hashes("d", 3), 0, 100) == 0  # a new, empty pool
    assert reader.index.segment != old_segment
    # The writer's engine reconnects on its next call and stores into the new segment;
    # the reader maps it at its next job.
    store_in(writer, reader, "d", 3, 7)
    load_all(reader, "r4", "d", [10, 11, 12], want)
    assert reader.worker.pool.shared_name == reader.index.segment


def test_a_foreign_namespace_is_never_served(pool: PoolProcess) -> None:
    owner = Side(pool.name)
    other = Side(pool.name, OTHER_NS)
    try:
        owner.store("a", hashes("f", 3), [0, 1, 2], seed=9)
        # The same block hashes in another model's namespace: no hit.
        assert other.load("b", hashes("f", 3), [3, 4, 5])[0] == 0
        assert bool((other.rows[[3, 4, 5]] == POISON).all())
        # Naming another namespace's keys outright is refused.
        with pytest.raises(ValueError, match="not of a namespace this client declared"):
            other.index._client.request(protocol.PREPARE_LOAD, NS.keys(hashes("f", 3)))
        # reset_cache of one model drops only its own blocks.
        other.store("c", hashes("g", 2), [6, 7], seed=10)
        other.core.reset()
        assert other.core.lookup("d", hashes("g", 2), 0, 100) == 0
        assert owner.core.lookup("e", hashes("f", 3), 0, 100) == 3 * BS
    finally:
        owner.close()
        other.close()
