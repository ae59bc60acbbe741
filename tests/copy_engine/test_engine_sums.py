"""Transfer engine with row sums on the CPU backend: summed stores, checked loads (staged,
stopping at the first bad block), and the input they refuse. (test_engine.py has the rest.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import POISON_CACHE, TIMEOUT, Rig
from test_row_sums import reference

from transfer.copy import base
from transfer.copy.base import Segment, ThreadBackend
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.engine import CopyResult, TransferEngine

N = 7


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def stored(r: Rig, seed: int = 0) -> tuple[list[int], list[int], tuple[int, ...]]:
    """Store N random blocks with sums: (GPU block ids, slots, the sums reported)."""
    rng = np.random.default_rng(seed)
    gpu_ids = rng.choice(r.engine.num_gpu_blocks, N, replace=False).tolist()
    slots = rng.choice(r.engine.num_slots, N, replace=False).tolist()
    assert r.engine.submit_store(1, gpu_ids, slots, sums=True)
    assert r.engine.wait([1], TIMEOUT)
    res = r.finished()[1]
    assert res.ok and res.good is None and len(res.sums) == N
    return gpu_ids, slots, res.sums


def test_summed_store_reports_the_sums_of_its_blocks(rig: Rig) -> None:
    assert rig.engine.can_sum and len(rig.segments) == 1
    gpu = rig.segments[0].gpu
    gpu_ids, slots, sums = stored(rig)
    assert list(sums) == to_unsigned(row_sums(gpu, torch.tensor(gpu_ids)).numpy())
    assert list(sums) == reference(gpu[gpu_ids])  # the pure-Python reference, too
    assert list(sums) == reference(rig.segments[0].host[slots])  # what landed in the pool
    assert all(isinstance(s, int) and 0 <= s < 2**64 for s in sums)
    assert len(set(sums)) == N


def test_plain_jobs_carry_no_sums(rig: Rig) -> None:
    assert rig.engine.submit_store(1, [0, 1], [0, 1])
    assert rig.engine.submit_load(2, [5], [9])
    assert rig.engine.wait(None, TIMEOUT)
    res = rig.finished()
    for job in (1, 2):
        assert res[job].ok and res[job].sums == () and res[job].good is None


def check_load(r: Rig, monkeypatch: pytest.MonkeyPatch, bad: int | None, stage_rows: int) -> None:
    """Store N blocks with sums, flip one byte of slot number `bad` (None: none), load them
    checked into other, poisoned blocks; compare every byte of the cache."""
    bb = r.engine.block_bytes
    monkeypatch.setattr(base, "STAGE_BYTES", stage_rows * bb)
    gpu_ids, slots, sums = stored(r)
    blocks = r.segments[0].gpu
    originals = blocks[gpu_ids].clone()
    if bad is not None:
        r.pool.slots[slots[bad]][bb // 2] ^= 0x04
    r.cache.raw.fill_(POISON_CACHE)
    pool_before = r.pool.buffer.raw.clone()
    rng = np.random.default_rng(1)
    targets = rng.choice(r.engine.num_gpu_blocks, N, replace=False).tolist()
    assert r.engine.submit_load(2, slots, targets, expect=sums)
    assert r.engine.wait([2], TIMEOUT)
    good = N if bad is None else bad
    res = r.finished()
    assert res == {2: CopyResult(2, True, good * bb, res[2].seconds, False, (), good)}
    want = torch.full_like(blocks, POISON_CACHE)
    for i in range(good):
        want[targets[i]] = originals[i]
    assert torch.equal(blocks, want)
    assert torch.equal(r.cache.raw, torch.full_like(r.cache.raw, POISON_CACHE)) == (good == 0)
    assert torch.equal(r.pool.buffer.raw, pool_before)  # a load leaves the pool as it was


@pytest.mark.parametrize("bad", [0, 1, 3, 6])
@pytest.mark.parametrize("stage_rows", [2, 1 << 20])  # 2: the bad block in a later stage
def test_checked_load_stops_at_the_first_bad_block(monkeypatch: pytest.MonkeyPatch, rig: Rig,
                                                   bad: int, stage_rows: int) -> None:
    check_load(rig, monkeypatch, bad, stage_rows)


@pytest.mark.parametrize("stage_rows", [1, 2, 3, 1 << 20])
def test_checked_load_of_good_blocks_lands_them_all(monkeypatch: pytest.MonkeyPatch, rig: Rig,
                                                    stage_rows: int) -> None:
    check_load(rig, monkeypatch, None, stage_rows)


def test_checked_load_of_wrong_sums_lands_nothing(rig: Rig) -> None:
    _, slots, sums = stored(rig)
    rig.cache.raw.fill_(POISON_CACHE)
    before = rig.cache.raw.clone()
    assert rig.engine.submit_load(2, slots[:3], [30, 31, 32], expect=[sums[1], *sums[1:3]])
    assert rig.engine.wait([2], TIMEOUT)
    res = rig.finished()[2]
    assert res.ok and res.good == 0 and res.nbytes == 0
    assert torch.equal(rig.cache.raw, before)


BAD_EXPECT = [
    ([1, 2], "2 expected sums for 3 slots"),
    ([1, -1, 2], "got -1 at 1"),
    ([1, 2, 2**64], f"got {2**64} at 2"),
    ([1, np.int64(-5), 2], r"got (np\.int64\()?-5\)? at 1"),
    ([None, 1, 2], "got None at 0"),
    ([1, "x", 2], "got 'x' at 1"),
    ([1, 2.5, 2], "got 2.5 at 1"),  # numpy would truncate it to 2
    ([1, "7", 2], "got '7' at 1"),  # numpy would parse it
    ([1, True, 2], "got True at 1"),  # numpy would take it as 1
    (np.zeros((3, 1), np.uint64), "at 0"),  # one sum per block
    (np.array([1, -2, 3], np.int64), r"got (np\.int64\()?-2\)? at 1"),
]


@pytest.mark.parametrize("expect, match", BAD_EXPECT, ids=[repr(e[0]) for e in BAD_EXPECT])
def test_bad_expected_sums_raise_before_anything_is_queued(rig: Rig, expect: list,
                                                           match: str) -> None:
    cache_before, pool_before = rig.cache.raw.clone(), rig.pool.buffer.raw.clone()
    with pytest.raises(ValueError, match=match):
        rig.engine.submit_load(4, [0, 1, 2], [3, 4, 5], expect=expect)
    assert rig.engine.wait(None, TIMEOUT)
    assert rig.engine.get_finished() == []
    assert torch.equal(rig.cache.raw, cache_before)
    assert torch.equal(rig.pool.buffer.raw, pool_before)
    assert rig.engine.submit_load(4, [0], [3])  # the job id is still free


def test_expected_sums_as_numpy_unsigned(rig: Rig) -> None:
    """Sums as a uint64 array (how a worker hands them over); the engine keeps its own copy:
    the caller's array changed right after submit changes nothing."""
    _, slots, sums = stored(rig)
    expect = np.array(sums, dtype=np.uint64)
    assert rig.engine.submit_load(2, slots, list(range(20, 20 + N)), expect=expect)
    expect[:] = 0
    assert rig.engine.wait([2], TIMEOUT)
    res = rig.finished()[2]
    assert res.ok and res.good == N and res.nbytes == N * rig.engine.block_bytes
    assert torch.equal(rig.segments[0].gpu[20:20 + N], rig.pool.slots[slots])


