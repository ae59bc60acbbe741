"""Copy backends on CPU: descriptors, row copies, lane order, failure propagation, the factory."""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from transfer.copy.base import RowCopy, Segment, ThreadBackend, ThreadCompletion
from transfer.copy.factory import make_backend

if TYPE_CHECKING:
    from transfer.copy.cuda import DmaBackend

TIMEOUT = 60.0


def strided_rows(num_rows: int, width: int, stride: int, offset: int = 0,
                 seed: int = 0) -> torch.Tensor:
    base = torch.empty(offset + num_rows * stride, dtype=torch.uint8)
    base.copy_(torch.randint(0, 256, base.shape, dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed)))
    return torch.as_strided(base, (num_rows, width), (stride, 1), offset)


def test_descriptors_address_every_row_of_every_pair() -> None:
    a_src, a_dst = strided_rows(6, 48, 64), strided_rows(5, 48, 128, offset=16)
    b_src, b_dst = strided_rows(6, 16, 80, offset=48), strided_rows(5, 16, 128)
    copy = RowCopy(3, ((a_src, a_dst), (b_src, b_dst)), np.array([5, 0, 2]), np.array([1, 4, 3]))
    srcs, dsts, sizes = copy.descriptors()
    want_src = [a_src[r].data_ptr() for r in (5, 0, 2)] + [b_src[r].data_ptr() for r in (5, 0, 2)]
    want_dst = [a_dst[r].data_ptr() for r in (1, 4, 3)] + [b_dst[r].data_ptr() for r in (1, 4, 3)]
    assert srcs.tolist() == want_src
    assert dsts.tolist() == want_dst
    assert sizes.tolist() == [48] * 3 + [16] * 3
    assert copy.nbytes == 3 * 64


def test_run_rows_copies_exactly_the_named_rows() -> None:
    src, dst = strided_rows(6, 40, 64, seed=1), strided_rows(5, 40, 100, offset=7, seed=2)
    storage = torch.as_strided(dst, (7 + 5 * 100,), (1,), 0)  # rows, padding and all
    want_storage = storage.clone()
    want = torch.as_strided(want_storage, dst.shape, dst.stride(), 7)
    want[0], want[4], want[2] = src[3], src[3], src[1]
    RowCopy(0, ((src, dst),), np.array([3, 3, 1]), np.array([0, 4, 2])).run_rows()
    assert torch.equal(storage, want_storage)


def test_lane_runs_copies_in_submission_order() -> None:
    src, dst = strided_rows(4, 32, 32, seed=3), torch.zeros(1, 32, dtype=torch.uint8)
    lane = ThreadBackend().new_lane()
    try:
        done = [lane.submit(RowCopy(i, ((src, dst),), np.array([i]), np.array([0])), [])
                for i in range(4)]
        assert all(d.wait(TIMEOUT) for d in done) and all(d.ok for d in done)
        assert torch.equal(dst[0], src[3])  # the last one wins
    finally:
        lane.close()


def test_gate_holds_a_copy_and_after_orders_across_lanes() -> None:
    release, entered = threading.Event(), threading.Event()

    def gate(job_id: int) -> None:
        if job_id == 1:
            entered.set()
            release.wait()

    backend = ThreadBackend(gate)
    a, b = backend.new_lane(), backend.new_lane()
    src, mid, dst = (strided_rows(2, 32, 32, seed=4), torch.zeros(2, 32, dtype=torch.uint8),
                     torch.zeros(2, 32, dtype=torch.uint8))
    try:
        first = a.submit(RowCopy(1, ((src, mid),), np.array([0, 1]), np.array([0, 1])), [])
        assert entered.wait(TIMEOUT)
        second = b.submit(RowCopy(2, ((mid, dst),), np.array([0, 1]), np.array([0, 1])), [first])
        other = b.submit(RowCopy(3, ((src, src),), np.array([0]), np.array([0])), [])
        assert not first.done() and not second.done() and not other.done()
        release.set()
        assert second.wait(TIMEOUT) and second.ok and other.wait(TIMEOUT)
        assert torch.equal(dst, src)
        assert second.seconds >= 0.0
    finally:
        release.set()
        a.close()
        b.close()


def test_a_copy_after_a_failed_one_moves_nothing() -> None:
    src, dst = strided_rows(1, 32, 32, seed=5), torch.zeros(1, 32, dtype=torch.uint8)
    failed = ThreadCompletion()
    failed.finish(False)
    lane = ThreadBackend().new_lane()
    try:
        done = lane.submit(RowCopy(1, ((src, dst),), np.array([0]), np.array([0])), [failed])
        assert done.wait(TIMEOUT) and not done.ok and done.seconds == 0.0
        assert torch.count_nonzero(dst) == 0
    finally:
        lane.close()


