"""Stores committed by their row sums, their xxh3s taken after the commit, over a real pool
daemon (a `kvconnector pool serve` process) and the connector's vLLM-free cores.

A GPU writer commits as soon as its copy is done, with the row sums its copy took; its xxh3s
come later (its checker threads, held here by a gate), taken only of slots whose row sums still
match the commit. Until they are attached a block is served to readers that check by row sums
only: an xxh3 reader and the disk below the pool see it once its xxh3 was computed and checked.
Workers here run on the CPU (their copy engines take row sums with the same torch code a GPU's
kernels match); which checks a worker takes is set on its PoolChecks, as a GPU's would be.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pool_sides import POISON, TIMEOUT_S, fill, hashes

from kvconnector.layout import KVLayout
from kvconnector.layout.allocator import allocate
from kvconnector.offload.jobs import JobReport, StepJobs, TransferEvents
from kvconnector.offload.loads import POOL
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from kvconnector.servers.pool import PoolProcess
from transfer import slot_checker
from transfer.checksums import block_checksum
from transfer.copy.base import ThreadBackend
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.disk.io import DiskIO
from transfer.disk.planner import DiskPlanner
from transfer.disk.slab import SlabFile
from transfer.disk.worker import DiskWorker
from transfer.keys import Namespace
from transfer.shared import protocol
from transfer.shared.client import PoolClient, PoolError, SharedIndex
from transfer.shared.index import SharedBlockIndex
from transfer.shared.mapping import SharedPart
from transfer.tier import TierOp

BS = 4
NS = Namespace(model="late", dtype="bfloat16", block_size=BS, block_layout="test")
OTHER_NS = Namespace(model="elsewhere", dtype="bfloat16", block_size=BS, block_layout="test")
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=32, block_size=BS,
                  dtype=torch.bfloat16, order="BLNHC")  # 4 KiB a block: a disk's whole page
DISK_SLOTS = 32


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", f"t{uuid.uuid4().hex[:10]}", capacity="64KiB",
                     slot_bytes="4KiB") as process:
        yield process


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every hash after a commit waits until the event is set (set at the end)."""
    opened = threading.Event()
    original = slot_checker._hash_checked_part

    def gated(*args: Any) -> list[int | None]:
        if not opened.wait(TIMEOUT_S):
            raise RuntimeError("the gate stayed shut")
        return original(*args)

    monkeypatch.setattr(slot_checker, "_hash_checked_part", gated)
    yield opened
    opened.set()