def refused(engine: TransferEngine, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.submit_store(1, [0], [0], sums=True)
    with pytest.raises(ValueError, match=match):
        engine.submit_load(2, [0], [0], expect=[0])
    assert engine.wait(None, TIMEOUT)
    assert engine.get_finished() == []


def test_blocks_of_several_segments_refuse_sums() -> None:
    r = Rig("LBHNC")
    try:
        assert len(r.segments) == 3 and not r.engine.can_sum
        before = r.cache.raw.clone()
        refused(r.engine, f"3 segment\\(s\\) of {r.engine.block_bytes} bytes")
        assert torch.equal(r.cache.raw, before)
    finally:
        r.close()


def test_rows_of_partial_words_refuse_sums() -> None:
    gpu = torch.full((4, 6), POISON_CACHE, dtype=torch.uint8)
    engine = TransferEngine([Segment(gpu, torch.zeros(8, 6, dtype=torch.uint8))], ThreadBackend())
    try:
        assert not engine.can_sum
        refused(engine, "1 segment\\(s\\) of 6 bytes")
        assert torch.equal(gpu, torch.full_like(gpu, POISON_CACHE))
        assert engine.submit_store(3, [0], [0])  # plain jobs still run
        assert engine.wait(None, TIMEOUT) and engine.get_finished()[0].sums == ()
    finally:
        engine.close()


class _NoSums(ThreadBackend):
    """A backend whose lanes cannot sum (a CUDA one without cupy or NVRTC) and whose lanes
    cannot stage checked loads."""

    sums_rows = False


def test_a_backend_that_cannot_sum_refuses_sums() -> None:
    gpu, host = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 64, dtype=torch.uint8)
    engine = TransferEngine([Segment(gpu, host)], _NoSums())
    try:
        assert not engine.can_sum
        with pytest.raises(ValueError, match="row sums need"):
            engine.submit_store(1, [0], [0], sums=True)
        assert engine.reserve_checked_loads()  # host lanes stage nothing
    finally:
        engine.close()
