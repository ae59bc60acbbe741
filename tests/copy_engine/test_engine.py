"""Transfer engine on the CPU backend: round trips, ordering, back-pressure, bad input."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvconnector.layout.allocator import KVBuffer, allocate
from kvconnector.layout.descriptor import KVLayout
from transfer.copy.base import Segment, ThreadBackend
from transfer.engine import CopyResult, TransferEngine
from transfer.pool import HostPool

POISON_POOL = 0xA5
POISON_CACHE = 0x5A
TIMEOUT = 60.0  # liveness only: a hang fails after this, nothing asserts on durations


def small_layout(order: str = "BLNHC", num_layers: int = 3) -> KVLayout:
    # page = 2 heads * 4 tokens * 16 content * 2 B = 256 B; block = 3 pages.
    return KVLayout(num_layers=num_layers, num_kv_heads=2, head_size=8, block_size=4,
                    dtype="bfloat16", order=order)


def cache_chunks(buf: KVBuffer) -> list[torch.Tensor]:
    """GPU-side row tensors as recognize.py would give them: whole blocks, or pages per layer."""
    layout = buf.layout
    if layout.is_block_major:
        return [buf.block_chunks()]
    strides = layout.axis_strides(buf.num_blocks)
    esize = layout.element_size
    raw = buf.raw
    if layout.order.index("H") < layout.order.index("B"):  # LHBNC: a page is one run per head
        width = layout.block_size * layout.content_size * esize
        offsets = [(layer * strides["L"] + h * strides["H"]) * esize
                   for layer in range(layout.num_layers) for h in range(layout.num_kv_heads)]
    else:
        width = layout.page_bytes
        offsets = [layer * strides["L"] * esize for layer in range(layout.num_layers)]
    return [torch.as_strided(raw, (buf.num_blocks, width), (strides["B"] * esize, 1),
                             raw.storage_offset() + off) for off in offsets]


def random_fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def distinct(rng: np.random.Generator, limit: int, n: int) -> list[int]:
    return rng.choice(limit, size=n, replace=False).tolist()


def rebase(view: torch.Tensor, raw: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The same view geometry over `other`, a contiguous 1-D copy of `raw`."""
    return torch.as_strided(other, view.shape, view.stride(),
                            view.storage_offset() - raw.storage_offset())


