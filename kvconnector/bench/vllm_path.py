"""vLLM's own copy path for its CPU offloading, the layer-major baseline of `kvconnector bench` on
CUDA. vLLM 0.32 (vllm/v1/kv_offload/cpu/gpu_worker.py) copies a job's pages like this:

- GPU -> CPU: every copy in one cuMemcpyBatchAsync call (`ops.swap_blocks_batch`), sources read
  in stream order;
- CPU -> GPU: the same call with sources read in any order, except where every page is under
  28 KiB and a multiple of 8 bytes and a job has at least 16 copies: then a Triton kernel on 12
  SMs copies them. Our SM copy kernel (transfer.cuda_copy.SmCopyBackend) stands in for it.

Imported on CUDA machines only (cuda-bindings, cupy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.bench.sizing import BenchError
from transfer.copy_backends import RowCopy, Segment
from transfer.cuda_copy import DmaBackend, SmCopyBackend, _check

VLLM_SM_MAX_PAGE = 28 * 1024  # vLLM's THRESHOLD_BYTES: the largest page its Triton kernel takes
VLLM_SM_MIN_COPIES = 16  # vLLM's MIN_N: fewer copies go to the DMA call


class VllmCopyPath(DmaBackend):
    """The copies vLLM 0.32 issues for the same job (see module doc)."""

    name = "vLLM 0.32's copy path (one batched DMA call a job; small-page loads on SMs)"

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(device)
        if not self.batched:
            raise BenchError("cudaMemcpyBatchAsync is unavailable here, so vLLM's copy path "
                             "cannot be reproduced")
        rt = self._rt
        order = rt.cudaMemcpySrcAccessOrder
        # vLLM sets only the source order; flags stay 0.
        self._load_attrs, self._store_attrs = rt.cudaMemcpyAttributes(), rt.cudaMemcpyAttributes()
        self._load_attrs.srcAccessOrder = order.cudaMemcpySrcAccessOrderAny
        self._store_attrs.srcAccessOrder = order.cudaMemcpySrcAccessOrderStream
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
        srcs, dsts, sizes = copy.descriptors()
        result = self._rt.cudaMemcpyBatchAsync(
            dsts.tolist(), srcs.tolist(), sizes.tolist(), count,
            [self._load_attrs if load else self._store_attrs], [0], 1, stream.cuda_stream)
        _check(result[0], f"cudaMemcpyBatchAsync of {count} copies")


def _sm_page(page_bytes: int) -> bool:
    return page_bytes < VLLM_SM_MAX_PAGE and page_bytes % 8 == 0
