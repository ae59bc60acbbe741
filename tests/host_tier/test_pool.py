"""Host block pool: slots of a byte size, segments of any cache order, shared memory across
processes."""

from __future__ import annotations

import multiprocessing as mp
import uuid

import pytest
import torch

from kvconnector.layout.allocator import allocate, slots_in
from kvconnector.layout.descriptor import HOST_ALIGNMENT, KVLayout, round_up
from transfer.engine import TransferEngine
from transfer.pool import HostPool


def layout(order: str = "BLNHC", num_layers: int = 3) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=2, head_size=8, block_size=4,
                    dtype="bfloat16", order=order)


def test_pool_is_page_aligned_zeroed_slots_of_the_cache_block_bytes() -> None:
    lay = layout("LBHNC")
    stride = round_up(lay.block_bytes, HOST_ALIGNMENT)
    num_slots = slots_in(10 * stride + stride // 2, lay.block_bytes)
    pool = HostPool.create(num_slots, lay.block_bytes, pinned=False)
    try:
        assert pool.num_slots == 10
        assert pool.block_bytes == lay.block_bytes
        assert pool.slots.shape == (10, lay.block_bytes)
        assert pool.slots.stride(0) == stride
        assert pool.slots.data_ptr() % HOST_ALIGNMENT == 0
        assert not pool.pinned and pool.shared_name is None
        assert pool.buffer.raw.numel() == 10 * stride
        assert torch.count_nonzero(pool.buffer.raw) == 0
    finally:
        pool.close()


def test_no_slots_and_pinned_without_cuda_are_refused() -> None:
    assert slots_in(100, layout().block_bytes) == 0
    with pytest.raises(ValueError, match="num_slots must be a positive integer, got 0"):
        HostPool.create(0, layout().block_bytes, pinned=False)
    with pytest.raises(ValueError, match="slot_bytes must be a positive integer, got 0"):
        HostPool.create(2, 0, pinned=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned=True needs CUDA"):
            HostPool.create(2, layout().block_bytes, pinned=True)


def test_fallback_segments_tile_each_slot() -> None:
    lay = layout("LBHNC")
    cache = allocate(lay, num_blocks=5)
    pool = HostPool.create(4, lay.block_bytes, pinned=False)
    try:
        pages = [cache.raw[i * 5 * lay.page_bytes:(i + 1) * 5 * lay.page_bytes].view(5, -1)
                 for i in range(3)]
        segs = pool.segments(pages)
        base = pool.slots.data_ptr()
        for i, seg in enumerate(segs):
            assert seg.gpu.data_ptr() == pages[i].data_ptr()
            assert seg.host.shape == (4, lay.page_bytes)
            assert seg.host.stride() == pool.slots.stride()
            assert seg.host.data_ptr() == base + i * lay.page_bytes
    finally:
        pool.close()
        cache.close()


def test_pool_of_wrong_block_size_is_refused() -> None:
    cache = allocate(layout(num_layers=4), num_blocks=4)
    pool = HostPool.create(4, layout(num_layers=3).block_bytes, pinned=False)
    try:
        with pytest.raises(ValueError, match="wrong block size"):
            pool.segments([cache.block_chunks()])
        lay = cache.layout
        pages = [cache.raw[:4 * lay.page_bytes].view(4, -1)] * 2  # two layers' worth, not three
        with pytest.raises(ValueError, match="wrong block size"):
            pool.segments(pages)
    finally:
        pool.close()
        cache.close()


@pytest.mark.parametrize("chunks, match", [
    ([], "no GPU chunks"),
    ([torch.zeros(2, 3, 4, dtype=torch.uint8)], "2-D"),
    ([torch.zeros(2, 768)], "uint8"),
    ([torch.zeros(4, 1536, dtype=torch.uint8)[:, ::2]], "dense"),
    ([torch.zeros(4, 384, dtype=torch.uint8), torch.zeros(5, 384, dtype=torch.uint8)], "rows"),
    ([torch.as_strided(torch.zeros(2000, dtype=torch.uint8), (3, 768), (100, 1))], "overlap"),
])
def test_bad_chunks_are_refused(chunks: list[torch.Tensor], match: str) -> None:
    pool = HostPool.create(2, layout().block_bytes, pinned=False)
    try:
        with pytest.raises(ValueError, match=match):
            pool.segments(chunks)
    finally:
        pool.close()


def _child(name: str, lay: KVLayout, slots: list[int], expect: bytes, write: list[int],
           seed: int) -> None:
    pool = HostPool.attach(name, pinned=False)
    try:
        if (pool.num_slots, pool.block_bytes) != (8, lay.block_bytes):
            raise SystemExit(2)
        seen = b"".join(pool.slots[s].numpy().tobytes() for s in slots)
        if seen != expect:
            raise SystemExit(3)
        g = torch.Generator().manual_seed(seed)
        for s in write:
            pool.slots[s].copy_(torch.randint(0, 256, (pool.block_bytes,), dtype=torch.uint8,
                                              generator=g))
    finally:
        pool.close()


def test_shared_pool_seen_from_a_second_process() -> None:
    lay = layout()
    name = f"kvc-test-{uuid.uuid4().hex[:12]}"
    pool = HostPool.create(8, lay.block_bytes, pinned=False, shared_name=name)
    cache = allocate(lay, num_blocks=6)
    try:
        assert pool.shared_name == name
        g = torch.Generator().manual_seed(11)
        cache.raw.copy_(torch.randint(0, 256, cache.raw.shape, dtype=torch.uint8, generator=g))
        engine = TransferEngine(pool.segments([cache.block_chunks()]))
        assert engine.submit_store(1, [5, 0, 3], [6, 1, 4])
        assert engine.wait(None, 60.0) and engine.get_finished()[0].ok
        blocks = cache.block_chunks()
        expect = b"".join(blocks[b].numpy().tobytes() for b in (5, 0, 3))

        proc = mp.get_context("spawn").Process(
            target=_child, args=(name, lay, [6, 1, 4], expect, [2, 7], 12))
        proc.start()
        proc.join(120)
        assert proc.exitcode == 0

        # What the child wrote is what a load brings back.
        g = torch.Generator().manual_seed(12)
        written = [torch.randint(0, 256, (lay.block_bytes,), dtype=torch.uint8, generator=g)
                   for _ in range(2)]
        assert engine.submit_load(2, [2, 7], [1, 4])
        assert engine.wait(None, 60.0) and engine.get_finished()[0].ok
        assert torch.equal(blocks[1], written[0]) and torch.equal(blocks[4], written[1])
        engine.close()
    finally:
        pool.close(unlink=True)
        cache.close()


def test_attach_takes_the_creators_slots_and_refuses_another_block_size() -> None:
    name = f"kvc-test-{uuid.uuid4().hex[:12]}"
    pool = HostPool.create(3, layout(num_layers=3).block_bytes, pinned=False, shared_name=name)
    cache = allocate(layout(num_layers=2), num_blocks=2)
    try:
        other = HostPool.attach(name, pinned=False)  # count and size come from the creator
        assert (other.num_slots, other.block_bytes) == (3, pool.block_bytes)
        assert other.slots.stride() == pool.slots.stride()
        with pytest.raises(ValueError, match="wrong block size"):
            other.segments([cache.block_chunks()])
        other.close()
    finally:
        pool.close(unlink=True)
        cache.close()
