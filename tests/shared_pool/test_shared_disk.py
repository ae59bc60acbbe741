"""The disk tier below a shared pool: a real `kvconnector pool serve` process, an engine of two
ranks (tests/shared_pool/disk_sides.py), each rank writing and reading its own part of every
slot to its own slab. Every load poisons every rank's destination first and compares every byte.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_sides import (
    BS,
    DISK_SLOTS,
    POISON,
    RANKS,
    DiskSide,
    hashes,
    load_child,
    rank_digest,
    store_child,
)

from kvconnector.servers.pool import PoolProcess
from transfer.checksums import block_checksum
from transfer.disk.slab import DiskError, SlabFile, open_direct, scan

CTX = mp.get_context("spawn")
TIMEOUT_S = 300.0
COUNT = 6


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    # 8 slots of 8 KiB: one 4 KiB part per rank
    with PoolProcess(tmp_path / "pool.log", f"d{uuid.uuid4().hex[:10]}", capacity="64KiB",
                     slot_bytes="8KiB") as process:
        yield process


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk"
    path.mkdir()
    try:
        os.close(open_direct(path / ".probe", os.O_RDWR | os.O_CREAT))
    except DiskError as exc:
        pytest.skip(f"no O_DIRECT under {path}: {exc}")
    (path / ".probe").unlink()
    return path


def run_child(target: Any, *args: Any) -> tuple[Any, int]:
    """Run `target(*args, conn)` in a spawned process: (what it sent or None, its exit code)."""
    conn, child_end = CTX.Pipe()
    process = CTX.Process(target=target, args=(*args, child_end), daemon=True)
    process.start()
    child_end.close()  # a child that dies closes the pipe: poll sees it at once
    answer = None
    if conn.poll(TIMEOUT_S):
        with contextlib.suppress(EOFError):
            answer = conn.recv()
    process.join(TIMEOUT_S)
    return answer, process.exitcode


def restart(pool: PoolProcess) -> None:
    """The daemon killed and started again: a new, empty segment."""
    pool.kill()
    pool.start()


def flip(slab: SlabFile, slot: int, offset: int) -> None:
    """Flip a bit of the block in `slot` (buffered and synced: O_DIRECT reads see it)."""
    position = slab.offset(slot) + offset
    with slab.path.open("r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


def assert_holds(side: DiskSide, written: list[list[torch.Tensor]]) -> None:
    """Every rank's cache holds what was written, block for block."""
    for rank in range(RANKS):
        for block in range(COUNT):
            assert torch.equal(side.rows[rank][block], written[rank][block]), (rank, block)


def test_shared_pool_to_disk_to_a_fresh_pool_in_a_new_process_is_bit_exact(
        pool: PoolProcess, disk: Path) -> None:
    """Stored into the shared pool and written through by each rank; the daemon restarted
    (its pool empty); a new engine process finds the blocks on disk, reads each rank's part into
    the new pool and its poisoned cache, bit-exact; they are committed there with their
    checksums, so a second load comes from the pool."""
    side = DiskSide(pool.name, disk)
    written = side.store("a", hashes("p", COUNT), seed=7)
    side.close()
    for rank in range(RANKS):  # each rank's slab holds its part of every block
        assert len(scan(disk, rank_digest(rank), DISK_SLOTS)) == COUNT
    restart(pool)
    answer, code = run_child(load_child, pool.name, str(disk), "p", COUNT)
    assert code == 0 and answer is not None
    split, failed, got, again = answer
    assert split == {"disk": COUNT} and failed == []
    for rank in range(RANKS):
        for block in range(COUNT):
            assert got[rank][block] == bytes(written[rank][block].numpy()), (rank, block)
    assert again == {"pool": COUNT}  # from the shared pool now