def test_a_raising_copy_is_reported_and_the_lane_survives() -> None:
    src, dst = strided_rows(2, 32, 32, seed=6), torch.zeros(2, 32, dtype=torch.uint8)
    lane = ThreadBackend().new_lane()
    try:
        bad = lane.submit(RowCopy(1, ((src, dst),), np.array([0]), np.array([7])), [])
        good = lane.submit(RowCopy(2, ((src, dst),), np.array([1]), np.array([1])), [])
        assert bad.wait(TIMEOUT) and not bad.ok
        assert good.wait(TIMEOUT) and good.ok and torch.equal(dst[1], src[1])
    finally:
        lane.close()


def test_thread_backend_refuses_device_tensors() -> None:
    meta = torch.empty(4, 32, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="segment 0 gpu tensor is on meta"):
        ThreadBackend().check([Segment(meta, torch.zeros(4, 32, dtype=torch.uint8))])


def test_make_backend() -> None:
    assert isinstance(make_backend("auto", "cpu"), ThreadBackend)
    assert isinstance(make_backend("thread", "cpu"), ThreadBackend)
    with pytest.raises(ValueError, match="unknown copy backend 'nvlink'"):
        make_backend("nvlink", "cpu")
    with pytest.raises(ValueError, match="'dma' needs a CUDA device"):
        make_backend("dma", "cpu")
    assert make_backend("auto", "cpu").mark_compute() is None


def test_importing_cuda_copy_needs_no_gpu() -> None:
    import transfer.copy.cuda as cc

    assert cc.DmaBackend.name == "dma" and cc.SmCopyBackend.name == "sm"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cc.DmaBackend("cpu")


class _FakeStream:
    cuda_stream = 0x77


def _host_copy_and_want() -> tuple[RowCopy, torch.Tensor, torch.Tensor]:
    src, dst = strided_rows(6, 48, 64, seed=7), strided_rows(5, 48, 96, offset=32, seed=8)
    storage = torch.as_strided(dst, (32 + 5 * 96,), (1,), 0)
    want_storage = storage.clone()
    torch.as_strided(want_storage, dst.shape, dst.stride(), 32)[[4, 0]] = src[[1, 5]]
    return RowCopy(1, ((src, dst),), np.array([1, 5]), np.array([4, 0])), storage, want_storage


def _fake_driver_call(calls: list[tuple], fail_at: int | None = None) -> object:
    """A stand-in for the driver's cuMemcpyBatchAsync: it reads the descriptor arrays at the
    addresses it is given, copies host memory and records its other arguments; the call numbered
    `fail_at` (from 0) returns an error instead."""

    def array(address: int, count: int) -> list[int]:
        return list((ctypes.c_int64 * count).from_address(address))

    def call(dsts: int, srcs: int, sizes: int, count: int, attrs: object, attrs_index: object,
             num_attrs: int, stream: int) -> int:
        got = attrs._obj  # type: ignore[attr-defined]  # ctypes.byref's target
        calls.append((count, (got.src_access_order, got.flags), attrs_index._obj.value,  # type: ignore[attr-defined]
                      num_attrs, stream))
        if len(calls) - 1 == fail_at:
            return 1  # CUDA_ERROR_INVALID_VALUE
        for d, s, n in zip(array(dsts, count), array(srcs, count), array(sizes, count),
                           strict=True):
            ctypes.memmove(d, s, n)
        return 0

    return call


def _dma_backend(calls: list[tuple], fail_at: int | None = None) -> DmaBackend:
    from transfer.copy.cuda import DmaBackend
    from transfer.copy.cuda_driver import (
        PREFER_OVERLAP_WITH_COMPUTE,
        SRC_ORDER_STREAM,
        BatchCopy,
        MemcpyAttributes,
    )

    backend = object.__new__(DmaBackend)
    attrs = MemcpyAttributes(src_access_order=SRC_ORDER_STREAM, flags=PREFER_OVERLAP_WITH_COMPUTE)
    backend._batch = BatchCopy(attrs, _fake_driver_call(calls, fail_at))
    return backend


def test_dma_issue_passes_the_cuda13_batch_arguments_in_order() -> None:
    """DmaBackend.issue against a stand-in driver call that copies host memory: argument order,
    one attribute set (stream order, prefer the copy engines) for every copy."""
    calls: list[tuple] = []
    copy, storage, want = _host_copy_and_want()
    _dma_backend(calls).issue(copy, _FakeStream())
    assert calls == [(2, (1, 1), 0, 1, 0x77)]
    assert torch.equal(storage, want)


