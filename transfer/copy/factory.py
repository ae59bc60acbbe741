"""Choosing a copy backend by name: the one module that knows every backend.

The base types (`transfer.copy.base`) never import the CUDA backends (`transfer.copy.cuda`); this
factory imports them lazily, only when a CUDA backend is asked for, so the CPU path and the
scheduler side work without cupy or cuda-bindings.
"""

from __future__ import annotations

import torch

from transfer.copy.base import CopyBackend, ThreadBackend

BACKENDS = ("auto", "thread", "dma", "sm")


def make_backend(kind: str = "auto", device: str | torch.device = "cpu") -> CopyBackend:
    """The backend `kind` for `device`: "auto" is "thread" on CPU and, on CUDA, batched DMA with
    small-page loads on a few SMs (transfer.copy.cuda.AutoCudaBackend)."""
    device = torch.device(device)
    if kind not in BACKENDS:
        raise ValueError(f"unknown copy backend {kind!r}; known: {BACKENDS}")
    if kind == "thread" or (kind == "auto" and device.type != "cuda"):
        return ThreadBackend()
    if device.type != "cuda":
        raise ValueError(f"copy backend {kind!r} needs a CUDA device, got {device}")
    from transfer.copy import cuda as cuda_copy  # lazy: cuda-bindings, cupy exist only on GPUs

    backends = {"auto": cuda_copy.AutoCudaBackend, "dma": cuda_copy.DmaBackend,
                "sm": cuda_copy.SmCopyBackend}
    return backends[kind](device)