def test_after_a_daemon_restart_the_engine_maps_the_new_pool_and_reads_disk_into_it(
        pool: PoolProcess, disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine across a daemon restart: its workers map the new segment and rebind their
    disk I/O to it. Writes through carry the checksums the ranks committed: no block is hashed
    again to be written; reads hash every block, and the checksums they verified are the ones
    the blocks are committed with in the new pool (not hashed again there)."""
    import transfer.disk.slab as slab_module
    import transfer.slot_checker as checks_module

    hashed: list[bytes] = []  # by the disk tier
    pooled: list[bytes] = []  # by the shared pool's checks
    for module, calls in ((slab_module, hashed), (checks_module, pooled)):
        def counted(block: object, key: bytes, calls: list[bytes] = calls) -> int:
            calls.append(key)
            return block_checksum(block, key)

        monkeypatch.setattr(module, "block_checksum", counted)
    side = DiskSide(pool.name, disk)
    try:
        written = side.store("a", hashes("q", COUNT), seed=11)
        assert hashed == []  # every rank wrote its committed checksum
        assert len(pooled) == COUNT * RANKS  # each rank hashed its part once, to commit it
        segment = side.workers[0].pool.shared_name
        restart(pool)
        pooled.clear()
        split, events = side.load("b", hashes("q", COUNT))
        assert split == {"disk": COUNT} and not events.failed_block_ids
        assert all(w.pool.shared_name != segment for w in side.workers)
        assert len(hashed) == COUNT * RANKS  # each rank's read checked its part
        assert pooled == []
        assert_holds(side, written)
        # again: committed with the read's checksums, it comes from the pool, checked
        split, events = side.load("c", hashes("q", COUNT))
        assert split == {"pool": COUNT} and not events.failed_block_ids
        assert len(pooled) == COUNT * RANKS  # each rank checked its part, then copied it
        assert_holds(side, written)
    finally:
        side.close()


def test_flipped_slab_bytes_of_one_rank_are_recomputed(pool: PoolProcess, disk: Path) -> None:
    """A bit of rank 1's part of block 2 flipped on disk: the load fails from block 2 on (vLLM
    recomputes them), rank 1's cache never holds the bad bytes, and the block leaves the
    disk index and the pool."""
    side = DiskSide(pool.name, disk)
    try:
        written = side.store("a", hashes("f", COUNT), seed=13)
        restart(pool)
        slots = {key: slot for slot, key in scan(disk, rank_digest(1), DISK_SLOTS).items()}
        flip(side.workers[1].tiers["disk"].io.slab, slots[side.core.namespace.key(b"f2")], 1234)
        split, events = side.load("b", hashes("f", COUNT))
        assert split == {"disk": COUNT}
        assert events.failed_block_ids == set(range(2, COUNT))
        for block in range(COUNT):
            assert torch.equal(side.rows[0][block], written[0][block])
            if block < 2:
                assert torch.equal(side.rows[1][block], written[1][block])
            elif block == 2:  # the bad block was never copied
                assert bool((side.rows[1][block] == POISON).all())
        assert side.core.take_counters().flat()["disk_failed_reads"] == 1
        # the good head is on disk still, the bad block is not; the failed load left no key
        assert side.core.lookup("c", hashes("f", COUNT), 0, COUNT * BS + 1) \
            == 2 * BS
    finally:
        side.close()


def test_a_killed_writers_partial_blocks_are_never_served(pool: PoolProcess, disk: Path) -> None:
    """The engine process is SIGKILLed once its disk writes have written, in every rank's slab,
    every footer of the request and half of each block: a fresh engine finds the footers, but
    every read fails its checksum, nothing reaches the cache, every block is recomputed."""
    answer, code = run_child(store_child, pool.name, str(disk), "k", COUNT, 17, True)
    assert answer is None and code == -9
    restart(pool)
    side = DiskSide(pool.name, disk)
    try:
        hits = side.core.lookup("r", hashes("k", COUNT), 0, COUNT * BS + 1) // BS
        assert hits == COUNT  # every torn block's footers were found
        for rows in side.rows:
            rows.fill_(POISON)
        side.core.plan_load("r", hashes("k", COUNT), list(range(COUNT)), hits * BS)
        failed: set[int] = set()
        for _ in range(10):
            events = side.step()
            failed |= events.failed_block_ids
            if "r" in events.finished_loads and not side.core.has_jobs():
                break
        assert failed == set(range(hits))
        for rows in side.rows:
            assert bool((rows == POISON).all())
        assert side.core.lookup("s", hashes("k", COUNT), 0, COUNT * BS + 1) == 0
    finally:
        side.close()


def test_evict_policy_writes_the_blocks_this_engines_stores_evict(pool: PoolProcess,
                                                                  disk: Path) -> None:
    """Write-back below a shared pool of 8 slots: a second store of 6 blocks evicts 4 of the
    first 6, which each rank writes out of its part of the slots before its store reuses them;
    a load takes the rest from the pool and those from disk (evicting, and first writing out,
    4 of the second store's), every block bit-exact."""
    side = DiskSide(pool.name, disk, write_policy="evict")
    try:
        first = side.store("a", hashes("e", COUNT), seed=19)
        assert scan(disk, rank_digest(0), DISK_SLOTS) == {}  # nothing written yet
        side.store("b", hashes("o", COUNT), seed=23)
        keys = {side.core.namespace.key(h) for h in hashes("e", COUNT)}
        evicted = set(scan(disk, rank_digest(0), DISK_SLOTS).values())
        assert len(evicted) == 4 and evicted <= keys
        assert set(scan(disk, rank_digest(1), DISK_SLOTS).values()) == evicted
        split, events = side.load("c", hashes("e", COUNT))
        assert split == {"pool": 2, "disk": 4} and events.failed_block_ids == set()
        assert_holds(side, first)
        assert len(scan(disk, rank_digest(1), DISK_SLOTS)) == 8  # 4 of "o" written out
    finally:
        side.close()
