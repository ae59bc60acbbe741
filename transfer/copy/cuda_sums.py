"""Row sums on a CUDA lane (transfer/copy/row_sums.py): a store's sums, a checked load's checks.

Each lane that sums gets a second stream of its own, so its copies never wait for a sum:
- a store's rows are summed on it once the lane has copied them (the job ends there);
- a checked load is DMA'd chunk by chunk into STAGE_BUFFERS staging buffers of STAGE_BYTES
  (transfer.copy.base) on the lane's stream; the second stream sums each chunk as it lands and
  copies on into the cache the rows whose sums, and every earlier row's in the job, match,
  while the lane fills the next buffer. A buffer is filled again only once its rows went on.
  The host queues the whole job at submit and never waits: the good count comes back through
  pinned memory by the job's end event.

Per chunk that is two kernels of our own (`_SOURCE`, cupy RawKernels): the host issues a chunk in
~0.1 ms; the same steps as torch ops cost ~27 us each, ~17 a chunk, so a 2 GiB load's submit
blocked its caller for 20-40 ms (H200). The kernels compute exactly `row_sums` (the torch code
CPU lanes run), which the GPU tests hold them to. Nothing here is imported without CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import torch

from transfer.copy import base
from transfer.copy.base import RowCopy
from transfer.copy.row_sums import coefficient_array

Issue = Callable[[RowCopy, torch.cuda.ExternalStream], None]

_SOURCE = r"""
// Row j of `count`: its 32-bit words at base + (ids ? ids[j] : j) * stride. out[j] += its sum
// over this block's share of the words (out zeroed first; sums wrap mod 2^64 in any order).
extern "C" __global__ void kv_row_sums(const unsigned char* base, const long long stride,
                                       const long long* ids, const int words,
                                       const unsigned long long* coef, unsigned long long* out) {
    const int j = blockIdx.x;
    const long long row = ids ? ids[j] : j;
    const int* w = (const int*)(base + row * stride);
    unsigned long long acc = 0;
    for (int k = blockIdx.y * blockDim.x + threadIdx.x; k < words; k += gridDim.y * blockDim.x)
        acc += (unsigned long long)(long long)w[k] * coef[k];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    __shared__ unsigned long long part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) atomicAdd(out + j, acc);
    }
}