def test_a_cuda12_driver_batch_call_gets_its_fail_index_before_the_stream() -> None:
    """Drivers before CUDA 13 export only cuMemcpyBatchAsync, which takes a failIdx pointer
    before the stream; the wrapper puts it there and keeps the CUDA 13 order for callers."""
    from types import SimpleNamespace

    from transfer.copy.cuda_driver import driver_batch_call

    seen: list[tuple] = []

    def cuda12_call(*args: object) -> int:
        seen.append(args)
        return 0

    call = driver_batch_call(SimpleNamespace(cuMemcpyBatchAsync=cuda12_call))  # type: ignore[arg-type]
    assert call(1, 2, 3, 4, 5, 6, 7, 0x77) == 0
    (args,) = seen
    assert args[:7] == (1, 2, 3, 4, 5, 6, 7) and args[8] == 0x77
    assert args[7]._obj.value == 0  # type: ignore[attr-defined]  # byref(c_size_t)


def _many_rows_copy(rows: int) -> tuple[RowCopy, list[torch.Tensor], list[torch.Tensor]]:
    """Two segments, `rows` rows each, shuffled: the copy, its destinations and what they want."""
    rng = np.random.default_rng(rows)
    src_rows, dst_rows = rng.permutation(rows), rng.permutation(rows)
    pairs, dsts, wants = [], [], []
    for k, width in enumerate((24, 40)):
        src = strided_rows(rows, width, 64, seed=k)
        dst = torch.full((rows, width), 0xA5, dtype=torch.uint8)  # poisoned
        want = dst.clone()
        want[dst_rows] = src[src_rows]
        pairs.append((src, dst))
        dsts.append(dst)
        wants.append(want)
    return RowCopy(2, tuple(pairs), src_rows, dst_rows), dsts, wants


def test_dma_issues_a_large_job_in_growing_batches_that_cover_every_copy_once() -> None:
    """The engines start on a first small batch while the host issues the rest."""
    from transfer.copy.cuda import batch_slices

    assert batch_slices(0) == []
    assert batch_slices(32) == [slice(0, 32)]
    assert batch_slices(33) == [slice(0, 32), slice(32, 33)]
    calls: list[tuple] = []
    copy, got, want = _many_rows_copy(350)  # 700 copies: 32 + 64 + 128 + 256 + 220
    _dma_backend(calls).issue(copy, _FakeStream())
    assert [call[0] for call in calls] == [32, 64, 128, 256, 220]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_dma_batch_refused_part_way_raises_naming_the_copies() -> None:
    """The lane reports the job failed; the batches before the refused one were queued."""
    calls: list[tuple] = []
    copy, got, _ = _many_rows_copy(100)
    with pytest.raises(RuntimeError, match="copies 32-95 of 200 failed: CUresult 1"):
        _dma_backend(calls, fail_at=1).issue(copy, _FakeStream())
    assert [call[0] for call in calls] == [32, 64]
    # The first batch (segment 0's first 32 row copies) landed; nothing after it did.
    done = torch.zeros(100, dtype=torch.bool)
    done[copy.dst_rows[:32]] = True
    assert torch.equal(got[0][copy.dst_rows[:32]], copy.pairs[0][0][copy.src_rows[:32]])
    assert (got[0][~done] == 0xA5).all() and (got[1] == 0xA5).all()


def test_dma_loop_passes_dst_src_size_kind_stream() -> None:
    from transfer.copy.cuda import DmaBackend

    kinds = []

    def memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        kinds.append((kind, stream))
        ctypes.memmove(dst, src, size)

    backend = object.__new__(DmaBackend)
    backend._batch, backend._memcpy_async = None, memcpy_async
    copy, storage, want = _host_copy_and_want()
    backend.issue(copy, _FakeStream())
    assert kinds == [(4, 0x77)] * 2  # cudaMemcpyDefault
    assert torch.equal(storage, want)


class _Recorder:
    """A stand-in backend that records which pairs (by row width) each issued copy carried."""

    def __init__(self) -> None:
        self.issued: list[tuple[int, ...]] = []

    def issue(self, copy: RowCopy, stream: object) -> None:
        self.issued.append(tuple(int(src.shape[1]) for src, _ in copy.pairs))


