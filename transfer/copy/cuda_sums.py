"""Row sums on a CUDA lane (transfer/copy/row_sums.py): a store's sums, a checked load's checks.

Each lane that sums gets a second stream of its own, so its copies never wait for a sum:
- a store's rows are summed on it while the lane copies them (both read the same GPU rows,
  which nothing writes before the job ends), and the job ends once both are done (summed after
  the copies, a 640 KiB x 410 job took 0.25-0.3 ms longer than without sums on an H200;
  beside them, 0.14 ms);
- a checked load is DMA'd chunk by chunk into STAGE_BUFFERS staging buffers of STAGE_BYTES
  (transfer.copy.base) on the lane's stream; the second stream sums each chunk as it lands and
  copies on into the cache the rows whose sums, and every earlier row's in the job, match,
  while the lane fills the next buffer. A buffer is filled again only once its rows went on.
  The host queues the whole job at submit and never waits: the good count comes back through
  pinned memory by the job's end event. Every buffer's first DMA is queued before the rest of
  the host's work for the job, and the job's last chunks halve in size (`_chunks`), so the
  copy engine starts at once and little is left to sum and copy on after it stops.

Per chunk that is a DMA and three small kernels of our own (`_SOURCE`, a cupy RawModule), about
0.1 ms of host time: the same steps as torch ops cost ~27 us each, ~17 a chunk, so a 2 GiB
load's submit blocked its caller for 20-40 ms (H200). The kernels compute exactly `row_sums`
(the torch code CPU lanes run), which the GPU tests hold them to. Nothing here is imported
without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transfer.copy import base
from transfer.copy.base import RowCopy
from transfer.copy.row_sums import coefficient_array

Issue = Callable[[RowCopy, torch.cuda.ExternalStream], None]
log = logging.getLogger(__name__)

_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

// Row j of `count` (blockIdx.x): its 32-bit words at base + (ids ? ids[j] : j) * stride; each
// block sums its share of the words into partial[j * gridDim.y + blockIdx.y] (mod 2^64).
// quads: the row is read 4 words (16 bytes) at a time (every row 16-byte aligned).
extern "C" __global__ void kv_row_sums(const unsigned char* base, const long long stride,
                                       const long long* ids, const int words, const int quads,
                                       const unsigned long long* coef,
                                       unsigned long long* partial) {
    const int j = blockIdx.x;
    const long long row = ids ? ids[j] : j;
    const int* w = (const int*)(base + row * stride);
    const int step = gridDim.y * blockDim.x;
    unsigned long long acc = 0;
    if (quads) {
        const int4* w4 = (const int4*)w;
        for (int q = blockIdx.y * blockDim.x + threadIdx.x; q < words / 4; q += step) {
            const int4 v = w4[q];
            const unsigned long long* c = coef + 4 * q;
            acc += (u64)(i64)v.x * c[0] + (u64)(i64)v.y * c[1] + (u64)(i64)v.z * c[2]
                 + (u64)(i64)v.w * c[3];
        }
    } else {
        for (int k = blockIdx.y * blockDim.x + threadIdx.x; k < words; k += step)
            acc += (unsigned long long)(long long)w[k] * coef[k];
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    __shared__ unsigned long long part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) partial[j * gridDim.y + blockIdx.y] = acc;
    }
}

// Row j < count: its sum from `splits` partials into out[j]; with `expect` (the job's row
// first + j expects expect[j]), a row that differs lowers *first_bad to its job row instead.
// expect and out may be pinned host memory: read and written in place.
extern "C" __global__ void kv_finish_sums(const unsigned long long* partial, const int splits,
                                          const int count, unsigned long long* out,
                                          const unsigned long long* expect,
                                          const long long first, long long* first_bad) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    unsigned long long sum = 0;
    for (int y = 0; y < splits; y++) sum += partial[j * splits + y];
    if (!expect) out[j] = sum;
    else if (sum != expect[j]) atomicMin((unsigned long long*)first_bad, (u64)(first + j));
}

// Row j of a chunk is the job's row first + j: it goes from the stage to dst row ids[first + j]
// only if rows 0 .. first + j of the job all matched: every earlier chunk's and this one's
// sums are in *first_bad by now (stream order). quads: 16 bytes at a time.
extern "C" __global__ void kv_checked_copy(const unsigned char* stage, const long long stage_stride,
                                           unsigned char* dst, const long long dst_stride,
                                           const long long* ids, const long long first,
                                           const long long* first_bad, const int words,
                                           const int quads) {
    const long long g = first + blockIdx.x;
    if (g >= *first_bad) return;
    const unsigned char* src = stage + blockIdx.x * stage_stride;
    unsigned char* out = dst + ids[g] * dst_stride;
    const int step = gridDim.y * blockDim.x;
    if (quads) {
        for (int q = blockIdx.y * blockDim.x + threadIdx.x; q < words / 4; q += step)
            ((int4*)out)[q] = ((const int4*)src)[q];
    } else {
        for (int k = blockIdx.y * blockDim.x + threadIdx.x; k < words; k += step)
            ((int*)out)[k] = ((const int*)src)[k];
    }
}

// *first_bad = count (the job's start), or *good = *first_bad (its end: pinned host memory).
extern "C" __global__ void kv_first_bad(long long* first_bad, const long long count,
                                        long long* good) {
    if (good) *good = *first_bad;
    else *first_bad = count;
}
"""
_THREADS = 256
# Thread blocks a kernel aims for: one per SM of an H100/H200. The kernels run beside the DMA
# and the model's own kernels; 132 vs 528 blocks: checked loads 0.979 vs 0.973-0.978 of
# unchecked (H200, 2 and 4 MiB blocks), and fewer SMs taken from compute.
_BLOCKS = 132
# A checked load's last chunks halve down to rows of this many bytes (`_chunks`): what is summed
# and copied on after the last DMA went from 142 to ~45 us at 2 MiB blocks (H200: 64 MiB stages).
_TAIL_BYTES = 4 << 20