class Engine:
    """One engine of one rank over pool `name`: a scheduler core and a worker over a CPU
    cache. `row_sums`: its worker takes and checks row sums (a GPU worker's checks);
    `row_sum_reader`: its index says so to the daemon; `disk`: a disk tier below the pool,
    its slab there (`write_policy`: "through" writes stored blocks, "evict" evicted ones)."""

    def __init__(self, name: str, *, row_sums: bool, row_sum_reader: bool = False,
                 disk: Path | None = None, write_policy: str = "through") -> None:
        self.cache = allocate(LAYOUT, num_blocks=16, device="cpu")
        self.rows = self.cache.block_chunks()
        block = int(self.rows.shape[1])
        self.index = SharedIndex(name, NS, block, retry_s=0.0, row_sum_reader=row_sum_reader)
        self.disk = None if disk is None else DiskPlanner(NS, DISK_SLOTS, "lru", write_policy,
                                                          {})
        self.core = OffloadScheduler(NS, self.index.num_slots, BS, 1, index=self.index,
                                     tiers=[] if self.disk is None else [self.disk])
        self.worker = OffloadWorker({f"l{i}": v for i, v in enumerate(self.cache.layer_views())},
                                    0, backend=ThreadBackend(), mapping=SharedPart(name, 0))
        assert self.worker.checks is not None
        self.worker.checks.row_sums = row_sums  # as on a GPU (True) or a CPU (False)
        if disk is not None:
            slab = SlabFile(disk, NS.digest, block, DISK_SLOTS)
            self.worker.attach(DiskWorker(DiskIO(slab, None, threads=2), 0))
        self.jobs: list[StepJobs] = []

    def step(self) -> TransferEvents:
        """One engine step, its copies waited for but never the hashes after a commit."""
        jobs = self.core.build_step()
        self.jobs.append(jobs)
        with torch.inference_mode():
            self.worker.flush(jobs)
            self.worker.start_loads(jobs)
            self.worker.submit_stores(jobs)
            if self.worker.engine is not None:
                self.worker.checks.loads.submit_all(self.worker.engine)  # type: ignore
                self.worker.engine.wait()
            for tier in self.worker.tiers.values():
                tier.wait()
            events = self.worker.poll()
        self.core.complete(self.worker.take_report())
        return events

    def steps_until(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            assert time.monotonic() < deadline, "not done in time"
            self.step()
            time.sleep(0.005)

    def store(self, req: str, tags: list[bytes], seed: int) -> list[torch.Tensor]:
        """Store blocks 0.. under `tags` until committed (not waiting for their xxh3s)."""
        written = fill(self.rows, list(range(len(tags))), seed)
        self.core.plan_stores(req, tags, list(range(len(tags))), len(tags) * BS)
        keys = NS.keys(tags)
        self.steps_until(lambda: None not in self.index.checksums(keys))
        return written

    def load(self, req: str, tags: list[bytes]) -> tuple[int, TransferEvents]:
        """Poison blocks 0.., load the hits into them: (hits, the events of the load)."""
        self.rows.fill_(POISON)
        hits = self.core.lookup(req, tags, 0, len(tags) * BS + 1) // BS
        self.core.plan_load(req, tags, list(range(len(tags))), hits * BS)
        events = TransferEvents()
        while hits and req not in events.finished_loads:
            events.update(self.step())
        return hits, events

    def writes(self) -> list[TierOp]:
        return [op for jobs in self.jobs for op in jobs.writes]

    def close(self) -> None:
        self.worker.close()
        self.core.close()
        self.index.close()
        self.cache.close()


def sums_of(written: list[torch.Tensor], keys: list[bytes]) -> list[list[int]]:
    """What a block's checksums are once hashed: its xxh3 (bound to its key), its row sum."""
    return [[block_checksum(w.numpy(), k), *to_unsigned(row_sums(w[None]))]
            for w, k in zip(written, keys, strict=True)]


def stats(name: str) -> dict[str, Any]:
    client = PoolClient(name, [NS], 1)
    try:
        return client.request(protocol.STATS)
    finally:
        client.close()


def test_row_sum_readers_first_xxh3_readers_and_the_disk_once_hashed(
        pool: PoolProcess, gate: threading.Event, tmp_path: Path) -> None:
    """Committed by row sums, before any xxh3 exists: a row-sum reader loads every byte; an
    xxh3 reader finds nothing (lookup and pin refused), and nothing goes to the disk. Once the
    gate opens: the xxh3s checked against the slots are attached, the disk gets the blocks with
    them, and the xxh3 reader loads every byte."""
    (tmp_path / "slab").mkdir()
    writer = Engine(pool.name, row_sums=True, disk=tmp_path / "slab")
    gpu = Engine(pool.name, row_sums=True, row_sum_reader=True)
    cpu = Engine(pool.name, row_sums=False)
    try:
        tags = hashes("a", 4)
        keys = NS.keys(tags)
        written = writer.store("w", tags, 7)
        hashed = sums_of(written, keys)
        assert writer.index.checksums(keys) == [[None, s[1]] for s in hashed]
        assert stats(pool.name)["unhashed"] == 4
        assert writer.writes() == [] and writer.disk.present(keys) == [False] * 4

        hits, events = gpu.load("g", tags)
        assert hits == 4 and events.finished_loads == {"g"} and not events.failed_loads
        assert torch.equal(gpu.rows[:4], torch.stack(written))
        assert gpu.core.take_counters().checksum_failures == 0

        assert cpu.core.lookup("c", tags, 0, 4 * BS + 1) == 0  # a miss until hashed
        assert cpu.index.prepare_load(keys) is None  # nothing pinned either
        assert cpu.core.take_counters().miss_tokens == 0  # (no plan_load: counted there)

        gate.set()
        writer.steps_until(lambda: None not in [s[0] for s in writer.index.checksums(keys)])
        assert writer.index.checksums(keys) == hashed
        assert stats(pool.name)["unhashed"] == 0
        writer.steps_until(lambda: all(writer.disk.present(keys)))
        (op,) = writer.writes()  # written once, with the xxh3s checked against the slots
        assert (list(op.keys), op.sums) == (keys, tuple((s[0],) for s in hashed))
        assert not writer.core.has_jobs()

        hits, events = cpu.load("c", tags)
        assert hits == 4 and events.finished_loads == {"c"} and not events.failed_loads
        assert torch.equal(cpu.rows[:4], torch.stack(written))
    finally:
        gate.set()
        for engine in (writer, gpu, cpu):
            engine.close()


def test_a_slot_changed_before_its_hash_gets_no_xxh3_and_is_dropped(
        pool: PoolProcess, gate: threading.Event, tmp_path: Path) -> None:
    """A bit of a committed block's slot flipped before its later hash: the hash finds the
    slot's row sum differs from the commit's, takes no xxh3 of it, and the block leaves the
    pool (counted); its neighbours are hashed, attached and written to the disk."""
    (tmp_path / "slab").mkdir()
    writer = Engine(pool.name, row_sums=True, disk=tmp_path / "slab")
    cpu = Engine(pool.name, row_sums=False)
    try:
        tags = hashes("f", 3)
        keys = NS.keys(tags)
        written = writer.store("w", tags, 11)
        (store,) = [job for jobs in writer.jobs for job in jobs.stores]
        writer.worker.pool.slots[store.slots[1], 100] ^= 0x04  # a stray write after the commit
        gate.set()
        writer.steps_until(lambda: not writer.core.has_jobs())
        hashed = sums_of(written, keys)
        assert writer.index.checksums(keys) == [hashed[0], None, hashed[2]]
        counters = writer.core.take_counters()
        assert (counters.late_hash_mismatches, counters.checksum_failures) == (1, 0)
        (op,) = writer.writes()
        assert (list(op.keys), op.sums) == ([keys[0], keys[2]],
                                            ((hashed[0][0],), (hashed[2][0],)))
        assert cpu.core.lookup("c", tags, 0, 3 * BS + 1) == BS  # the first only: 1 is gone
    finally:
        gate.set()
        writer.close()
        cpu.close()


def test_a_victim_evicted_before_its_xxh3_is_not_spilled(
        pool: PoolProcess, gate: threading.Event, tmp_path: Path) -> None:
    """A disk that keeps evicted blocks: victims not yet hashed are dropped, not written
    unchecked (counted); victims hashed go with the xxh3s they were committed with."""
    (tmp_path / "slab").mkdir()
    writer = Engine(pool.name, row_sums=True, disk=tmp_path / "slab", write_policy="evict")
    try:
        slots = writer.index.num_slots  # 16
        first = hashes("x", 8)
        written = writer.store("w1", first, 3)
        gate.set()
        writer.steps_until(lambda: not writer.core.has_jobs())  # hashed and attached
        gate.clear()
        writer.store("w2", hashes("y", slots - 8), 4)  # the pool is full: not yet hashed
        writer.store("w3", hashes("z", 12), 5)  # evicts 8 hashed, 4 unhashed
        (op,) = writer.writes()  # the 8 hashed victims (in eviction order), with their xxh3s
        hashed = {k: (s[0],) for k, s in zip(NS.keys(first), sums_of(written, NS.keys(first)),
                                             strict=True)}
        assert dict(zip(op.keys, op.sums, strict=True)) == hashed
        assert writer.core.take_counters().unhashed_spills_dropped == 4
    finally:
        gate.set()
        writer.close()


def test_add_sums_refusals_change_nothing(pool: PoolProcess) -> None:
    """The daemon's add_sums: a foreign key, a key named twice or a bad value refuse the whole
    request (nothing changes); a key not committed, committed with other row sums, in another
    slot, or hashed already is refused alone (never overwritten); the rest is applied; nil
    xxh3s drop."""
    client = PoolClient(pool.name, [NS], 1)
    try:
        keys = NS.keys(hashes("v", 4))
        placed, slots = client.request(protocol.PREPARE_STORES, [keys])[0][:2]
        assert placed == keys
        client.notify(protocol.COMPLETE_STORE, keys[:3], [True] * 3,
                      [[None, 10], [None, 11], [5, 12]])  # keys[3]: being stored still
        before = client.request(protocol.CHECKSUMS, keys)
        assert before == [[None, 10], [None, 11], [5, 12], None]
        foreign = OTHER_NS.keys(hashes("v", 1))
        for bad_keys, bad_sums, why in [
                (foreign, [[1, 10]], "not of a namespace this client declared"),
                (keys[:1] * 2, [[1, 10], [1, 10]], "named twice"),
                (keys[:2], [[1, 10], [1.5, 11]], "is not a uint64"),
                (keys[:2], [[1, 10], ["x", 11]], "is not a uint64"),
                (keys[:2], [[1, 10], [-1, 11]], "is not a uint64"),
                (keys[:2], [[1, 10], [True, 11]], "is not a uint64"),
                (keys[:2], [[1, 10], [1, 2, 11]], "row sums it was committed with"),
                (keys[:2], [[1, 10], [None, 1, 11, 12]], "a nil per rank"),
                (keys[:2], [[1, 10]], "one checksum list and one slot per key")]:
            with pytest.raises(ValueError, match=why):
                client.request(protocol.ADD_SUMS, bad_keys, bad_sums, slots[:len(bad_keys)])
            assert client.request(protocol.CHECKSUMS, keys) == before
        # keys[1] with other row sums, keys[2] hashed, keys[3] not committed: refused alone.
        with pytest.raises(ValueError, match="slots as ints"):
            client.request(protocol.ADD_SUMS, keys[:1], [[7, 10]], ["x"])
        assert client.request(protocol.ADD_SUMS, keys[:1], [[7, 10]], [slots[1]]) == [False]
        assert client.request(protocol.ADD_SUMS, keys, [[7, 10], [8, 99], [9, 12], [6, 13]],
                              slots) == [True, False, False, False]
        assert client.request(protocol.CHECKSUMS, keys) == [[7, 10], [None, 11], [5, 12], None]
        assert client.request(protocol.ADD_SUMS, keys[:1], [[8, 10]], slots[:1]) == [False]
        assert client.request(protocol.ADD_SUMS, keys[1:2], [[None, 11]], slots[1:2]) == [True]
        assert client.request(protocol.CHECKSUMS, keys) == [[7, 10], None, [5, 12], None]
        assert client.request(protocol.LOOKUP, keys) == 1
        assert stats(pool.name)["unhashed"] == 0
    finally:
        client.close()


def test_index_serves_unhashed_blocks_by_lease() -> None:
    """The index alone: a commit by row sums is a hit and a pin for a row-sum reader's lease,
    a miss (the prefix ends there) and no pin for any other until its xxh3 is attached; a
    commit's nil xxh3s must be all of them, followed by as many row sums."""
    index = SharedBlockIndex(8, 64, "lru")
    index.open(1, [NS.digest], 64)
    index.open(2, [NS.digest], 64)
    index.reads(2, True, True)
    keys = NS.keys(hashes("i", 3))
    plan = index.prepare_store(1, keys)
    for bad in ([None, None, 5], [None], [5, None], [None, 5, None, 6], [None, None]):
        with pytest.raises(ValueError, match="committed without its per-rank"):
            index.complete_store(1, keys[:1], [True], [bad])
        assert index.checksums(1, keys) == [None] * 3 and index.unhashed == 0
    index.complete_store(1, keys, [True] * 3, [[1, 10], [None, 11], [3, 12]])
    assert index.unhashed == 1
    assert (index.lookup(1, keys), index.lookup(2, keys)) == (1, 3)
    assert index.prepare_load(1, keys) is None
    assert index.prepare_load(2, keys) == (plan.slots, [(1, 10), (None, 11), (3, 12)])
    index.complete_load(2, keys)
    assert index.add_sums(2, keys[1:2], [[2, 11]], plan.slots[1:2]) == [False]  # not its
    assert index.add_sums(1, keys[1:2], [[2, 11]], plan.slots[1:2]) == [True]
    assert index.lookup(1, keys) == 3 and index.unhashed == 0
    assert index.prepare_load(1, keys) == (plan.slots, [(1, 10), (2, 11), (3, 12)])


def test_a_row_sum_readers_load_checked_by_xxh3_ends_before_an_unhashed_block(
        pool: PoolProcess, gate: threading.Event) -> None:
    """A row-sum reader's prefix whose first block was committed by xxh3 only (a CPU writer's:
    no row sums, so the load is checked by xxh3) and the rest by row sums, not yet hashed: the
    lookup ends before the first unhashed block, the load of the first succeeds with its bytes,
    and no block is counted corrupt nor dropped."""
    cpu_writer = Engine(pool.name, row_sums=False)
    writer = Engine(pool.name, row_sums=True)
    gpu = Engine(pool.name, row_sums=True, row_sum_reader=True)
    try:
        tags = hashes("m", 4)
        keys = NS.keys(tags)
        gate.set()
        first = cpu_writer.store("c", tags[:1], 1)
        cpu_writer.steps_until(lambda: not cpu_writer.core.has_jobs())
        gate.clear()
        writer.store("w", tags, 2)  # 1..3 committed by row sums, their xxh3s held
        assert [s[0] is None for s in writer.index.checksums(keys)] == [False] + [True] * 3
        hits, events = gpu.load("g", tags)
        assert hits == 1 and events.finished_loads == {"g"} and not events.failed_loads
        assert torch.equal(gpu.rows[0], first[0])
        counters = gpu.core.take_counters()
        assert (counters.checksum_failures, counters.failed_loads) == (0, 0)
        assert gpu.index.present(keys) == [True] * 4  # none dropped
    finally:
        gate.set()
        for engine in (cpu_writer, writer, gpu):
            engine.close()


def test_a_stale_late_hash_leaves_a_block_stored_again_alone(
        pool: PoolProcess, gate: threading.Event) -> None:
    """Engine a commits K by row sums; K is evicted, its slot reused, and engine b stores K
    again with the same bytes (the same row sums). a's late hash finds its slot changed (nil):
    the daemon applies it to nothing (K is b's now), so b's K stays, gets b's own xxh3, and a
    counts no mismatch. (A CPU engine's lease needs xxh3s: both hash after their commits.)"""
    a = Engine(pool.name, row_sums=True)
    b = Engine(pool.name, row_sums=True, row_sum_reader=True)
    cpu = Engine(pool.name, row_sums=False)
    try:
        k = hashes("k", 1)
        key = NS.keys(k)
        a.store("a", k, 7)  # unhashed: the gate is shut
        slots = a.index.num_slots
        b.store("b1", hashes("y", 8), 3)
        b.store("b2", hashes("z", slots - 8), 4)  # evicts K, reuses its slot
        assert b.index.present(key) == [False]
        written = b.store("b3", k, 7)  # K again, the same bytes: the same row sums
        gate.set()
        a.steps_until(lambda: not a.core.has_jobs())
        assert a.core.take_counters().late_hash_mismatches == 0
        assert b.index.present(key) == [True]
        b.steps_until(lambda: not b.core.has_jobs())
        assert b.index.checksums(key) == sums_of(written[:1], key)
    finally:
        gate.set()
        for engine in (a, b, cpu):
            engine.close()


def test_a_block_committed_by_row_sums_is_in_an_xxh3_readers_change_log_once_hashed(
        pool: PoolProcess) -> None:
    """The change log (KV events) lists a block committed by row sums only once its xxh3s
    are attached, never one dropped by a mismatch; another client can neither attach nor drop
    it; prepare_stores answers the checksums of the requester's own hashed victims only."""
    client = PoolClient(pool.name, [NS], 1)
    other = PoolClient(pool.name, [NS], 1)
    third = PoolClient(pool.name, [OTHER_NS], 1)
    try:
        keys = NS.keys(hashes("e", 3))
        placed, slots = client.request(protocol.PREPARE_STORES, [keys])[0][:2]
        assert placed == keys
        client.notify(protocol.COMPLETE_STORE, keys, [True] * 3, [[None, 10], [None, 11], [5, 12]])
        seq, whole, changes = client.request(protocol.CHANGES, -1)
        assert (whole, changes) == (True, [[True, keys[2]]])
        assert other.request(protocol.ADD_SUMS, keys[:2], [[1, 10], [None, 11]], slots[:2]) \
            == [False, False]  # not its commits
        assert client.request(protocol.CHANGES, seq) == [seq, False, []]
        assert client.request(protocol.ADD_SUMS, keys[:2], [[1, 10], [None, 11]], slots[:2]) \
            == [True, True]
        assert client.request(protocol.CHANGES, seq)[1:] == [False, [[True, keys[0]]]]
        assert client.request(protocol.CHECKSUMS, keys) == [[1, 10], None, [5, 12]]
        # another model's stores evict these (capacity 16): it gets no checksums of them
        theirs = OTHER_NS.keys(hashes("o", 16))
        (plan,) = third.request(protocol.PREPARE_STORES, [theirs])
        assert sorted(plan[3]) == sorted([keys[0], keys[2]]) and plan[5] == [None, None]
        third.notify(protocol.COMPLETE_STORE, plan[0], [False] * len(plan[0]),
                     [None] * len(plan[0]))
        client.request(protocol.PREPARE_STORES, [keys[:1]])
        client.notify(protocol.COMPLETE_STORE, keys[:1], [True], [[1, 10]])
        mine = NS.keys(hashes("p", 16))
        (plan,) = client.request(protocol.PREPARE_STORES, [mine])
        assert plan[3] == [keys[0]] and plan[5] == [[1, 10]]  # its own victim: its sums
    finally:
        for each in (client, other, third):
            each.close()


def test_kv_events_announce_a_block_committed_by_row_sums_as_each_engine_can_load_it(
        pool: PoolProcess, gate: threading.Event) -> None:
    """Engines' KV events (fed by the daemon's change log): a block committed by row sums is
    announced at its commit to the engine that reads by row sums (the writer, once its worker
    said so), and to one that checks by xxh3 (a CPU engine, whose lease makes the writer hash)
    only once its xxh3s are attached; one whose slot changed before its hash is removed from the
    first and never announced to the second."""
    writer = Engine(pool.name, row_sums=True)
    cpu = Engine(pool.name, row_sums=False)
    for engine in (writer, cpu):
        engine.core.enable_events([POOL])
    try:
        tags = hashes("ev", 3)
        keys = NS.keys(tags)
        writer.store("w", tags, 5)
        assert writer.index.row_sum_reader and writer.index.needs_xxh3 is False
        assert [(c.stored, set(c.keys)) for c in writer.core.take_block_changes()] == \
            [(True, set(keys))]
        assert cpu.core.take_block_changes() == []
        (store,) = [job for jobs in writer.jobs for job in jobs.stores]
        assert store.hash_later  # the CPU engine's lease needs the xxh3s
        writer.worker.pool.slots[store.slots[1], 100] ^= 0x04  # a stray write after the commit
        gate.set()
        writer.steps_until(lambda: not writer.core.has_jobs())
        assert [(c.stored, set(c.keys)) for c in writer.core.take_block_changes()] == \
            [(False, {keys[1]})]
        assert [(c.stored, set(c.keys)) for c in cpu.core.take_block_changes()] == \
            [(True, {keys[0], keys[2]})]
        assert writer.core.take_counters().late_hash_mismatches == 1
    finally:
        gate.set()
        writer.close()
        cpu.close()


def test_a_row_sum_readers_load_with_fetches_ends_before_an_unhashed_block(
        pool: PoolProcess, gate: threading.Event, tmp_path: Path) -> None:
    """A row-sum reader whose pool prefix is not hashed yet and whose disk holds the blocks
    after it: with those fetched the load would be checked by xxh3 (fetched blocks carry no row
    sums) and fail the unhashed ones, so the lookup ends before them: no failed load, no block
    counted corrupt or dropped."""
    (tmp_path / "slab").mkdir()
    reader = Engine(pool.name, row_sums=True, row_sum_reader=True, disk=tmp_path / "slab")
    writer = Engine(pool.name, row_sums=True)
    try:
        tags = hashes("t", 4)
        keys = NS.keys(tags)
        gate.set()
        reader.store("r", tags[2:], 6)  # hashed, written through to the disk
        reader.steps_until(lambda: all(reader.disk.present(keys[2:])))
        reader.store("fill", hashes("q", reader.index.num_slots), 8)  # evicts them
        reader.steps_until(lambda: not reader.core.has_jobs())
        assert reader.index.present(keys[2:]) == [False, False]
        gate.clear()
        writer.store("w", tags[:2], 9)  # not hashed yet
        assert reader.core.lookup("probe", tags, 0, 4 * BS + 1) == 0
        hits, events = reader.load("g", tags)
        counters = reader.core.take_counters()
        assert (hits, events.failed_loads, counters.checksum_failures) == (0, set(), 0)
        assert reader.index.present(keys[:2]) == [True, True]
    finally:
        gate.set()
        reader.close()
        writer.close()


def test_a_write_through_writes_the_blocks_still_there(
        pool: PoolProcess, gate: threading.Event, tmp_path: Path) -> None:
    """Blocks to write through to the disk, one of them gone from the pool since (evicted by
    another engine): the ones still there are written, with their xxh3s."""
    (tmp_path / "slab").mkdir()
    writer = Engine(pool.name, row_sums=False)
    disk = Engine(pool.name, row_sums=False, disk=tmp_path / "slab")
    try:
        gate.set()
        tags = hashes("s", 2)
        keys = NS.keys(tags)
        written = writer.store("w", tags[:1], 4)
        xxh3 = sums_of(written, keys[:1])[0][0]
        disk.core._write_stored(keys, [[xxh3], [xxh3 ^ 1]])  # keys[1]: never stored
        disk.steps_until(lambda: not disk.core.has_jobs())
        assert disk.disk.present(keys) == [True, False]
        (op,) = disk.writes()
        assert (list(op.keys), op.sums) == (keys[:1], ((xxh3,),))
    finally:
        gate.set()
        writer.close()
        disk.close()


def test_a_load_meeting_a_block_stored_again_unhashed_fails_dropping_nothing(
        pool: PoolProcess, gate: threading.Event) -> None:
    """Between a row-sum reader's lookup (a load checked by xxh3: its first block has no row
    sums) and its load, the second block is stored again, not hashed yet: the load fails
    pinning nothing, no block is counted corrupt, and both stay in the pool."""
    cpu_writer = Engine(pool.name, row_sums=False)
    writer = Engine(pool.name, row_sums=True)
    reader = Engine(pool.name, row_sums=True, row_sum_reader=True)
    try:
        tags = hashes("r", 2)
        keys = NS.keys(tags)
        gate.set()
        cpu_writer.store("c", tags[:1], 1)
        writer.store("w", tags[1:], 2)
        writer.steps_until(lambda: not writer.core.has_jobs())
        hits = reader.core.lookup("g", tags, 0, 2 * BS + 1) // BS
        assert hits == 2
        writer.index.discard(keys[1:])
        gate.clear()
        writer.store("w2", tags[1:], 2)  # back, not hashed yet
        reader.core.plan_load("g", tags, [0, 1], hits * BS)
        events = TransferEvents()
        while "g" not in events.failed_loads:
            events.update(reader.step())
        counters = reader.core.take_counters()
        assert (counters.checksum_failures, counters.failed_loads) == (0, 1)
        assert reader.index.present(keys) == [True, True]
        assert stats(pool.name)["pinned"] == 0
    finally:
        gate.set()
        for engine in (cpu_writer, writer, reader):
            engine.close()


def test_without_a_reader_of_xxh3s_no_block_is_hashed(pool: PoolProcess,
                                                      gate: threading.Event) -> None:
    """Engines that all read by row sums and keep nothing below: once their workers said so,
    their stores commit by row sums and are never hashed (no hash runs, no xxh3 is attached),
    and are hits to each other; a CPU engine joining makes the next stores hashed, while the
    blocks stored before it are misses to it (never a block it could not check) until its own
    store of them replaces them."""
    writer = Engine(pool.name, row_sums=True)
    reader = Engine(pool.name, row_sums=True)
    cpu = None
    try:
        gate.set()
        for engine, tag in ((writer, "wu"), (reader, "ru")):  # each worker maps the pool
            engine.store(tag, hashes(tag, 1), 1)
            engine.steps_until(lambda e=engine: not e.core.has_jobs())
            assert engine.index.row_sum_reader and engine.index.needs_xxh3 is False
        gate.clear()  # a hash would wait here: none may run
        tags = hashes("n", 3)
        keys = NS.keys(tags)
        written = writer.store("w", tags, 2)
        assert [s[0] for s in writer.index.checksums(keys)] == [None] * 3
        assert not writer.core.has_jobs() and writer.worker.checks.hashing_later == 0
        assert not [job for jobs in writer.jobs for job in jobs.stores][-1].hash_later
        hits, events = reader.load("r", tags)
        assert hits == 3 and events.finished_loads == {"r"} and not events.failed_loads
        for i in range(3):
            assert torch.equal(reader.rows[i], written[i])
        cpu = Engine(pool.name, row_sums=False)  # its lease needs xxh3s
        assert cpu.load("c", tags)[0] == 0
        gate.set()
        later = hashes("h", 2)
        written = writer.store("w2", later, 3)
        writer.steps_until(lambda: not writer.core.has_jobs())
        assert writer.core.take_counters().late_hash_mismatches == 0
        assert writer.index.checksums(NS.keys(later)) == sums_of(written, NS.keys(later))
        hits, events = cpu.load("c2", later)
        assert hits == 2 and events.finished_loads == {"c2"}
        for i in range(2):
            assert torch.equal(cpu.rows[i], written[i])
        assert cpu.load("c3", tags)[0] == 0  # stored before it joined: never hashed
        assert stats(pool.name)["orphans"] == 3
        # Its store of the prefix it computed replaces them with its own, hashed blocks.
        mine = fill(cpu.rows, [0, 1, 2], 4)
        cpu.core.plan_stores("c4", tags, [0, 1, 2], len(tags) * BS)
        xxh3s = [sums[0] for sums in sums_of(mine, keys)]
        cpu.steps_until(lambda: [sums and sums[0] for sums in cpu.index.checksums(keys)] == xxh3s)
        assert stats(pool.name)["orphans"] == 0
        for engine, req in ((cpu, "c5"), (reader, "r2")):
            hits, events = engine.load(req, tags)
            assert hits == 3 and events.finished_loads == {req} and not events.failed_loads
            for i in range(3):
                assert torch.equal(engine.rows[i], mine[i])
    finally:
        gate.set()
        for engine in (writer, reader, cpu):
            if engine is not None:
                engine.close()


def test_reads_notices_set_what_a_store_is_told(pool: PoolProcess) -> None:
    """The daemon's `reads` notice and `prepare_stores`' last field: a store's blocks are to be
    hashed while any lease of its namespaces needs xxh3s (every lease until it says otherwise;
    another model's lease does not count); a lease reading by xxh3 that needs none, or a value
    that is not a bool, is refused (the client is dropped, nothing else changes)."""
    one = PoolClient(pool.name, [NS], 1)
    two = PoolClient(pool.name, [NS], 1)
    other = PoolClient(pool.name, [OTHER_NS], 1)
    try:
        def hash_later(tag: str) -> bool:
            (plan,) = one.request(protocol.PREPARE_STORES, [NS.keys(hashes(tag, 1))])
            one.notify(protocol.COMPLETE_STORE, plan[0], [False], [None])
            return plan[6]

        assert hash_later("a") is True
        one.notify(protocol.READS, True, False)
        assert hash_later("b") is True  # the second lease still needs them
        two.notify(protocol.READS, True, False)
        two.request(protocol.STATS)  # its notice is applied before this answer
        assert hash_later("c") is False  # another model's lease needs them: not for these
        two.notify(protocol.READS, True, True)  # a tier below
        two.request(protocol.STATS)
        assert hash_later("d") is True
        for bad in ((False, False), (1, True), (True, None)):
            victim = PoolClient(pool.name, [NS], 1)
            victim.notify(protocol.READS, *bad)
            with pytest.raises(PoolError):
                victim.request(protocol.STATS)
            victim.close()
        assert hash_later("e") is True and stats(pool.name)["stored"] == 0
    finally:
        for each in (one, two, other):
            each.close()


def test_a_worker_that_takes_no_row_sums_checks_an_unhashed_block_by_its_row_sum_on_the_host(
        pool: PoolProcess, gate: threading.Event) -> None:
    """An engine declared a row-sum reader (as a GPU engine is from its start) whose worker's
    copy engine takes no row sums: a block committed by row sums, not hashed yet, is checked on
    the host by the row sum it was committed with, and loads with its bytes; a flipped byte in
    one fails the load from that block on, counted, the block before it loaded. Once the worker
    said it takes none, the engine reads by xxh3 (its lookups skip blocks not hashed)."""
    writer = Engine(pool.name, row_sums=True)
    first = Engine(pool.name, row_sums=False, row_sum_reader=True)
    second = Engine(pool.name, row_sums=False, row_sum_reader=True)
    try:
        tags = hashes("host", 3)
        keys = NS.keys(tags)
        written = writer.store("w", tags, 4)  # committed by row sums: its hashes wait (gate)
        assert [s[0] for s in writer.index.checksums(keys)] == [None] * 3
        hits, events = first.load("a", tags)
        assert hits == 3 and events.finished_loads == {"a"} and not events.failed_loads
        for i in range(3):
            assert torch.equal(first.rows[i], written[i])
        assert first.core.take_counters().checksum_failures == 0
        assert (first.index.row_sum_reader, first.index.needs_xxh3) == (False, True)
        assert first.core.lookup("a2", tags, 0, len(tags) * BS + 1) == 0
        (store,) = [job for jobs in writer.jobs for job in jobs.stores]
        writer.worker.pool.slots[store.slots[1], 7] ^= 0x01
        hits, events = second.load("b", tags)
        assert hits == 3 and events.failed_loads == {"b"}
        assert torch.equal(second.rows[0], written[0])
        assert (second.rows[1] == POISON).all()
        assert second.core.take_counters().checksum_failures == 1
    finally:
        gate.set()
        for engine in (writer, first, second):
            engine.close()


def test_an_engine_reads_by_row_sums_once_every_worker_said_so(pool: PoolProcess,
                                                               tmp_path: Path) -> None:
    """The scheduler core tells the pool how it reads from its workers' reports: by row sums
    once every rank said it checks loads so (needing xxh3s only with a tier below), by xxh3 as
    soon as one said it does not; `read_by_row_sums` says so ahead of the reports (a GPU
    engine's adapter), until a report says otherwise. The pool then asks a store to hash only
    where a lease needs the xxh3s."""
    index = SharedIndex(pool.name, NS, 4096, retry_s=0.0)
    disk_index = SharedIndex(pool.name, NS, 4096, retry_s=0.0)
    core = OffloadScheduler(NS, index.num_slots, BS, 2, index=index)
    with_disk = OffloadScheduler(NS, index.num_slots, BS, 1, index=disk_index,
                                 tiers=[DiskPlanner(NS, DISK_SLOTS, "lru", "evict", {})])
    try:
        def reads() -> tuple[bool, bool]:
            return index.row_sum_reader, index.needs_xxh3

        assert reads() == (False, True)
        core.complete(JobReport(row_sum_reads={0: True}))
        assert reads() == (False, True)  # rank 1 has not said
        core.complete(JobReport(row_sum_reads={1: True}))
        assert reads() == (True, False)
        core.complete(JobReport(row_sum_reads={1: False}))
        assert reads() == (False, True)
        core.read_by_row_sums()
        assert reads() == (True, False)
        core.complete(JobReport(row_sum_reads={0: True}))
        assert reads() == (True, False)
        with_disk.read_by_row_sums()
        assert (disk_index.row_sum_reader, disk_index.needs_xxh3) == (True, True)
        index.pool_stats()
        disk_index.pool_stats()  # both notices applied
        assert index.prepare_store(NS.keys(hashes("hl", 1))).hash_later  # the disk's lease
        disk_index.close()  # its lease goes once the daemon sees the socket closed
        deadline = time.monotonic() + TIMEOUT_S
        while index.prepare_store(NS.keys(hashes(f"hm{time.monotonic()}", 1))).hash_later:
            assert time.monotonic() < deadline, "the closed lease still counts"
            time.sleep(0.01)
        core.complete(JobReport(row_sum_reads={1: False}))
        assert reads() == (False, True)
        assert index.prepare_store(NS.keys(hashes("hn", 1))).hash_later
    finally:
        core.close()
        with_disk.close()
        for each in (index, disk_index):
            each.close()
