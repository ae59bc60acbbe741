"""Offload blocks of a block-major KV cache to a host pool and load them back, checking every byte.

What it shows:
- `allocate` makes one block-major buffer (order BLNHC: block b of all 32 layers is one 2 MiB
  chunk) for a Llama-3.1-8B-like cache (8 KV heads, head size 128, 16-token blocks, bf16);
- the per-layer views an attention backend would read (`layer_view`) write into that buffer;
- a `HostPool` (pinned when CUDA is present) and a `TransferEngine` over
  `pool.segments([cache.block_chunks()])` move each block in ONE copy: store random non-adjacent
  blocks, poison them on the device, load the pool slots back into other block ids;
- every byte of every loaded block is compared with what was stored, and the layer views of the
  new ids hold what was written through the old ones.

Run it (on a GPU machine it uses "cuda" and batched DMA, else "cpu" and copy threads):

    python examples/offload_reload.py

It prints one line, `offload_reload: OK ...` with blocks, bytes and the store/load rates, and exits
with code 1 on any mismatch. The CPU path moves 32 blocks (64 MiB); its rates are host-to-host
copies on worker threads, not PCIe figures (see `kvconnector bench` for those).
"""

from __future__ import annotations

import sys

import torch

from kvconnector import KVLayout, allocate
from transfer.copy.factory import make_backend
from transfer.engine import CopyResult, TransferEngine
from transfer.pool import HostPool

SEED = 0
POISON = 0xA5
WAIT_TIMEOUT_S = 60.0


def non_adjacent_ids(pool: list[int], count: int, gen: torch.Generator) -> list[int]:
    """`count` ids drawn at random from `pool` (already pairwise non-adjacent), in random order."""
    pick = torch.randperm(len(pool), generator=gen)[:count]
    return [pool[i] for i in pick.tolist()]


def run_job(engine: TransferEngine, job_id: int, store: bool, gpu_ids: list[int],
            slot_ids: list[int]) -> CopyResult:
    """Submit one store or load job, wait for it and return its result."""
    if store:
        engine.submit_store(job_id, gpu_ids, slot_ids)
    else:
        engine.submit_load(job_id, slot_ids, gpu_ids)
    if not engine.wait([job_id], timeout=WAIT_TIMEOUT_S):
        raise RuntimeError(f"job {job_id} did not finish in {WAIT_TIMEOUT_S} s")
    (result,) = [r for r in engine.get_finished() if r.job_id == job_id]
    if not result.ok:
        raise RuntimeError(f"job {job_id} ({'store' if store else 'load'}) failed")
    return result


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_blocks, moved = (2048, 512) if device == "cuda" else (128, 32)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, block_size=16,
                      dtype="bfloat16", order="BLNHC")
    cache = allocate(layout, num_blocks=num_blocks, device=device)
    gen = torch.Generator().manual_seed(SEED)

    # Stored blocks on even ids, reload targets on odd ids: non-adjacent within each set, so
    # no two copies of a job can merge into one larger copy.
    src = non_adjacent_ids(list(range(0, num_blocks, 2)), moved, gen)
    dst = non_adjacent_ids(list(range(1, num_blocks, 2)), moved, gen)
    slots = torch.randperm(moved, generator=gen).tolist()

    # Fill the source blocks layer by layer, through the views an attention backend reads.
    src_index = torch.tensor(src, device=device)
    written = []
    for layer in range(layout.num_layers):
        view = cache.layer_view(layer)  # [B, H, N, 2*D], strides into the block-major buffer
        data = torch.randn((moved, *view.shape[1:]), generator=gen, dtype=layout.dtype)
        view[src_index] = data.to(device)
        written.append(data)

    chunks = cache.block_chunks()  # (num_blocks, block_bytes): row b = block b, one copy
    expected = chunks[src_index].cpu()
    pool = HostPool.create(moved, layout.block_bytes)
    engine = TransferEngine(pool.segments([chunks]), make_backend("auto", device))
    try:
        stored = run_job(engine, 1, True, src, slots)
        chunks[src_index] = POISON  # the device copies are gone ...
        chunks[torch.tensor(dst, device=device)] = POISON  # ... and the targets hold garbage
        loaded = run_job(engine, 2, False, dst, slots)
    finally:
        engine.close()

    dst_index = torch.tensor(dst, device=device)
    differs = (chunks[dst_index].cpu() != expected).any(dim=1).nonzero().flatten().tolist()
    bad = [f"block {dst[i]}" for i in differs]
    for layer in range(layout.num_layers):
        if not torch.equal(cache.layer_view(layer)[dst_index].cpu().view(torch.uint8),
                           written[layer].view(torch.uint8)):
            bad.append(f"layer {layer}")
    backend = engine.backend.name
    pool_kind = "pinned" if pool.pinned else "pageable"
    pool.close()
    if bad:
        print(f"offload_reload: MISMATCH in {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
        return 1

    nbytes = moved * layout.block_bytes
    print(f"offload_reload: OK {moved} random non-adjacent blocks x "
          f"{layout.block_bytes / 2**20:.2f} MiB = {nbytes / 2**20:.1f} MiB, {device} <-> "
          f"{pool_kind} host pool ({backend} backend): store "
          f"{stored.nbytes / stored.seconds / 1e9:.2f} GB/s, load "
          f"{loaded.nbytes / loaded.seconds / 1e9:.2f} GB/s; every byte checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