def _auto_backend(pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                  with_sm: bool = True) -> tuple[object, _Recorder, _Recorder]:
    """An AutoCudaBackend checked against the segments of `pairs` (load or store pairs), with
    recorders for its DMA and SM backends."""
    from transfer.copy.cuda import AutoCudaBackend, sm_load_rows

    backend = object.__new__(AutoCudaBackend)
    backend.dma, sm = _Recorder(), _Recorder()
    backend.sm, backend.sm_load_copies = (sm if with_sm else None), 0
    segments = [Segment(gpu=b, host=a) if a.device.type == "cpu" else Segment(gpu=a, host=b)
                for a, b in pairs]
    backend._sm_rows = sm_load_rows(segments) if with_sm else frozenset()
    return backend, backend.dma, sm


def _pairs(widths: tuple[int, ...], load: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    # Device tensors stand for GPU rows: "meta" is a non-CPU device that allocates nothing.
    host = [torch.empty(4, w, dtype=torch.uint8) for w in widths]
    gpu = [torch.empty(4, w, dtype=torch.uint8, device="meta") for w in widths]
    return tuple(zip(host, gpu, strict=True) if load else zip(gpu, host, strict=True))


@pytest.mark.parametrize(("widths", "rows", "load", "want_sm", "want_dma"), [
    # vLLM 0.32's rule: loads of pages under 28 KiB, at least 16 copies, go to the SMs.
    ((8 << 10,) * 4, 5, True, [(8 << 10,) * 4], []),
    ((28 << 10,) * 4, 4, True, [], [(28 << 10,) * 4]),
    ((8 << 10,) * 3, 5, True, [], [(8 << 10,) * 3]),  # 15 copies: not worth a launch
    ((8 << 10,) * 4, 4, True, [(8 << 10,) * 4], []),  # 16 copies
    (((8 << 10) + 8,) * 4, 4, True, [], [((8 << 10) + 8,) * 4]),  # not 16-byte wide: DMA
    ((8 << 10,) * 4, 4, False, [], [(8 << 10,) * 4]),  # stores always by DMA
    # A job over segments of both kinds splits: small pages on the SMs, the rest by DMA.
    ((8 << 10, 64 << 10) * 2, 8, True, [(8 << 10,) * 2], [(64 << 10,) * 2]),
])
def test_auto_loads_small_pages_on_the_sms_and_everything_else_by_dma(
        widths: tuple[int, ...], rows: int, load: bool, want_sm: list, want_dma: list) -> None:
    pairs = _pairs(widths, load)
    backend, dma, sm = _auto_backend(pairs)
    copy = RowCopy(3, pairs, np.arange(rows), np.arange(rows))
    backend.issue(copy, _FakeStream())
    assert sm.issued == want_sm and dma.issued == want_dma
    assert backend.sm_load_copies == rows * sum(len(p) for p in want_sm)


def test_auto_loads_rows_at_unaligned_addresses_or_strides_by_dma() -> None:
    """The kernel's wide path needs 16-byte aligned rows; anything else goes by DMA."""
    base = torch.empty(4 * (8 << 10) + 64, dtype=torch.uint8)
    host = [torch.as_strided(base, (4, 8 << 10), (8 << 10, 1), 8),  # address off by 8
            torch.as_strided(base, (2, 8 << 10), ((8 << 10) + 8, 1), 0)]  # stride off by 8
    gpu = torch.empty(4, 8 << 10, dtype=torch.uint8, device="meta")
    issued = []
    for h in host:
        pairs = ((h, gpu[: len(h)]),) * 8
        backend, dma, sm = _auto_backend(pairs)
        backend.issue(RowCopy(3, pairs, np.arange(2), np.arange(2)), _FakeStream())
        issued += [sm.issued, len(dma.issued)]
    assert issued == [[], 1, [], 1]


def test_batch_copy_refuses_arrays_the_driver_cannot_read_in_place() -> None:
    from transfer.copy.cuda_driver import BatchCopy, MemcpyAttributes

    calls: list[tuple] = []
    batch = BatchCopy(MemcpyAttributes(), _fake_driver_call(calls))
    good = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="contiguous int64, got int32"):
        batch(good, good, good.astype(np.int32), 0x77)
    with pytest.raises(ValueError, match=r"contiguous: False"):
        batch(np.zeros(8, dtype=np.int64)[::2], good, good, 0x77)
    assert calls == []


def test_auto_without_a_mapped_pool_loads_small_pages_by_dma() -> None:
    pairs = _pairs((8 << 10,) * 4, True)
    backend, dma, _ = _auto_backend(pairs, with_sm=False)
    backend.issue(RowCopy(3, pairs, np.arange(4), np.arange(4)), _FakeStream())
    assert dma.issued == [(8 << 10,) * 4] and backend.sm_load_copies == 0