// Row j of a chunk is the job's row first + j: it goes from the stage to dst row ids[first + j]
// only if the sums of the job's rows 0 .. first + j all equal what was expected.
extern "C" __global__ void kv_checked_copy(const unsigned char* stage, const long long stage_stride,
                                           unsigned char* dst, const long long dst_stride,
                                           const long long* ids, const long long first,
                                           const unsigned long long* sums,
                                           const unsigned long long* expect, const int words) {
    const long long g = first + blockIdx.x;
    int bad = 0;
    for (long long i = threadIdx.x; i <= g; i += blockDim.x) bad |= sums[i] != expect[i];
    if (__syncthreads_or(bad)) return;
    const int* src = (const int*)(stage + blockIdx.x * stage_stride);
    int* out = (int*)(dst + ids[g] * dst_stride);
    for (int k = blockIdx.y * blockDim.x + threadIdx.x; k < words; k += gridDim.y * blockDim.x)
        out[k] = src[k];
}
"""
_THREADS = 256
_BLOCKS = 528  # thread blocks a kernel aims for (4 per SM of an H100/H200)


class LaneSums:
    """The summing side of one lane on `device`, on `stream` (see module doc)."""

    def __init__(self, device: torch.device, stream: torch.cuda.ExternalStream) -> None:
        import cupy

        self.device, self.stream = device, stream
        self._cupy: ModuleType = cupy
        module = cupy.RawModule(code=_SOURCE)
        self._sum_kernel = module.get_function("kv_row_sums")
        self._copy_kernel = module.get_function("kv_checked_copy")
        # Coefficients per row width, copied on this stream: every kernel that reads them here
        # runs after the copy.
        self._coefficients: dict[int, torch.Tensor] = {}
        self._stages: list[torch.Tensor] = []
        self._freed: list[torch.cuda.Event | None] = []  # each buffer's last use

    def issue_store(self, copy: RowCopy, lane: torch.cuda.ExternalStream,
                    end: torch.cuda.Event) -> torch.Tensor:
        """Sum the store's GPU rows once `lane` copied them; records `end` after the sums.
        Returns the pinned int64 sums, valid once `end` is."""
        rows = copy.pairs[0][0]
        n = len(copy.src_rows)
        copied = torch.cuda.Event()
        copied.record(lane)
        out = torch.empty(n, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            ids = _to_device(copy.src_rows, self.device)
            sums = torch.zeros(n, dtype=torch.int64, device=self.device)
            self._sum(rows.data_ptr(), rows.stride(0), ids.data_ptr(), n, int(rows.shape[1]),
                      sums.data_ptr())
            out.copy_(sums, non_blocking=True)
            end.record(self.stream)
        return out

    def issue_load(self, copy: RowCopy, lane: torch.cuda.ExternalStream, issue: Issue,
                   end: torch.cuda.Event) -> torch.Tensor:
        """Queue a checked load (see module doc); records `end` after its last rows went on.
        Returns the pinned int64 [good rows], valid once `end` is."""
        (host, gpu), = copy.pairs
        nbytes, n = int(host.shape[1]), len(copy.src_rows)
        per = max(1, base.STAGE_BYTES // nbytes)
        self._ensure_stages(per, nbytes)
        out = torch.empty(1, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.stream):
            expect = _to_device(copy.expect, self.device)
            ids = _to_device(copy.dst_rows, self.device)
            sums = torch.zeros(n, dtype=torch.int64, device=self.device)
        for k, start in enumerate(range(0, n, per)):
            rows = min(per, n - start)
            buf = k % len(self._stages)
            stage = self._stages[buf]
            if self._freed[buf] is not None:
                lane.wait_event(self._freed[buf])
            issue(RowCopy(copy.job_id, ((host, stage),), copy.src_rows[start:start + rows],
                          np.arange(rows, dtype=np.int64)), lane)
            landed = torch.cuda.Event()
            landed.record(lane)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(landed)
                self._sum(stage.data_ptr(), nbytes, 0, rows, nbytes,
                          sums.data_ptr() + 8 * start)
                self._copy(stage, gpu, ids, start, rows, sums, expect)
                freed = torch.cuda.Event()
                freed.record(self.stream)
            self._freed[buf] = freed
        with torch.cuda.stream(self.stream):
            good = (sums == expect).to(torch.int64).cumprod_(0).sum()
            out.copy_(good.view(1), non_blocking=True)
            end.record(self.stream)
        return out

    def _sum(self, base_ptr: int, stride: int, ids_ptr: int, rows: int, nbytes: int,
             out_ptr: int) -> None:
        words = nbytes // 4
        splits = max(1, min(-(-_BLOCKS // rows), -(-words // _THREADS)))
        coef = self._coefficients.get(words)
        if coef is None:
            with torch.cuda.stream(self.stream):
                coef = self._coefficients[words] = _to_device(coefficient_array(words),
                                                              self.device)
        with self._launching():
            self._sum_kernel((rows, splits), (_THREADS,), (
                np.uint64(base_ptr), np.int64(stride), np.uint64(ids_ptr), np.int32(words),
                np.uint64(coef.data_ptr()), np.uint64(out_ptr)))

    def _copy(self, stage: torch.Tensor, gpu: torch.Tensor, ids: torch.Tensor, first: int,
              rows: int, sums: torch.Tensor, expect: torch.Tensor) -> None:
        words = int(stage.shape[1]) // 4
        splits = max(1, min(-(-_BLOCKS // rows), -(-words // _THREADS)))
        with self._launching():
            self._copy_kernel((rows, splits), (_THREADS,), (
                np.uint64(stage.data_ptr()), np.int64(stage.stride(0)), np.uint64(gpu.data_ptr()),
                np.int64(gpu.stride(0)), np.uint64(ids.data_ptr()), np.int64(first),
                np.uint64(sums.data_ptr()), np.uint64(expect.data_ptr()), np.int32(words)))

    @contextlib.contextmanager
    def _launching(self) -> Iterator[None]:
        with self._cupy.cuda.Device(self.device.index), \
                self._cupy.cuda.ExternalStream(self.stream.cuda_stream, self.device.index):
            yield

    def _ensure_stages(self, rows: int, nbytes: int) -> None:
        if self._stages and tuple(self._stages[0].shape) == (rows, nbytes):
            return
        if self._stages:  # rows of another size (not within one engine): the old buffers'
            torch.cuda.synchronize(self.device)  # work finishes first
        self._stages = [torch.empty(rows, nbytes, dtype=torch.uint8, device=self.device)
                        for _ in range(base.STAGE_BUFFERS)]
        self._freed = [None] * base.STAGE_BUFFERS


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 array to `device`, queued on the current stream (torch keeps the pinned copy
    alive until the transfer ran)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).pin_memory().to(
        device, non_blocking=True)
