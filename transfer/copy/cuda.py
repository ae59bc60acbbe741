"""CUDA copy backends: a lane is a dedicated non-blocking stream (transfer/copy/cuda_lane.py);
events order and time the jobs.

Three ways to issue one job's copies onto a lane's stream:
- `DmaBackend`: the copy engines. The driver's cuMemcpyBatchAsync (CUDA >= 12.8) with the
  descriptor arrays, in a few growing batches per job, sources read in stream order; where the
  batch call is missing or refused, one cupy memcpyAsync per copy.
- `SmCopyBackend`: the SMs. A cupy RawKernel gathers/scatters rows through mapped pinned host
  memory, on every SM or on a few (`sms`).
- `AutoCudaBackend` ("auto" on CUDA): DMA, except loads of pages under 28 KiB, which 12 SMs copy,
  as vLLM 0.32 does: per-copy DMA overhead leaves such pages at 0.07-0.39 of the PCIe ceiling
  (4-16 KiB, H200).
"""

from __future__ import annotations

import functools
import logging
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from transfer.copy.base import Completion, CopyBackend, Lane, RowCopy, Segment
from transfer.copy.cuda_driver import (
    PREFER_OVERLAP_WITH_COMPUTE,
    SRC_ORDER_STREAM,
    BatchCopy,
    MemcpyAttributes,
)
from transfer.copy.cuda_lane import CudaCompletion, StreamLane, check, runtime

log = logging.getLogger(__name__)

# A job's copies go to the copy engines in batches of growing size: 32 copies, then twice as many
# each time. The engines idle until a batch call returns, and one call for 1024 copies takes ~1 ms
# of host time: 3% of a 2 GiB job at 2 MiB blocks, 13% at 256 KiB (H200, 2026-11-22). In batches,
# the engines copy one while the host issues the next; doubling (not 4x) keeps each batch's copy
# time ahead of the next one's issue time for small blocks on a slower host.
_FIRST_BATCH = 32
_BATCH_GROWTH = 2
# cupy.cuda.runtime's value of cudaMemcpyDefault: the direction follows from the addresses (UVA).
_MEMCPY_DEFAULT = 4


class _CudaBackend(CopyBackend):
    def __init__(self, device: str | torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a CUDA copy backend needs a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())

    def check(self, segments: Sequence[Segment]) -> None:
        for i, seg in enumerate(segments):
            if seg.gpu.device != self.device:
                raise ValueError(f"segment {i} GPU tensor is on {seg.gpu.device}; this "
                                 f"{self.name} backend copies to and from {self.device}")
            if seg.host.device.type != "cpu":
                raise ValueError(f"segment {i} host tensor is on {seg.host.device}, not the host")

    def new_lane(self) -> Lane:
        return StreamLane(self.device, self.issue)

    @functools.cached_property
    def sums_rows(self) -> bool:
        """Whether lanes here take row sums (transfer/copy/cuda_sums.py: cupy and NVRTC)."""
        from transfer.copy import cuda_sums

        return cuda_sums.available(self.device.index)

    def mark_compute(self) -> Completion:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaCompletion(None, event)

    @abstractmethod
    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        """Queue the copies of `copy` on `stream` (the lane has already ordered it)."""


class DmaBackend(_CudaBackend):
    """Copy engines: cuMemcpyBatchAsync in growing batches; cupy memcpyAsync per copy as fallback.

    `batched=False` forces the per-copy loop (to measure the batch against it). `self.batched`
    says which one runs: the batch call is probed once and dropped if the driver refuses it.
    """

    name = "dma"

    def __init__(self, device: str | torch.device, batched: bool = True) -> None:
        super().__init__(device)
        self._batch: BatchCopy | None = None
        if batched:
            self._batch = self._probe_batch()
        self.batched = self._batch is not None
        if not self.batched:
            import cupy

            self._memcpy_async = cupy.cuda.runtime.memcpyAsync

    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        srcs, dsts, sizes = copy.descriptors()
        count = len(sizes)
        if count == 0:
            return
        handle = stream.cuda_stream
        if self._batch is not None:
            for part in batch_slices(count):
                self._batch(dsts[part], srcs[part], sizes[part], handle,
                            f"copies {part.start}-{part.stop - 1} of {count}")
            return
        for src, dst, size in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
            self._memcpy_async(dst, src, size, _MEMCPY_DEFAULT, handle)

    def _probe_batch(self) -> BatchCopy | None:
        """The batch call when cuMemcpyBatchAsync works here (checked with one copy)."""
        try:
            # Sources are read in stream order: a store reads what the compute stream wrote.
            # Ask for the copy engines, not SM copies, so compute keeps its SMs.
            batch = BatchCopy(MemcpyAttributes(src_access_order=SRC_ORDER_STREAM,
                                               flags=PREFER_OVERLAP_WITH_COMPUTE))
            with torch.cuda.device(self.device):
                src = torch.arange(256, dtype=torch.int32, device=self.device).view(torch.uint8)
                dst = torch.zeros_like(src)
                lane = StreamLane(self.device, self.issue)
                try:
                    lane.stream.wait_stream(torch.cuda.current_stream(self.device))
                    dsts, srcs, sizes = (np.array([value], dtype=np.int64) for value in
                                         (dst.data_ptr(), src.data_ptr(), src.numel()))
                    batch(dsts, srcs, sizes, lane.stream.cuda_stream, "the probe copy")
                    lane.stream.synchronize()
                finally:
                    lane.close()
            if not torch.equal(src, dst):
                raise RuntimeError("the probe copy did not copy")
        except Exception as exc:  # no libcuda symbol (driver before CUDA 12.8), refused call
            log.warning("cuMemcpyBatchAsync unavailable (%s); using one memcpyAsync per copy", exc)
            return None
        return batch


