"""Row sums on CUDA lanes (transfer/copy/cuda_sums.py), on a real GPU and a pinned pool.

A summed store reports the sums a CPU computes from the same bytes, and ends only once copied
(its sums run beside its copies); a checked load lands only its leading blocks whose slots
match (every byte compared against a poisoned cache), through staging buffers reused many times
over; it follows the compute stream, and a store of its blocks follows it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import KVLayout
from transfer.copy import base, cuda_sums
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.engine import TransferEngine
from transfer.pool import HostPool


def gpu(test: object) -> object:
    """A test that needs a CUDA GPU (the rest of the file runs anywhere)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs a CUDA GPU")(test))


POISON = 0x5A
BACKENDS = ["auto", "dma", "sm"]
# 8 layers x 64 KB pages: 512 KB blocks, block-major (one segment: row sums apply).
LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_size=128, block_size=16,
                  dtype="bfloat16", order="BLNHC")


class Rig:
    def __init__(self, backend: str, num_blocks: int = 64, num_slots: int = 64) -> None:
        from transfer.copy.factory import make_backend

        self.cache = allocate(LAYOUT, num_blocks=num_blocks, device="cuda")
        gen = torch.Generator().manual_seed(7)
        self.cache.raw.copy_(torch.randint(0, 256, (self.cache.raw.numel(),), dtype=torch.uint8,
                                           generator=gen))
        self.pool = HostPool.create(num_slots, LAYOUT.block_bytes, pinned=True)
        assert self.pool.pinned
        self.pool.buffer.raw.fill_(0xA5)
        self.rows = self.cache.block_chunks()
        self.engine = TransferEngine(self.pool.segments([self.rows]),
                                     make_backend(backend, "cuda"))
        assert self.engine.can_sum

    def finished(self) -> dict[int, object]:
        return {r.job_id: r for r in self.engine.get_finished()}

    def close(self) -> None:
        self.engine.close()
        self.pool.close()


@pytest.fixture(params=BACKENDS)
def rig(request: pytest.FixtureRequest) -> Rig:
    rig = Rig(request.param)
    yield rig
    rig.close()


@pytest.mark.parametrize("n,per,least", [(1024, 32, 2), (512, 16, 1), (40, 8, 1), (10, 32, 2),
                                         (33, 32, 2), (64, 32, 2), (1, 32, 2), (5, 1, 1),
                                         (7, 4, 8)])
def test_a_checked_loads_chunks_cover_its_rows_once_and_taper_at_the_end(
        n: int, per: int, least: int) -> None:
    chunks = cuda_sums._chunks(n, per, least)
    starts = [start for start, _ in chunks]
    sizes = [rows for _, rows in chunks]
    assert starts == [sum(sizes[:k]) for k in range(len(sizes))] and sum(sizes) == n
    assert all(0 < rows <= per for rows in sizes)
    body = [rows for start, rows in chunks if start + per < n]  # before the last `per` rows
    assert body == [per] * len(body)
    tail = sizes[len(body):]
    assert tail == sorted(tail, reverse=True)  # halving down
    assert tail[-1] <= max(least, 1) or len(tail) == 1
    assert len(tail) <= 2 + max(0, per.bit_length() - max(least, 1).bit_length())


def test_the_tapers_figures() -> None:
    assert [rows for _, rows in cuda_sums._chunks(1024, 32, 2)] == [32] * 31 + [16, 8, 4, 2, 2]
    assert [rows for _, rows in cuda_sums._chunks(40, 8, 1)] == [8] * 4 + [4, 2, 1, 1]
    assert [rows for _, rows in cuda_sums._chunks(40, 3, 3)] == [3] * 13 + [1]


@gpu
def test_a_summed_store_reports_what_a_cpu_sums_of_its_bytes(rig: Rig) -> None:
    ids, slots = list(range(40, 0, -2)), list(range(20))
    assert rig.engine.submit_store(1, ids, slots, sums=True)
    assert rig.engine.wait(timeout=120)
    (result,) = rig.finished().values()
    assert result.ok and len(result.sums) == 20
    host = rig.rows.cpu()[ids]
    assert list(result.sums) == to_unsigned(row_sums(host))
    assert torch.equal(rig.pool.slots[slots], host)  # and the copy itself is exact
    assert len(set(result.sums)) == 20


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_summed_store_ends_only_once_its_copies_and_its_sums_are_done(backend: str) -> None:
    """Its sums run beside its copies (both read the same GPU rows); the job still ends only
    once every byte is copied: 512 blocks copy for ~5 ms, their sums take a fraction of that,
    so a job ending with its sums would show its last slot not yet written."""
    rig = Rig(backend, num_blocks=512, num_slots=512)
    try:
        ids, slots = list(range(511, -1, -1)), list(range(512))
        assert rig.engine.submit_store(1, ids, slots, sums=True)
        assert rig.engine.wait(timeout=120)
        last = rig.pool.slots[slots[-1]].clone()  # the last copy's slot, read at once
        (result,) = rig.finished().values()
        host = rig.rows.cpu()[ids]
        assert result.ok and torch.equal(last, host[-1])
        assert torch.equal(rig.pool.slots[slots], host)
        assert list(result.sums) == to_unsigned(row_sums(host))
    finally:
        rig.close()