@dataclass(frozen=True)
class SumsOutput:
    """What a summing job hands back by its end event: `values`, pinned int64 (a store's sums,
    or a checked load's [good rows]); `keep`: the pinned host tensors its kernels read (ids,
    expected sums), alive as long as this is."""

    values: torch.Tensor
    is_load: bool
    keep: tuple[torch.Tensor, ...]


class LaneSums:
    """The summing side of one lane on `device`, on `stream` (see module doc).

    Its kernels read and write pinned host memory in place (ids, expected sums, results: UVA
    pointers), so the only copy-engine work is the lane's own DMA: a small copy queued behind a
    lane's big ones would wait for all of them (the engines run each direction's copies in
    order; on the H200 a store's sums came back only after every queued store had copied).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.ExternalStream) -> None:
        import cupy

        self.device, self.stream = device, stream
        self._kernels = kernels(device.index)
        # Held from a job's first launch: a job whose issue failed part-way hands them to its
        # completion, so kernels queued before the failure never read freed pinned memory.
        self.holding: SumsOutput | None = None
        # Entered once per job: cupy launches on the current stream, and these objects cost
        # more than a launch to make.
        self._cupy_device = cupy.cuda.Device(device.index)
        self._cupy_stream = cupy.cuda.ExternalStream(stream.cuda_stream, device.index)
        self._partial = torch.empty(0, dtype=torch.int64, device=device)  # this stream's only
        # Coefficients per row width, copied on this stream: every kernel that reads them here
        # runs after the copy.
        self._coefficients: dict[int, torch.Tensor] = {}
        self._stages: list[torch.Tensor] = []
        self._freed: list[torch.cuda.Event | None] = []  # each buffer's last use

    def issue_store(self, copy: RowCopy, lane: torch.cuda.ExternalStream,
                    ready: torch.cuda.Event, end: torch.cuda.Event) -> SumsOutput:
        """Sum the store's GPU rows from `ready` (the lane's point before its copies, queued
        already) on; records `end` once the sums and the lane's copies are done."""
        rows = copy.pairs[0][0]
        n = len(copy.src_rows)
        ids = _pinned(copy.src_rows)
        out = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.holding = SumsOutput(out, False, (ids,))
        copied = torch.cuda.Event()
        copied.record(lane)
        with self._on_stream():
            self.stream.wait_event(ready)
            if n:
                self._sum(rows.data_ptr(), rows.stride(0), ids.data_ptr(), n,
                          int(rows.shape[1]), out.data_ptr(), 0, 0, 0, _quads(rows))
            self.stream.wait_event(copied)
            end.record(self.stream)
        return self.holding

    def issue_load(self, copy: RowCopy, lane: torch.cuda.ExternalStream, issue: Issue,
                   end: torch.cuda.Event) -> SumsOutput:
        """Queue a checked load (see module doc); records `end` after its last rows went on."""
        self.holding = None
        (host, gpu), = copy.pairs
        nbytes, n = int(host.shape[1]), len(copy.src_rows)
        per = max(1, base.STAGE_BYTES // nbytes)
        self._ensure_stages(per, nbytes)
        chunks = _chunks(n, per, max(1, _TAIL_BYTES // nbytes))
        arange = np.arange(per, dtype=np.int64)

        def stage(k: int) -> torch.cuda.Event:
            """DMA chunk k into its buffer once that buffer's rows went on; its landed event."""
            start, rows = chunks[k]
            buf = k % len(self._stages)
            if self._freed[buf] is not None:
                lane.wait_event(self._freed[buf])
            issue(RowCopy(copy.job_id, ((host, self._stages[buf]),),
                          copy.src_rows[start:start + rows], arange[:rows]), lane)
            landed = torch.cuda.Event()
            landed.record(lane)
            return landed

        # The first buffers' DMAs go first: the rest of the host's work for the job (~0.3 ms
        # before the first DMA, H200) then runs while they copy.
        landed = [stage(k) for k in range(min(len(self._stages), len(chunks)))]
        ids, expect = _pinned(copy.dst_rows), _pinned(copy.expect)
        quads = _quads(gpu)  # the stage's rows are whole 16-byte words where the cache's are
        out = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self.holding = SumsOutput(out, True, (ids, expect))
        with self._on_stream():
            first_bad = torch.empty(1, dtype=torch.int64, device=self.device)
            self._launch("kv_first_bad", (1,), (first_bad.data_ptr(), np.int64(n), 0), threads=1)
            for k, (start, rows) in enumerate(chunks):
                buf = k % len(self._stages)
                self.stream.wait_event(landed[k])
                self._sum(self._stages[buf].data_ptr(), nbytes, 0, rows, nbytes, 0,
                          expect.data_ptr() + 8 * start, start, first_bad.data_ptr(), quads)
                self._launch("kv_checked_copy", (rows, self._splits(rows, nbytes, quads)), (
                    self._stages[buf].data_ptr(), np.int64(nbytes), gpu.data_ptr(),
                    np.int64(gpu.stride(0)), ids.data_ptr(), np.int64(start),
                    first_bad.data_ptr(), np.int32(nbytes // 4), np.int32(quads)))
                self._freed[buf] = freed = torch.cuda.Event()
                freed.record(self.stream)
                if k + len(self._stages) < len(chunks):
                    landed.append(stage(k + len(self._stages)))
            self._launch("kv_first_bad", (1,), (first_bad.data_ptr(), np.int64(n),
                                                 out.data_ptr()), threads=1)
            end.record(self.stream)
        return self.holding

    def _sum(self, base_ptr: int, stride: int, ids_ptr: int, rows: int, nbytes: int,
             out_ptr: int, expect_ptr: int, first: int, first_bad_ptr: int, quads: bool) -> None:
        """Sums of `rows` rows into out (or, with expect, the first that differs, as the job's
        row first + j, into first_bad)."""
        words = nbytes // 4
        coef = self._coefficients.get(words)
        if coef is None:
            coef = self._coefficients[words] = _pinned(coefficient_array(words)).to(
                self.device, non_blocking=True)
        splits = self._splits(rows, nbytes, quads)
        if self._partial.numel() < rows * splits:  # freed in stream order: only this stream
            self._partial = torch.empty(rows * splits, dtype=torch.int64, device=self.device)
        partial = self._partial.data_ptr()
        self._launch("kv_row_sums", (rows, splits), (
            base_ptr, np.int64(stride), ids_ptr, np.int32(words), np.int32(quads),
            coef.data_ptr(), partial))
        self._launch("kv_finish_sums", (-(-rows // _THREADS),), (
            partial, np.int32(splits), np.int32(rows), out_ptr, expect_ptr, np.int64(first),
            first_bad_ptr))

    @staticmethod
    def _splits(rows: int, nbytes: int, quads: bool) -> int:
        """Thread blocks per row: about _BLOCKS in all, none without a word to take."""
        per_thread = 16 if quads else 4
        return max(1, min(-(-_BLOCKS // rows), -(-nbytes // (per_thread * _THREADS))))

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """torch's and cupy's current stream: this side's (torch allocates, cupy launches)."""
        with torch.cuda.stream(self.stream), self._cupy_device, self._cupy_stream:
            yield

    def _launch(self, name: str, grid: tuple[int, ...], args: tuple[object, ...],
                threads: int = _THREADS) -> None:
        """Launch a kernel on the current stream (`_on_stream`); pointers go as uint64."""
        self._kernels[name](grid, (threads,), tuple(
            np.uint64(a) if type(a) is int else a for a in args))

    def reserve(self, nbytes: int) -> None:
        """Allocate the staging buffers for rows of `nbytes` now (not at the first load)."""
        self._ensure_stages(max(1, base.STAGE_BYTES // nbytes), nbytes)

    def _ensure_stages(self, rows: int, nbytes: int) -> None:
        if self._stages and tuple(self._stages[0].shape) == (rows, nbytes):
            return
        if self._stages:  # rows of another size (only where STAGE_BYTES changed, in tests):
            torch.cuda.synchronize(self.device)  # the old buffers' work finishes first
        self._stages = [torch.empty(rows, nbytes, dtype=torch.uint8, device=self.device)
                        for _ in range(base.STAGE_BUFFERS)]
        self._freed = [None] * base.STAGE_BUFFERS


@functools.cache
def kernels(device_index: int) -> dict[str, Any]:
    """The kernels, compiled once per process and device (NVRTC; cupy caches the binary)."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE)
        return {name: module.get_function(name) for name in (
            "kv_row_sums", "kv_finish_sums", "kv_checked_copy", "kv_first_bad")}


def available(device_index: int) -> bool:
    """Whether the kernels run here (cupy present, NVRTC compiles them); logs why not."""
    try:
        kernels(device_index)
    except Exception as exc:  # no cupy, no NVRTC: row sums are off, xxh3 checks remain
        log.warning("row sums are off on cuda:%d: %s", device_index, exc)
        return False
    return True


def _chunks(n: int, per: int, least: int) -> list[tuple[int, int]]:
    """A checked load's chunks of its n rows, (first row, rows): `per` rows each, but the last
    `per` rows in halves down to `least`, so that little is left to sum and copy on once the
    last DMA landed."""
    out, start = [], 0
    while n - start > per:
        out.append((start, per))
        start += per
    while start < n:
        rows = n - start if n - start <= least else max(least, (n - start + 1) // 2)
        out.append((start, rows))
        start += rows
    return out


def _quads(rows: torch.Tensor) -> bool:
    """Whether every row of `rows` is whole, 16-byte aligned 16-byte words."""
    return rows.data_ptr() % 16 == 0 and rows.stride(0) % 16 == 0 and rows.shape[1] % 16 == 0


def _pinned(values: np.ndarray) -> torch.Tensor:
    """A copy of an int64 array in pinned host memory (a kernel reads it at its address)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).pin_memory()