def batch_slices(count: int) -> list[slice]:
    """The consecutive batches `count` copies are issued in: _FIRST_BATCH, then growing."""
    parts, start, size = [], 0, _FIRST_BATCH
    while start < count:
        parts.append(slice(start, min(start + size, count)))
        start += size
        size *= _BATCH_GROWTH
    return parts


_KERNEL = r"""
#define TEAM 256
extern "C" __global__ void kv_copy_rows(const unsigned long long table_addr, const long long count)
{
    // table: count source addresses, then count destination addresses, then count sizes.
    // A team of TEAM threads copies one row at a time; a block is blockDim.x / TEAM teams.
    const unsigned long long* table = (const unsigned long long*)table_addr;
    const long long teams = blockDim.x / TEAM, lane = threadIdx.x % TEAM;
    for (long long i = blockIdx.x * teams + threadIdx.x / TEAM; i < count; i += gridDim.x * teams) {
        const unsigned long long src = table[i], dst = table[count + i], n = table[2 * count + i];
        if (((src | dst | n) & 15ULL) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            const unsigned long long words = n >> 4, step = TEAM;
            unsigned long long j = lane;
            // Four loads in flight per thread before the stores: PCIe reads are latency-bound.
            for (; j + 3 * step < words; j += 4 * step) {
                const uint4 a = s[j], b = s[j + step], c = s[j + 2 * step], e = s[j + 3 * step];
                d[j] = a; d[j + step] = b; d[j + 2 * step] = c; d[j + 3 * step] = e;
            }
            for (; j < words; j += step) d[j] = s[j];
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long j = lane; j < n; j += TEAM) d[j] = s[j];
        }
    }
}
"""
_TEAM = 256  # the kernel's TEAM: threads per row copy
_MAX_GRID = 65535
# With `sms`: 4 teams per block, so 4 rows per SM are in flight (a row under 28 KiB is at most
# 1792 16-byte words: one team of 256 threads already covers it in 7 steps).
_FEW_SMS_THREADS = 4 * _TEAM


