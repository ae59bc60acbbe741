"""The memory tier (tests/tiers/memory_tier.py, registered by the test) serves a reload through the
offload core: an OffloadScheduler with the memory tier's planner over a 4-slot pool and an
OffloadWorker on CPU with its worker attached, both made through the tier's TierSpec, as a new
tier would be with no edit to the library.

A request stores 8 blocks through the pool, which keeps the last 4; the memory tier writes every
stored block (write-through), so all 8 come back: from the memory tier only, then from the pool
and the memory tier in one load. Every byte is compared with what was stored, after poisoning
the destination blocks. The control: with the memory tier emptied, the same reload finds only
the pool's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvconnector.layout import KVLayout
from kvconnector.layout.allocator import allocate
from kvconnector.offload.jobs import TransferEvents
from kvconnector.offload.scheduler import POOL, OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace
from transfer.registry import tier_spec
from transfer.tier import PlannerContext, TierSpec, WorkerContext

BS = 4
POOL_SLOTS = 4
NUM_BLOCKS = 24
STORED = 8  # blocks the first request stores
POISON = 0xA5
NS = Namespace(model="tier-reload", dtype="bfloat16", block_size=BS, block_layout="test")
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_size=8, block_size=BS,
                  dtype=torch.bfloat16, order="BLNHC")
HASHES = [f"reload-{i}".encode() for i in range(STORED)]


class ReloadRig:
    """A CPU cache, the offload core's scheduler and worker over a POOL_SLOTS pool, and the
    memory tier below it, made through its registered TierSpec."""

    def __init__(self, spec: TierSpec) -> None:
        self.cache = allocate(LAYOUT, num_blocks=NUM_BLOCKS, device="cpu")
        caches = {f"layer.{i}": view for i, view in enumerate(self.cache.layer_views())}
        self.worker = OffloadWorker(caches, POOL_SLOTS, backend=ThreadBackend())
        block_bytes = self.worker.block_bytes
        values = {key: option.default for key, option in spec.options.items()}
        settings = spec.settings(values | {"memory_blocks": 2 * STORED})
        self.planner = spec.make_planner(settings, PlannerContext(
            NS, num_workers=1, slot_bytes=block_bytes, rank_namespaces=(NS,)))
        self.worker.attach(spec.make_worker(settings, WorkerContext(
            rank=0, part_bytes=block_bytes, slot_bytes=block_bytes, own_namespace=NS,
            common_namespace=NS)))
        self.core = OffloadScheduler(NS, POOL_SLOTS, BS, 1, tiers=[self.planner])
        self.blocks = self.cache.block_chunks()  # (NUM_BLOCKS, block bytes): a block's bytes

    def step(self) -> TransferEvents:
        """One stand-in engine step: its jobs run and are waited for, their reports applied."""
        step = self.core.build_step()
        self.worker.flush(step)
        self.worker.start_loads(step)
        self.worker.submit_stores(step)
        self.worker.drain()
        events = self.worker.poll()
        self.core.complete(self.worker.take_report())
        return events

    def settle(self) -> TransferEvents:
        """Step until no job is planned or in flight (a fetched load copies a step later)."""
        events = TransferEvents()
        for _ in range(20):
            events.update(self.step())
            if not self.core.has_jobs() and self.worker.jobs_in_flight == 0:
                return events
        raise AssertionError("jobs still in flight after 20 steps")

    def store(self) -> list[torch.Tensor]:
        """Request "a" writes random KV into blocks 0..STORED-1 and stores them two at a time
        (the pool evicts the oldest); returns copies of the blocks."""
        generator = torch.Generator().manual_seed(38)
        written = []
        for b in range(STORED):
            self.blocks[b].copy_(torch.randint(0, 256, self.blocks[b].shape, dtype=torch.uint8,
                                               generator=generator))
            written.append(self.blocks[b].clone())
        for ready in range(2, STORED + 1, 2):
            self.core.plan_stores("a", HASHES, list(range(STORED)), ready * BS)
            self.settle()
        self.blocks[STORED:].fill_(POISON)
        return written

    def load(self, req_id: str, computed: int, num_tokens: int,
             block_ids: Sequence[int]) -> tuple[int, dict[str, int]]:
        """Look up and load what the tiers offer; (tokens offered, blocks per source)."""
        offered = self.core.lookup(req_id, HASHES, computed * BS, num_tokens)
        assert offered is not None  # the memory tier answers at once
        split = self.core.plan_load(req_id, HASHES, block_ids, offered)
        events = self.settle()
        if offered:
            assert events.finished_loads == {req_id}
        assert not events.failed_loads and not events.failed_block_ids
        return offered, split

    def close(self) -> None:
        self.worker.close()
        self.core.close()


@pytest.fixture
def rig(memory_tier: TierSpec) -> Iterator[ReloadRig]:
    made = ReloadRig(tier_spec(memory_tier.name))  # found as any registered tier
    try:
        yield made
    finally:
        made.close()


def _keys() -> list[bytes]:
    return NS.keys(HASHES)


def test_a_reload_through_the_core_comes_from_the_pool_and_the_memory_tier(
        rig: ReloadRig) -> None:
    block_bytes = rig.worker.block_bytes
    written = rig.store()
    # The pool kept the last POOL_SLOTS blocks; the memory tier got every block stored.
    assert rig.core.index.present(_keys()) == [False] * 4 + [True] * 4
    assert rig.planner.present(_keys()) == [True] * STORED
    counters = rig.core.take_counters()
    assert counters.evictions == STORED - POOL_SLOTS
    assert counters.tiers["memory"]["write_bytes"] == STORED * block_bytes
    assert counters.tiers["memory"]["evictions"] == 0

    # "b" asks for 2 blocks: none in the pool, both from the memory tier (they stay in the pool)
    offered, split = rig.load("b", 0, 2 * BS + 1, [8, 9, 10])
    assert (offered, split) == (2 * BS, {"memory": 2})
    for b, i in ((8, 0), (9, 1)):
        assert torch.equal(rig.blocks[b], written[i]), f"block {b} differs"
    assert rig.core.index.present(_keys()[:2]) == [True, True]

    # "c" asks for all 8: blocks 0-1 from the pool, then what the pool can take from the
    # memory tier (4 slots: 2 pinned, 2 to fetch into)
    offered, split = rig.load("c", 0, STORED * BS + 1, list(range(10, 18)))
    assert (offered, split) == (4 * BS, {POOL: 2, "memory": 2})
    for i in range(4):
        assert torch.equal(rig.blocks[10 + i], written[i]), f"block {10 + i} differs"
    assert bool((rig.blocks[14:18] == POISON).all())  # nothing past the hits was written

    # "d": the engine's own cache holds blocks 0-3 (c's); 4-7 come from the memory tier
    offered, split = rig.load("d", 4, STORED * BS + 1, [10, 11, 12, 13, 18, 19, 20, 21])
    assert (offered, split) == (4 * BS, {"memory": 4})
    for i in range(4, STORED):
        assert torch.equal(rig.blocks[14 + i], written[i]), f"block {14 + i} differs"

    counters = rig.core.take_counters()
    memory = counters.tiers["memory"]
    assert memory["hit_tokens"] == (2 + 2 + 4) * BS
    assert memory["read_bytes"] == (2 + 2 + 4) * block_bytes
    assert memory["failed_reads"] == 0 and counters.failed_loads == 0
    assert counters.hit_tokens == (2 + 4 + 4) * BS
    assert not rig.core.has_jobs() and rig.worker.jobs_in_flight == 0


def test_with_the_memory_tier_emptied_the_same_reload_finds_fewer_hits(
        rig: ReloadRig) -> None:
    written = rig.store()
    offered, split = rig.load("b", 0, 2 * BS + 1, [8, 9, 10])
    assert (offered, split) == (2 * BS, {"memory": 2})
    rig.planner.blocks.clear()  # the control: the tier's dict emptied
    assert rig.planner.present(_keys()) == [False] * STORED

    offered, split = rig.load("c", 0, STORED * BS + 1, list(range(10, 18)))
    assert (offered, split) == (2 * BS, {POOL: 2})  # the pool's only (4 * BS with the tier)
    for i in range(2):
        assert torch.equal(rig.blocks[10 + i], written[i])
    assert bool((rig.blocks[12:18] == POISON).all())
    offered, split = rig.load("d", 4, STORED * BS + 1, [10, 11, 12, 13, 18, 19, 20, 21])
    assert (offered, split) == (0, {})  # 4 with the tier
    assert bool((rig.blocks[18:22] == POISON).all())
    counters = rig.core.take_counters()
    assert counters.tiers["memory"]["hit_tokens"] == 2 * BS  # "b" only
    assert counters.failed_loads == 0
