"""vLLM's own copy path for its CPU offloading, the layer-major baseline of `kvconnector bench` on
CUDA. vLLM 0.32 (vllm/v1/kv_offload/cpu/gpu_worker.py) copies a job's pages like this:

- GPU -> CPU: every copy in one cuMemcpyBatchAsync call (`ops.swap_blocks_batch`), sources read
  in stream order;
- CPU -> GPU: the same call with sources read in any order, except where every page is under
  28 KiB and a multiple of 8 bytes and a job has at least 16 copies: then a Triton kernel on 12
  SMs copies them. Our SM copy kernel on 12 SMs (transfer.copy.cuda.SmCopyBackend, as the
  connector's "auto" backend runs it) stands in for it; it is the faster of the two (8 KiB pages
  on the H200: 40-43 GB/s against 33 GB/s measured once for vLLM's).

Imported on CUDA machines only (libcuda, cupy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.copy.base import RowCopy, Segment
from transfer.copy.cuda import (
    SM_LOAD_MAX_PAGE,
    SM_LOAD_MIN_COPIES,
    SM_LOAD_SMS,
    SmCopyBackend,
    _CudaBackend,
)
from transfer.copy.cuda_driver import SRC_ORDER_ANY, SRC_ORDER_STREAM, BatchCopy, MemcpyAttributes


class VllmCopyPath(_CudaBackend):
    """The copies vLLM 0.32 issues for the same job (see module doc)."""

    name = "vLLM 0.32's copy path (one batched DMA call a job; small-page loads on SMs)"

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(device)
        # vLLM sets only the source order (any for loads); flags stay 0. BatchCopy passes the
        # descriptor arrays to the driver in place, as vLLM's C++ does.
        self._load_batch = BatchCopy(MemcpyAttributes(src_access_order=SRC_ORDER_ANY))
        self._store_batch = BatchCopy(MemcpyAttributes(src_access_order=SRC_ORDER_STREAM))
        self._sm: SmCopyBackend | None = None
        self.sm_jobs = 0  # load jobs the SM kernel copied

    def check(self, segments: Sequence[Segment]) -> None:
        super().check(segments)
        if all(_sm_page(seg.host.shape[1]) for seg in segments):
            self._sm = SmCopyBackend(self.device, sms=SM_LOAD_SMS)
            self._sm.check(segments)

    def issue(self, copy: RowCopy, stream: torch.cuda.ExternalStream) -> None:
        count = len(copy.src_rows) * len(copy.pairs)
        if count == 0:
            return
        load = copy.is_load
        if load and self._sm is not None and count >= SM_LOAD_MIN_COPIES:
            self.sm_jobs += 1
            self._sm.issue(copy, stream)
            return
        srcs, dsts, sizes = copy.descriptors()
        (self._load_batch if load else self._store_batch)(dsts, srcs, sizes, stream.cuda_stream)


def _sm_page(page_bytes: int) -> bool:
    return page_bytes < SM_LOAD_MAX_PAGE and page_bytes % 8 == 0