class SmCopyBackend(_CudaBackend):
    """The SMs copy, reading/writing pinned host memory mapped into the GPU's address space: one
    thread block per row copy, or, with `sms`, that many thread blocks taking row copies in turn
    (compute keeps the other SMs). Needs a pinned pool mapped at its host addresses (x86 with
    cudaDevAttrCanUseHostPointerForRegisteredMem)."""

    name = "sm"

    def __init__(self, device: str | torch.device, sms: int | None = None) -> None:
        super().__init__(device)
        if sms is not None and sms <= 0:
            raise ValueError(f"sms must be positive, got {sms}")
        self._grid, self._threads = ((_MAX_GRID, _TEAM) if sms is None
                                     else (sms, _FEW_SMS_THREADS))
        import cupy

        self._cupy = cupy
        self._kernel = cupy.RawKernel(_KERNEL, "kv_copy_rows")

    def check(self, segments: Sequence[Segment]) -> None:
        super().check(segments)
        rt = runtime()
        err, same_address = rt.cudaDeviceGetAttribute(
            rt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem, self.device.index)
        check(err, "cudaDeviceGetAttribute")
        if not same_address:
            raise ValueError(f"{self.device} cannot use host pointers of registered memory; "
                             f"the SM copy needs them (use the 'dma' backend)")
        host_type = rt.cudaMemoryType.cudaMemoryTypeHost
        for i, seg in enumerate(segments):
            for row in {0, seg.host.shape[0] - 1}:
                ptr = seg.host[row].data_ptr()
                err, attrs = rt.cudaPointerGetAttributes(ptr)
                if (err != rt.cudaError_t.cudaSuccess or attrs.type != host_type
                        or int(attrs.devicePointer or 0) != ptr):
                    raise ValueError(f"segment {i} host row {row} at {ptr:#x} is not pinned memory "
                                     f"the GPU reads at its own address ({err}); the SM copy "
                                     f"needs a pinned pool")
        # Compiled now (NVRTC), not on the first job: a failure shows here, not in a step.
        with self._cupy.cuda.Device(self.device.index):
            self._kernel.compile()

    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        srcs, dsts, sizes = copy.descriptors()
        count = len(sizes)
        if count == 0:
            return
        # The table goes pinned -> device on the lane's stream; torch keeps the pinned block alive
        # until that copy ran, and the device block is only reused by later work on this stream.
        table = torch.from_numpy(np.concatenate([srcs, dsts, sizes])).pin_memory()
        with torch.cuda.stream(stream):
            dev_table = table.to(self.device, non_blocking=True)
        with self._cupy.cuda.Device(self.device.index), \
                self._cupy.cuda.ExternalStream(stream.cuda_stream, self.device.index):
            teams = self._threads // _TEAM
            self._kernel((min(-(-count // teams), self._grid),), (self._threads,),
                         (np.uint64(dev_table.data_ptr()), np.int64(count)))


SM_LOAD_MAX_PAGE = 28 * 1024  # vLLM 0.32's THRESHOLD_BYTES: smaller pages load on the SMs
SM_LOAD_MIN_COPIES = 16  # vLLM's MIN_N: fewer copies are not worth a kernel launch
SM_LOAD_SMS = 12  # vLLM's Triton load kernel uses 12 SMs too


class AutoCudaBackend(_CudaBackend):
    """DMA, except loads of pages under 28 KiB: 12 SMs copy those (see module doc).

    Loads only: they are on a request's critical path, while stores run behind compute on every
    step. Rows must be 16-byte aligned (address, stride, width) for the kernel's wide path; others
    go by DMA. Where the SM copy cannot run (pool not pinned or not mapped at its host addresses,
    no cupy, the kernel does not compile) everything goes by DMA. Figures: docs/benchmarks.md.
    """

    name = "dma+sm"

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(device)
        self.dma = DmaBackend(self.device)
        self.sm: SmCopyBackend | None = None
        self._sm_rows: frozenset[int] = frozenset()  # id() of the host rows the SMs load
        self.sm_load_copies = 0  # row copies the SMs have loaded

    def check(self, segments: Sequence[Segment]) -> None:
        self.dma.check(segments)
        rows = sm_load_rows(segments)
        if not rows:
            return
        try:
            sm = SmCopyBackend(self.device, sms=SM_LOAD_SMS)
            sm.check(segments)
        except Exception as exc:  # no cupy, pool not mapped, NVRTC failure
            log.warning("loads of pages under %d KiB go by DMA, not on the SMs: %s",
                        SM_LOAD_MAX_PAGE >> 10, exc)
            return
        self.sm, self._sm_rows = sm, rows

    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        if self.sm is not None and copy.is_load:
            small: list[tuple[torch.Tensor, torch.Tensor]] = []
            rest: list[tuple[torch.Tensor, torch.Tensor]] = []
            for pair in copy.pairs:  # the engine's pairs hold the checked segments' rows
                (small if id(pair[0]) in self._sm_rows else rest).append(pair)
            copies = len(small) * len(copy.src_rows)
            if copies >= SM_LOAD_MIN_COPIES:
                self.sm.issue(replace(copy, pairs=tuple(small)), stream)
                self.sm_load_copies += copies
                if rest:
                    self.dma.issue(replace(copy, pairs=tuple(rest)), stream)
                return
        self.dma.issue(copy, stream)


def sm_load_rows(segments: Sequence[Segment]) -> frozenset[int]:
    """id() of each segment's host rows whose loads the SMs take: rows under SM_LOAD_MAX_PAGE,
    16-byte aligned in address, stride and width (the kernel's wide path). Decided once, at
    check: a segment's rows never change."""
    return frozenset(
        id(seg.host) for seg in segments
        if seg.nbytes < SM_LOAD_MAX_PAGE and not (
            (seg.nbytes | seg.host.data_ptr() | seg.gpu.data_ptr() | seg.host.stride(0)
             | seg.gpu.stride(0)) & 15))