def expected_after(raw: torch.Tensor, before: torch.Tensor, rows: list[torch.Tensor],
                   src: list[torch.Tensor], src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    """`before` (a copy of `raw`) with src rows copied into the dst rows of each region."""
    out = before.clone()
    for dst_view, src_view in zip(rows, src, strict=True):
        target = rebase(dst_view, raw, out)
        for s, d in zip(src_ids, dst_ids, strict=True):
            target[d] = src_view[s]
    return out


class Rig:
    """A host "GPU" cache, a pool and an engine over them."""

    def __init__(self, order: str = "BLNHC", num_blocks: int = 40, num_slots: int = 24,
                 gate=None, max_store_bytes: int = 1 << 30) -> None:
        self.cache = allocate(small_layout(order), num_blocks=num_blocks)
        self.pool = HostPool.create(num_slots, small_layout(order).block_bytes, pinned=False)
        self.segments = self.pool.segments(cache_chunks(self.cache))
        self.engine = TransferEngine(self.segments, ThreadBackend(gate),
                                     max_store_bytes=max_store_bytes)
        random_fill(self.cache.raw, 1)
        self.pool.buffer.raw.fill_(POISON_POOL)

    def close(self) -> None:
        self.engine.close()
        self.pool.close()
        self.cache.close()

    def finished(self) -> dict[int, CopyResult]:
        return {r.job_id: r for r in self.engine.get_finished()}

    def gpu_rows(self) -> list[torch.Tensor]:
        return [s.gpu for s in self.segments]

    def host_rows(self) -> list[torch.Tensor]:
        return [s.host for s in self.segments]


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


@pytest.mark.parametrize("order", ["BLNHC", "BHLNC", "LBHNC", "LBNHC", "LHBNC"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_bit_exact(order: str, seed: int) -> None:
    r = Rig(order)
    try:
        rng = np.random.default_rng(seed)
        n = 9
        gpu_ids, slots = distinct(rng, r.engine.num_gpu_blocks, n), distinct(rng, 24, n)
        pool_before = r.pool.buffer.raw.clone()
        assert r.engine.submit_store(1, gpu_ids, slots)
        assert r.engine.wait([1], TIMEOUT)
        res = r.finished()
        assert res == {1: CopyResult(1, True, n * r.pool.block_bytes, res[1].seconds, True)}
        want = expected_after(r.pool.buffer.raw, pool_before, r.host_rows(), r.gpu_rows(),
                              gpu_ids, slots)
        assert torch.equal(r.pool.buffer.raw, want)

        # Load into other, poisoned blocks; every byte of the cache is compared.
        originals = [g.clone() for g in r.gpu_rows()]
        r.cache.raw.fill_(POISON_CACHE)
        cache_before = r.cache.raw.clone()
        targets = distinct(rng, r.engine.num_gpu_blocks, n)
        assert r.engine.submit_load(2, slots, targets)
        assert r.engine.wait([2], TIMEOUT)
        assert r.finished()[2].ok
        want = expected_after(r.cache.raw, cache_before, r.gpu_rows(), originals, gpu_ids,
                              targets)
        assert torch.equal(r.cache.raw, want)
    finally:
        r.close()


def test_fallback_has_one_segment_per_layer() -> None:
    r = Rig("LBHNC")
    try:
        assert len(r.segments) == 3
        assert [s.nbytes for s in r.segments] == [r.cache.layout.page_bytes] * 3
        assert r.pool.slots.shape == (24, r.cache.layout.block_bytes)  # a whole block a slot
    finally:
        r.close()


def test_duplicate_sources_are_allowed(rig: Rig) -> None:
    assert rig.engine.submit_store(1, [5, 5], [0, 1])
    assert rig.engine.wait(None, TIMEOUT)
    assert rig.finished()[1].ok
    assert torch.equal(rig.pool.slots[0], rig.cache.block_chunks()[5])
    assert torch.equal(rig.pool.slots[1], rig.cache.block_chunks()[5])


def test_ids_as_numpy_and_tensor(rig: Rig) -> None:
    assert rig.engine.submit_store(1, np.array([4, 9], dtype=np.int32), torch.tensor([3, 1]))
    assert rig.engine.wait(None, TIMEOUT)
    assert torch.equal(rig.pool.slots[3], rig.cache.block_chunks()[4])
    assert torch.equal(rig.pool.slots[1], rig.cache.block_chunks()[9])


def test_ids_as_a_tuple_and_a_list_of_ints_of_any_kind(rig: Rig) -> None:
    """A worker's job carries its ids as a tuple: numpy ints in it count as ints."""
    assert rig.engine.submit_store(1, (np.int64(6), 7, 2), [5, np.int32(0), 8])
    assert rig.engine.wait(None, TIMEOUT)
    for slot, block in ((5, 6), (0, 7), (8, 2)):
        assert torch.equal(rig.pool.slots[slot], rig.cache.block_chunks()[block])


def test_empty_job_finishes(rig: Rig) -> None:
    assert rig.engine.submit_load(7, [], [])
    assert rig.engine.wait([7], TIMEOUT)
    res = rig.finished()
    assert set(res) == {7} and res[7].ok and res[7].nbytes == 0 and not res[7].is_store


class Holder:
    """A gate that holds chosen job ids until released; says when a held job has started."""

    def __init__(self, *held: int) -> None:
        self.held = set(held)
        self.entered = {j: threading.Event() for j in held}
        self.release = {j: threading.Event() for j in held}

    def __call__(self, job_id: int) -> None:
        if job_id in self.held:
            self.entered[job_id].set()
            self.release[job_id].wait()

    def open(self, job_id: int) -> None:
        self.release[job_id].set()


def test_load_of_a_slot_being_stored_waits_and_others_do_not() -> None:
    gate = Holder(1)
    r = Rig(gate=gate)
    try:
        blocks = r.cache.block_chunks()
        random_fill(r.pool.slots[2], 7)
        slot2 = r.pool.slots[2].clone()
        r.cache.raw.fill_(POISON_CACHE)
        random_fill(blocks[3], 8)
        block3 = blocks[3].clone()

        assert r.engine.submit_store(1, [3], [7])
        assert gate.entered[1].wait(TIMEOUT)  # the store is running, held mid-flight
        assert r.engine.submit_load(2, [7], [10])  # same slot: must wait for the store
        assert r.engine.submit_load(3, [2], [11])  # another slot: must not
        assert r.engine.wait([3], TIMEOUT)
        assert torch.equal(blocks[11], slot2)
        assert r.engine.wait([2], timeout=0) is False
        assert set(r.finished()) == {3}
        assert torch.equal(blocks[10], torch.full_like(blocks[10], POISON_CACHE))

        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        res = r.finished()
        assert set(res) == {1, 2} and res[1].ok and res[2].ok
        assert torch.equal(blocks[10], block3)
    finally:
        gate.open(1)
        r.close()


def test_load_waits_for_a_queued_store_of_its_slot() -> None:
    gate = Holder(1)
    r = Rig(gate=gate)
    try:
        blocks = r.cache.block_chunks()
        r.cache.raw.fill_(POISON_CACHE)
        random_fill(blocks[4], 3)
        assert r.engine.submit_store(1, [0], [0])  # held: the store lane is blocked
        assert gate.entered[1].wait(TIMEOUT)
        assert r.engine.submit_store(2, [4], [5])  # queued behind it, not started
        assert r.engine.submit_load(3, [5], [20])
        assert r.engine.submit_load(4, [9], [21])  # behind load 3 if load 3 were not set aside
        assert r.engine.wait([4], TIMEOUT)
        assert r.engine.wait([3], timeout=0) is False
        assert torch.equal(blocks[20], torch.full_like(blocks[20], POISON_CACHE))
        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        assert all(x.ok for x in r.finished().values())
        assert torch.equal(blocks[20], blocks[4])
    finally:
        gate.open(1)
        r.close()


def test_store_after_load_of_same_block_waits() -> None:
    gate = Holder(1)
    r = Rig(gate=gate)
    try:
        blocks = r.cache.block_chunks()
        random_fill(r.pool.slots[6], 9)
        assert r.engine.submit_load(1, [6], [12])  # held before it writes block 12
        assert gate.entered[1].wait(TIMEOUT)
        assert r.engine.submit_store(2, [12], [8])  # reads block 12: must see the loaded bytes
        assert r.engine.submit_store(3, [13], [9])  # behind store 2 if it were not set aside
        assert r.engine.wait([3], TIMEOUT)
        assert r.engine.wait([2], timeout=0) is False
        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        assert torch.equal(r.pool.slots[8], r.pool.slots[6])
        assert torch.equal(blocks[12], r.pool.slots[6])
    finally:
        gate.open(1)
        r.close()


def test_reported_jobs_hold_nothing_back() -> None:
    """What reported jobs touched (a GPU block read twice included) delays no later job; what an
    unreported one touches still does."""
    gate = Holder(5, 11)
    r = Rig(gate=gate)
    try:
        assert r.engine.submit_store(1, [3, 3], [7, 8])
        assert r.engine.submit_load(2, [7], [12])  # waits for store 1 on a spare lane
        assert r.engine.wait(None, TIMEOUT)
        assert {j: x.ok for j, x in r.finished().items()} == {1: True, 2: True}
        spares = len(r.engine._all_spares)
        assert r.engine.submit_store(5, [0], [0])
        assert gate.entered[5].wait(TIMEOUT)
        assert r.engine.submit_load(6, [7, 8], [3, 12])  # the reported jobs' ids only
        assert r.engine.wait([6], TIMEOUT)
        assert len(r.engine._all_spares) == spares  # on the load lane, not set aside
        assert torch.equal(r.cache.block_chunks()[3], r.pool.slots[8])
        assert r.engine.submit_load(7, [0], [20])  # slot 0: store 5 still writes it
        assert r.engine.wait([7], timeout=0.2) is False
        gate.open(5)
        assert r.engine.wait(None, TIMEOUT)
        assert all(x.ok for x in r.finished().values())
        assert torch.equal(r.cache.block_chunks()[20], r.cache.block_chunks()[0])
        # Two jobs on block 25, the first reported: the second still holds a store of it back.
        random_fill(r.pool.slots[5], 4)
        assert r.engine.submit_load(10, [4], [25])
        assert r.engine.submit_load(11, [5], [25])  # waits for load 10; then held
        assert gate.entered[11].wait(TIMEOUT)
        assert set(r.finished()) == {10}
        assert r.engine.submit_store(12, [25], [10])
        assert r.engine.wait([12], timeout=0.2) is False
        gate.open(11)
        assert r.engine.wait(None, TIMEOUT)
        assert all(x.ok for x in r.finished().values())
        assert torch.equal(r.pool.slots[10], r.pool.slots[5])
    finally:
        gate.open(5)
        gate.open(11)
        r.close()


def test_a_callers_id_array_changed_after_submit_changes_nothing() -> None:
    """The engine keeps its own copy of a job's ids: a caller reusing its array after submit
    neither loses the job's place in the conflict checks nor moves another's."""
    gate = Holder(2)
    r = Rig(gate=gate)
    try:
        slots = np.array([5])
        assert r.engine.submit_store(1, torch.tensor([3]), slots)
        assert r.engine.wait([1], TIMEOUT)
        slots[0] = 6
        assert set(r.finished()) == {1}
        assert r.engine.submit_store(2, [4], [6])  # held while it writes slot 6
        assert gate.entered[2].wait(TIMEOUT)
        assert r.engine.submit_load(3, [6], [10])  # must wait for store 2
        assert r.engine.wait([3], timeout=0.2) is False
        gate.open(2)
        assert r.engine.wait(None, TIMEOUT)
        assert all(x.ok for x in r.finished().values())
        assert torch.equal(r.cache.block_chunks()[10], r.cache.block_chunks()[4])
        assert torch.equal(r.pool.slots[5], r.cache.block_chunks()[3])
    finally:
        gate.open(2)
        r.close()


def test_loads_pass_queued_stores() -> None:
    gate = Holder(1)
    r = Rig(gate=gate)
    try:
        assert r.engine.submit_store(1, [0], [0])
        assert gate.entered[1].wait(TIMEOUT)
        assert r.engine.submit_store(2, [1], [1])
        assert r.engine.submit_store(3, [2], [2])
        assert r.engine.submit_load(4, [9], [30])
        assert r.engine.wait([4], TIMEOUT)
        assert set(r.finished()) == {4}
        assert r.engine.wait([2, 3], timeout=0) is False
        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        assert set(r.finished()) == {1, 2, 3}
    finally:
        gate.open(1)
        r.close()


def test_store_dropped_under_pressure_whole_and_reported() -> None:
    gate = Holder(1)
    bb = small_layout().block_bytes
    r = Rig(gate=gate, max_store_bytes=3 * bb)
    try:
        pool_before = r.pool.buffer.raw.clone()
        assert r.engine.submit_store(1, [0, 1], [0, 1])  # 2 blocks in flight, held
        assert gate.entered[1].wait(TIMEOUT)
        assert r.engine.inflight_store_bytes == 2 * bb
        assert r.engine.submit_store(2, [2, 3], [2, 3]) is False  # 4 blocks > 3: dropped
        assert r.engine.submit_store(3, [4], [4])  # 3 blocks: fits
        assert r.engine.submit_load(4, [10], [30])  # loads are never dropped
        res = r.finished()
        assert res[2] == CopyResult(2, False, 0, 0.0, True)
        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        res.update(r.finished())
        assert res[1].ok and res[3].ok and res[4].ok and not res[2].ok
        assert set(res) == {1, 2, 3, 4}
        # The dropped store wrote nothing: slots 2 and 3 are still poison.
        assert torch.equal(r.pool.slots[2:4], pool_before.as_strided(
            r.pool.slots[2:4].shape, r.pool.slots.stride(), 2 * r.pool.slots.stride(0)))
        # Idle again: a store bigger than the bound is taken rather than refused forever.
        assert r.engine.submit_store(5, list(range(5, 10)), list(range(5, 10)))
        assert r.engine.wait(None, TIMEOUT) and r.finished()[5].ok
    finally:
        gate.open(1)
        r.close()


def test_failed_store_fails_dependent_load_without_writing() -> None:
    def gate(job_id: int) -> None:
        if job_id == 1:
            raise RuntimeError("injected copy fault")

    r = Rig(gate=gate)
    try:
        blocks = r.cache.block_chunks()
        before = blocks[15].clone()
        assert r.engine.submit_store(1, [3], [7])
        assert r.engine.submit_load(2, [7], [15])
        assert r.engine.wait(None, TIMEOUT)
        res = r.finished()
        assert not res[1].ok and not res[2].ok and res[2].nbytes == 0
        assert torch.equal(blocks[15], before)
    finally:
        r.close()


class BadIndex:
    """An id whose int conversion raises."""

    def __index__(self) -> int:
        raise RuntimeError("no int here")


@pytest.mark.parametrize("call, match", [
    (lambda e: e.submit_store(1, [40], [0]), "GPU block id 40 out of range"),
    (lambda e: e.submit_store(1, [0], [24]), "slot id 24 out of range"),
    (lambda e: e.submit_load(1, [-1], [0]), "slot id -1 out of range"),
    (lambda e: e.submit_load(1, [0], [-3]), "GPU block id -3 out of range"),
    (lambda e: e.submit_store(1, [0, 1], [2]), "2 GPU block ids but 1 slot ids"),
    (lambda e: e.submit_store(1, [0, 1, 2], [4, 5, 4]), "destination slot id 4"),
    (lambda e: e.submit_load(1, [0, 1], [9, 9]), "destination GPU block id 9"),
    (lambda e: e.submit_store(1, [0.5], [1]), "must be integers"),
    (lambda e: e.submit_store(1, [True], [1]), "must be integers"),
    (lambda e: e.submit_store(1, (0, 0.5), (1, 2)), "must be integers"),  # past the first
    (lambda e: e.submit_load(1, [2**70], [0]), "must be integers"),  # past int64
    (lambda e: e.submit_load(1, [0, "1"], [0, 1]), "must be integers"),
    (lambda e: e.submit_load(1, (0, BadIndex()), (0, 1)), "must be integers"),
    (lambda e: e.submit_store(1, [[0]], [[1]]), "1-D"),
    (lambda e: e.submit_store("x", [0], [1]), "job id must be an int"),
    (lambda e: e.check_load(1, [0, 24], [0, 1]), "slot id 24 out of range"),
    (lambda e: e.check_load(3, [0, 1], [2]), "job 3: 1 GPU block ids but 2 slot ids"),
    (lambda e: e.check_load(1, [0, 1], [9, 9]), "destination GPU block id 9"),
])
def test_bad_input_raises_before_any_byte_moves(rig: Rig, call, match: str) -> None:
    cache_before, pool_before = rig.cache.raw.clone(), rig.pool.buffer.raw.clone()
    with pytest.raises(ValueError, match=match):
        call(rig.engine)
    assert rig.engine.wait(None, TIMEOUT)
    assert rig.engine.get_finished() == []
    assert torch.equal(rig.cache.raw, cache_before)
    assert torch.equal(rig.pool.buffer.raw, pool_before)


def test_check_load_of_good_ids_queues_nothing(rig: Rig) -> None:
    cache_before = rig.cache.raw.clone()
    rig.engine.check_load(1, [0, 1], [2, 3])
    assert rig.engine.get_finished() == []
    assert torch.equal(rig.cache.raw, cache_before)
    assert rig.engine.submit_load(1, [0, 1], [2, 3])  # the id is still free


def test_job_id_in_flight_is_refused() -> None:
    gate = Holder(1)
    r = Rig(gate=gate)
    try:
        assert r.engine.submit_store(1, [0], [0])
        with pytest.raises(ValueError, match="job id 1"):
            r.engine.submit_load(1, [3], [3])
        gate.open(1)
        assert r.engine.wait(None, TIMEOUT)
        assert set(r.finished()) == {1}
        assert r.engine.submit_load(1, [0], [3])  # reported, so the id is free again
    finally:
        gate.open(1)
        r.close()


def test_segments_must_match() -> None:
    gpu = torch.zeros(4, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="GPU rows hold 256 B, host rows 128 B"):
        TransferEngine([Segment(gpu, torch.zeros(8, 128, dtype=torch.uint8))], ThreadBackend())
    with pytest.raises(ValueError, match="2-D uint8"):
        TransferEngine([Segment(gpu.float(), torch.zeros(8, 256))], ThreadBackend())
    with pytest.raises(ValueError, match="no segments"):
        TransferEngine([], ThreadBackend())
    with pytest.raises(ValueError, match="max_store_bytes"):
        TransferEngine([Segment(gpu, torch.zeros(8, 256, dtype=torch.uint8))], ThreadBackend(),
                       max_store_bytes=0)


def test_closed_engine_refuses_jobs(rig: Rig) -> None:
    rig.engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        rig.engine.submit_store(1, [0], [0])
