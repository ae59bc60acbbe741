"""The copy paths the benchmark drives, all through the transfer engine.

Segments (transfer.copy.base.Segment) pair device rows with pool rows: a block-major cache is
one segment of whole blocks (one copy per block); the layer-major path vLLM uses is one segment
per layer of pages (one copy per layer per block), each landing in its place inside the slot.
"""

from __future__ import annotations

import itertools

import torch

from kvconnector.layout.allocator import KVBuffer
from transfer.copy.base import CopyBackend, Segment
from transfer.copy.factory import make_backend
from transfer.engine import DEFAULT_MAX_STORE_BYTES, TransferEngine
from transfer.pool import HostPool


def layer_rows(cache: KVBuffer) -> list[torch.Tensor]:
    """Per-layer (num_blocks, page_bytes) row views of a layer-outermost cache."""
    lay = cache.layout
    if lay.order[0] != "L":
        raise ValueError(f"per-layer rows need an L-outermost order, got {lay.order}")
    page, nb = lay.page_bytes, cache.num_blocks
    return [torch.as_strided(cache.raw, (nb, page), (page, 1),
                             cache.raw.storage_offset() + layer * nb * page)
            for layer in range(lay.num_layers)]


def segments_for(cache: KVBuffer, pool: HostPool) -> list[Segment]:
    """Block-major cache: one segment of blocks; layer-major: one segment of pages per layer."""
    chunks = [cache.block_chunks()] if cache.layout.is_block_major else layer_rows(cache)
    return pool.segments(chunks)


class EngineMover:
    """Jobs on a TransferEngine; `store`/`load` return job ids, `wait` raises if one failed.

    `backend`: a copy backend kind, or "vllm" for vLLM's own copy path on CUDA (the layer-major
    baseline, kvconnector/bench/vllm_path.py; on a CPU the host copies stand in for it).
    """

    def __init__(self, segments: list[Segment], backend: str = "auto") -> None:
        device = segments[0].gpu.device
        if backend == "vllm" and device.type == "cuda":
            from kvconnector.bench.vllm_path import VllmCopyPath  # libcuda, cupy

            copier: CopyBackend = VllmCopyPath(device)
            self.name = copier.name
        else:
            copier = make_backend("auto" if backend == "vllm" else backend, device)
            self.name = f"transfer engine, {copier.name} backend"
        # Both ways in turns has a whole set's stores in flight at once (4 GiB at 4 MiB
        # blocks): bounded by the cache here, not by an engine's default.
        cache_bytes = sum(seg.gpu.numel() for seg in segments)  # uint8 rows
        self.engine = TransferEngine(segments, copier,
                                     max_store_bytes=max(cache_bytes, DEFAULT_MAX_STORE_BYTES))
        self._ids = itertools.count()

    def store(self, dev_ids: list[int], host_ids: list[int]) -> int:
        job = next(self._ids)
        if not self.engine.submit_store(job, dev_ids, host_ids):
            raise RuntimeError(f"store job {job} was dropped: over the bound of stores in flight")
        return job

    def load(self, host_ids: list[int], dev_ids: list[int]) -> int:
        job = next(self._ids)
        self.engine.submit_load(job, host_ids, dev_ids)
        return job

    def wait(self, jobs: list[int]) -> None:
        self.engine.wait(jobs)
        failed = [r.job_id for r in self.engine.get_finished() if not r.ok]
        if failed:
            raise RuntimeError(f"transfer jobs {failed} failed")

    def close(self) -> None:
        self.engine.close()
