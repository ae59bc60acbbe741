"""The tier contract (test_tier_contract.py) kept by the host pool itself, in both its kinds:
a worker's private pool (a BlockIndex and the worker's own HostPool) and the host's shared pool
(a real `kvconnector pool serve` daemon, its SharedIndex and segment).

Each kind is driven at the level of the offload core: an OffloadScheduler and one OffloadWorker
over a CPU cache, stepped as the engine would. Cases: stored blocks come back bit-exact into
poisoned blocks; a block corrupted in the pool is refused; a missing block is a clean miss; an
eviction is reported; a restart finds the blocks or not, as the pool kind promises.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvconnector.layout import KVLayout
from kvconnector.layout.allocator import allocate
from kvconnector.offload.jobs import StepJobs, TransferEvents
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from kvconnector.servers.pool import PoolProcess
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.shared.client import SharedIndex
from transfer.shared.mapping import SharedPart

BS = 4
SLOTS = 16  # both kinds: the private pool's slots; the daemon's 64KiB of 4KiB slots
NUM_BLOCKS = 16  # blocks of the engine's (CPU) KV cache
POISON = 0xA5
NS = Namespace(model="pool-contract", dtype="bfloat16", block_size=BS, block_layout="test")
KINDS = ["private", "shared"]


class Engine:
    """One engine over a pool of `kind`: a scheduler core and one worker over its own CPU cache
    (`rows`: the cache's bytes, one row per block). `pool_name`: the shared pool's daemon."""

    def __init__(self, kind: str, pool_name: str | None = None) -> None:
        layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=8, block_size=BS,
                          dtype=torch.bfloat16, order="BLNHC")
        self.cache = allocate(layout, num_blocks=NUM_BLOCKS, device="cpu")
        self.rows = self.cache.block_chunks()
        self.closed = False
        views = {f"l{i}": v for i, v in enumerate(self.cache.layer_views())}
        self.index: SharedIndex | None = None
        if kind == "shared":
            assert pool_name is not None
            self.index = SharedIndex(pool_name, NS, self.rows.shape[1], retry_s=0.0)
            self.core = OffloadScheduler(NS, self.index.num_slots, BS, 1, index=self.index)
            self.worker = OffloadWorker(views, 0, backend=ThreadBackend(),
                                        mapping=SharedPart(pool_name, 0))
        else:
            self.core = OffloadScheduler(NS, SLOTS, BS, 1)
            self.worker = OffloadWorker(views, SLOTS, backend=ThreadBackend())

    def step(self) -> tuple[StepJobs, TransferEvents]:
        """One engine step: plan, flush, loads, stores, wait, report (under inference_mode, as
        vLLM calls the worker)."""
        jobs = self.core.build_step()
        with torch.inference_mode():
            self.worker.flush(jobs)
            self.worker.start_loads(jobs)
            self.worker.submit_stores(jobs)
            self.worker.drain()
            events = self.worker.poll()
        self.core.complete(self.worker.take_report())
        return jobs, events

    def store(self, req: str, keys: list[bytes], blocks: list[int], seed: int
              ) -> list[torch.Tensor]:
        """Fill `blocks` with random bytes and store them under `keys`: the bytes written."""
        gen = torch.Generator().manual_seed(seed)
        written = [torch.randint(0, 256, (self.rows.shape[1],), dtype=torch.uint8, generator=gen)
                   for _ in blocks]
        for block, data in zip(blocks, written, strict=True):
            self.rows[block].copy_(data)
        self.core.plan_stores(req, keys, blocks, len(keys) * BS)
        jobs, _ = self.step()
        assert jobs.stores, "the store planned no job"
        return written

    def load(self, req: str, keys: list[bytes], blocks: list[int]
             ) -> tuple[int, StepJobs, TransferEvents]:
        """Poison `blocks`, look `keys` up and load the hits into them: (hit blocks, the jobs
        and events of the step that ran the load)."""
        self.rows[blocks] = POISON
        hits = self.core.lookup(req, keys, 0, len(keys) * BS + 1) // BS
        self.core.plan_load(req, keys, blocks, hits * BS)
        jobs, events = self.step()
        return hits, jobs, events

    def assert_rows(self, blocks: list[int], want: list[torch.Tensor]) -> None:
        for block, data in zip(blocks, want, strict=True):
            assert torch.equal(self.rows[block], data), f"block {block} differs"

    def poisoned(self, blocks: list[int]) -> bool:
        return bool((self.rows[blocks] == POISON).all())

    def close(self) -> None:
        """Close the worker, the index and the cache, once."""
        if self.closed:
            return
        self.closed = True
        self.worker.close()
        if self.index is not None:
            self.index.close()
        self.cache.close()


def hashes(tag: str, count: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(count)]


@dataclass
class PoolRig:
    """A pool of one kind: `engine()` starts a new engine on it (closed at the end)."""

    kind: str
    engine: Callable[[], Engine]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    """A shared pool daemon of 16 slots for the module's shared cases (each empties it first)."""
    log = tmp_path_factory.mktemp("pool") / "pool.log"
    with PoolProcess(log, f"pc{uuid.uuid4().hex[:10]}", capacity="64KiB",
                     slot_bytes="4KiB") as process:
        yield process


@pytest.fixture(params=KINDS)
def rig(request: pytest.FixtureRequest) -> Iterator[PoolRig]:
    """A private pool (each engine its own), or the module's shared pool daemon, emptied."""
    engines: list[Engine] = []
    name: str | None = None
    if request.param == "shared":
        name = request.getfixturevalue("daemon").name
        cleaner = Engine("shared", name)
        try:
            cleaner.core.reset()  # the blocks an earlier case left
            pool = cleaner.index.pool_stats()
            assert pool is not None and (pool["stored"], pool["free"]) == (0, SLOTS)
        finally:
            cleaner.close()

    def engine() -> Engine:
        engines.append(Engine(request.param, name))
        return engines[-1]

    try:
        yield PoolRig(request.param, engine)
    finally:
        for made in engines:
            made.close()


def corrupt(engine: Engine, key: bytes, offset: int) -> None:
    """Flip one bit of `key`'s committed slot through the shared segment (a stray write)."""
    assert engine.index is not None
    plan = engine.index.prepare_load([key])
    assert plan is not None
    engine.index.complete_load([key])
    segment = HostPool.attach(engine.index.segment, pinned=False)
    try:
        segment.slots[plan.slots[0], offset] ^= 0x01
    finally:
        segment.close()


def test_stored_blocks_load_back_bit_exact(rig: PoolRig) -> None:
    engine = rig.engine()
    want = engine.store("a", hashes("p", 5), [0, 1, 2, 3, 4], seed=1)
    engine.rows.fill_(POISON)
    blocks = [11, 3, 14, 7, 9]
    hits, jobs, events = engine.load("b", hashes("p", 5), blocks)
    assert hits == 5 and len(jobs.loads) == 1
    assert events.finished_loads == {"b"} and not events.failed_loads
    engine.assert_rows(blocks, want)
    assert engine.poisoned([0, 1, 2, 4, 5, 6, 8, 10, 12, 13, 15])  # nothing else written
    counters = engine.core.take_counters()
    assert (counters.checksum_failures, counters.failed_loads) == (0, 0)
    assert counters.load_bytes == 5 * engine.rows.shape[1]


def test_a_corrupt_block_is_refused(rig: PoolRig) -> None:
    if rig.kind == "private":
        pytest.skip("a private pool's slots are written only by its own worker: nothing outside "
                    "it can corrupt a block")
    engine = rig.engine()
    want = engine.store("a", hashes("c", 4), [0, 1, 2, 3], seed=11)
    corrupt(engine, NS.keys(hashes("c", 4))[2], 100)  # one bit of the third block
    blocks = [12, 4, 9, 1]
    hits, _, events = engine.load("b", hashes("c", 4), blocks)
    assert hits == 4  # the index cannot know: the load's check does
    assert events.finished_loads == events.failed_loads == {"b"}
    assert events.failed_block_ids == {9, 1}  # from the corrupt block on
    engine.assert_rows([12, 4], want[:2])  # the good head is kept
    assert engine.poisoned([9, 1])  # the bad bytes never reached the cache
    counters = engine.core.take_counters()
    assert (counters.checksum_failures, counters.failed_loads) == (1, 1)
    # The bad block left the pool: the next lookup misses rather than failing again.
    assert engine.core.lookup("q", hashes("c", 4), 0, 100) == 0


def test_a_missing_block_is_a_clean_miss(rig: PoolRig) -> None:
    engine = rig.engine()
    engine.store("a", hashes("m", 3), [0, 1, 2], seed=2)
    engine.core.take_counters()
    hits, jobs, events = engine.load("b", hashes("unknown", 3), [5, 6, 7])
    assert hits == 0
    assert not jobs.loads and not engine.core.has_jobs()
    assert not events.finished_loads and not events.failed_loads
    assert engine.poisoned([5, 6, 7])
    # A stored head before an unknown block: only the head hits.
    assert engine.core.lookup("c", [*hashes("m", 2), b"unknown"], 0, 100) == 2 * BS
    counters = engine.core.take_counters()
    assert (counters.checksum_failures, counters.failed_loads, counters.load_bytes) == (0, 0, 0)


def test_an_eviction_is_reported(rig: PoolRig) -> None:
    engine = rig.engine()
    blocks = list(range(12))
    engine.store("old", hashes("old", 12), blocks, seed=3)
    assert engine.core.take_counters().evictions == 0
    want = engine.store("new", hashes("new", 12), blocks, seed=4)  # 24 blocks in 16 slots
    assert engine.core.take_counters().evictions == 24 - SLOTS
    # The oldest prefix lost 8 blocks, from its tail (its head stays usable), and misses
    # from the first block it lost.
    assert engine.core.lookup("q", hashes("old", 12), 0, 100) == 4 * BS
    assert engine.core.lookup("q2", hashes("old", 12)[4:], 0, 100) == 0
    # The newest stay, whole, and load bit-exact.
    hits, _, events = engine.load("r", hashes("new", 12), blocks)
    assert hits == 12 and not events.failed_loads
    engine.assert_rows(blocks, want)


def test_a_restart_finds_the_blocks_as_promised(rig: PoolRig) -> None:
    first = rig.engine()
    want = first.store("a", hashes("s", 5), [0, 1, 2, 3, 4], seed=5)
    first.close()  # the engine goes; a new one (new scheduler and worker) comes
    second = rig.engine()
    hits, _, events = second.load("b", hashes("s", 5), [10, 11, 12, 13, 14])
    if rig.kind == "shared":  # the daemon keeps the blocks
        assert hits == 5 and events.finished_loads == {"b"} and not events.failed_loads
        second.assert_rows([10, 11, 12, 13, 14], want)
    else:  # a private pool went with its engine
        assert hits == 0 and not events.finished_loads
        assert second.poisoned([10, 11, 12, 13, 14])
