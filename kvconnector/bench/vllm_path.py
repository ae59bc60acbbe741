"""vLLM's own copy path for its CPU offloading, the layer-major baseline of `kvconnector bench` on
CUDA. vLLM 0.32 (vllm/v1/kv_offload/cpu/gpu_worker.py) copies a job's pages like this:

- GPU -> CPU: every copy in one cuMemcpyBatchAsync call (`ops.swap_blocks_batch`), sources read
  in stream order;
- CPU -> GPU: the same call with sources read in any order, except where every page is under
  28 KiB and a multiple of 8 bytes and a job has at least 16 copies: then a Triton kernel on 12
  SMs copies them. Our SM copy kernel (transfer.cuda_copy.SmCopyBackend, every SM) stands in
  for it; it is the faster of the two (8 KiB pages on the H200: 39-44 against 33 GB/s).

The DMA call goes to the driver (libcuda) with the descriptor arrays, as vLLM's C++ does.
Imported on CUDA machines only (libcuda, cupy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from transfer.copy_backends import RowCopy, Segment
from transfer.cuda_copy import SmCopyBackend, _CudaBackend

VLLM_SM_MAX_PAGE = 28 * 1024  # vLLM's THRESHOLD_BYTES: the largest page its Triton kernel takes
VLLM_SM_MIN_COPIES = 16  # vLLM's MIN_N: fewer copies go to the DMA call
_ORDER_STREAM, _ORDER_ANY = 1, 3  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _ANY


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h): source order, source and destination location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


class VllmCopyPath(_CudaBackend):
    """The copies vLLM 0.32 issues for the same job (see module doc)."""

    name = "vLLM 0.32's copy path (one batched DMA call a job; small-page loads on SMs)"

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(device)
        # vLLM's C++ hands its int64 arrays straight to the driver; cuda-bindings would convert
        # every descriptor from a Python list (~1.3 us each), a cost vLLM does not pay.
        self._batch = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
        self._batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p,
                                                        ctypes.c_void_p, ctypes.c_size_t,
                                                        ctypes.c_void_p]
        self._batch.restype = ctypes.c_int
        # vLLM sets only the source order; flags stay 0.
        self._load_attrs = _MemcpyAttributes(src_access_order=_ORDER_ANY)
        self._store_attrs = _MemcpyAttributes(src_access_order=_ORDER_STREAM)
        self._attrs_index = ctypes.c_size_t(0)
        self._sm: SmCopyBackend | None = None
        self.sm_jobs = 0  # load jobs the SM kernel copied

    def check(self, segments: Sequence[Segment]) -> None:
        super().check(segments)
        if all(_sm_page(seg.host.shape[1]) for seg in segments):
            self._sm = SmCopyBackend(self.device)
            self._sm.check(segments)

    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        load = copy.pairs[0][0].device.type == "cpu"
        count = len(copy.src_rows) * len(copy.pairs)
        if count == 0:
            return
        if load and self._sm is not None and count >= VLLM_SM_MIN_COPIES:
            self.sm_jobs += 1
            self._sm.issue(copy, stream)
            return
        srcs, dsts, sizes = copy.descriptors()  # int64 arrays: CUdeviceptr and size_t bits
        err = self._batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                          ctypes.byref(self._load_attrs if load else self._store_attrs),
                          ctypes.byref(self._attrs_index), 1, stream.cuda_stream)
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync of {count} copies failed: CUresult {err}")


def _sm_page(page_bytes: int) -> bool:
    return page_bytes < VLLM_SM_MAX_PAGE and page_bytes % 8 == 0