@gpu
@pytest.mark.parametrize("bad", [None, 0, 4, 17, 34, 37, 39])
@pytest.mark.parametrize("stage_blocks,tail_blocks", [(3, 3), (8, 1)])
def test_a_checked_load_lands_only_its_leading_good_blocks(
        rig: Rig, bad: int | None, stage_blocks: int, tail_blocks: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 3-block stages: 40 blocks in 14 chunks through the 2 buffers. 8-block stages with a
    # tail of single blocks: chunks 8, 8, 8, 8, 4, 2, 1, 1 (the last ones halve).
    monkeypatch.setattr(base, "STAGE_BYTES", stage_blocks * LAYOUT.block_bytes)
    monkeypatch.setattr(cuda_sums, "_TAIL_BYTES", tail_blocks * LAYOUT.block_bytes)
    slots, src = list(range(40)), list(range(40))
    assert rig.engine.submit_store(1, src, slots, sums=True)
    rig.engine.wait()
    sums = list(rig.finished()[1].sums)
    want = rig.pool.slots[slots].clone()
    if bad is not None:
        rig.pool.slots[slots[bad], LAYOUT.block_bytes // 2] ^= 0x01
    rig.cache.raw.fill_(POISON)
    dst = list(range(63, 23, -1))
    assert rig.engine.submit_load(2, slots, dst, expect=sums)
    assert rig.engine.wait(timeout=120)
    result = rig.finished()[2]
    good = 40 if bad is None else bad
    assert result.ok and result.good == good
    assert result.nbytes == good * LAYOUT.block_bytes
    cache = rig.rows.cpu()
    assert torch.equal(cache[dst[:good]], want[:good])
    assert bool((cache[dst[good:]] == POISON).all())
    untouched = sorted(set(range(64)) - set(dst))
    assert bool((cache[untouched] == POISON).all())


@gpu
def test_checked_loads_and_summed_stores_in_flight_together(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "STAGE_BYTES", 2 * LAYOUT.block_bytes)
    assert rig.engine.submit_store(1, list(range(32)), list(range(32)), sums=True)
    rig.engine.wait()
    sums = list(rig.finished()[1].sums)
    want = rig.pool.slots[:32].clone()
    # Loads of 0-31 into blocks 32-63 (two jobs) while blocks 0-31 are stored to slots 32-63.
    rig.engine.submit_load(2, list(range(16)), list(range(32, 48)), expect=sums[:16])
    rig.engine.submit_store(3, list(range(32)), list(range(32, 64)), sums=True)
    rig.engine.submit_load(4, list(range(16, 32)), list(range(48, 64)), expect=sums[16:])
    assert rig.engine.wait(timeout=120)
    done = rig.finished()
    assert (done[2].good, done[4].good) == (16, 16)
    assert list(done[3].sums) == sums  # the same bytes, summed again
    assert torch.equal(rig.rows.cpu()[32:], want)
    assert torch.equal(rig.pool.slots[32:], want)


@gpu
def test_a_checked_load_follows_compute_and_a_store_of_its_blocks_follows_it(rig: Rig) -> None:
    import cupy

    assert rig.engine.submit_store(1, list(range(8)), list(range(8)), sums=True)
    rig.engine.wait()
    sums = list(rig.finished()[1].sums)
    want = rig.pool.slots[:8].clone()
    rig.cache.raw[rig.rows[10:18].storage_offset():].fill_(POISON)
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    spin = cupy.RawKernel(r"""
    extern "C" __global__ void spin(const unsigned long long flag_addr) {
        volatile int* flag = (volatile int*)flag_addr;
        while (*flag == 0) { __nanosleep(2000); }
    }""", "spin")
    compute = torch.cuda.Stream()
    watchdog = threading.Timer(120, lambda: flag.fill_(1))
    watchdog.daemon = True
    watchdog.start()
    try:
        with torch.cuda.stream(compute):  # jobs follow the stream current at submit
            with cupy.cuda.ExternalStream(compute.cuda_stream):
                spin((1,), (1,), (np.uint64(flag.data_ptr()),))
            rig.engine.submit_load(2, list(range(8)), list(range(10, 18)), expect=sums)
            rig.engine.submit_store(3, list(range(10, 18)), list(range(20, 28)), sums=True)
        time.sleep(0.5)
        assert not rig.finished()  # both wait for the held compute stream
        assert not bool(torch.equal(rig.pool.slots[20:28], want))
    finally:
        flag.fill_(1)
        watchdog.cancel()
    assert rig.engine.wait(timeout=120)
    done = rig.finished()
    assert done[2].good == 8 and list(done[3].sums) == sums
    assert torch.equal(rig.rows.cpu()[10:18], want)
    assert torch.equal(rig.pool.slots[20:28], want)  # the store copied what the load landed


@gpu
def test_rows_of_whole_words_but_not_16_bytes_sum_and_check_word_by_word() -> None:
    """Rows of 1028 bytes (not whole 16-byte words): the kernels' word-by-word path."""
    from transfer.copy.base import Segment

    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (24, 1028), dtype=torch.uint8, generator=gen)
    gpu = data.cuda()
    host = torch.zeros(24, 1028, dtype=torch.uint8).pin_memory()
    engine = TransferEngine([Segment(gpu, host)])
    try:
        assert engine.can_sum
        assert engine.submit_store(1, list(range(24)), list(range(24)), sums=True)
        engine.wait()
        (stored,) = engine.get_finished()
        assert list(stored.sums) == to_unsigned(row_sums(data))
        host[9, 1027] ^= 0x80
        gpu.fill_(POISON)
        assert engine.submit_load(2, list(range(24)), list(range(23, -1, -1)),
                                  expect=stored.sums)
        engine.wait()
        (loaded,) = engine.get_finished()
        assert loaded.good == 9
        back = gpu.cpu()
        assert torch.equal(back[list(range(23, 14, -1))], data[:9])
        assert bool((back[:15] == POISON).all())
    finally:
        engine.close()


@gpu
def test_a_checked_load_whose_issue_fails_part_way_lands_nothing_wrong(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DMA of its third stage fails to issue (both buffers' DMAs and the first stage's
    kernels are queued by then): the job fails, what the kernels queued before the failure
    still reads the job's own ids (held by its completion), and no block outside the job's
    changes; the lane then loads correctly."""
    monkeypatch.setattr(base, "STAGE_BYTES", 2 * LAYOUT.block_bytes)
    assert rig.engine.submit_store(1, list(range(8)), list(range(8)), sums=True)
    rig.engine.wait()
    sums = list(rig.finished()[1].sums)
    want = rig.pool.slots[:8].clone()
    rig.cache.raw.fill_(POISON)
    lane = rig.engine._lanes[False]
    real, calls = lane._issue, []

    def failing(copy: object, stream: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: the third stage's DMA")
        real(copy, stream)

    monkeypatch.setattr(lane, "_issue", failing)
    dst = list(range(40, 48))
    rig.engine.submit_load(2, list(range(8)), dst, expect=sums)
    # New pinned buffers while the failed job's kernels may still run: none may reuse its ids.
    junk = [torch.full((len(dst),), 63, dtype=torch.int64).pin_memory() for _ in range(8)]
    assert rig.engine.wait(timeout=120)
    failed = rig.finished()[2]
    assert not failed.ok and failed.good is None and failed.nbytes == 0
    cache = rig.rows.cpu()
    others = sorted(set(range(64)) - set(dst))
    assert bool((cache[others] == POISON).all())  # block 63 above all
    landed = [i for i, b in enumerate(dst) if not bool((cache[b] == POISON).all())]
    assert landed in ([], [0, 1])  # at most the first stage's, and then exact
    for i in landed:
        assert torch.equal(cache[dst[i]], want[i])
    monkeypatch.setattr(lane, "_issue", real)
    rig.cache.raw.fill_(POISON)
    assert rig.engine.submit_load(3, list(range(8)), dst, expect=sums)
    assert rig.engine.wait(timeout=120) and rig.finished()[3].good == 8
    assert torch.equal(rig.rows.cpu()[dst], want)
    del junk
