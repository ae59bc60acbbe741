"""Allocator: sizing, alignment, shared memory across processes, and refusals, for cache
buffers (a KVLayout) and for slot buffers (slots of a byte size)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from kvconnector.layout import allocator
from kvconnector.layout.allocator import (
    allocate,
    allocate_slots,
    attach,
    attach_slots,
    slot_stride,
    slots_in,
    unlink_shared,
)
from kvconnector.layout.descriptor import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=64, block_size=16, dtype="bf16")


@pytest.fixture
def shm_name():
    name = f"kvc-test-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_shared(name)


def test_budget_sizes_block_count_and_chunks_are_page_aligned():
    stride = LAYOUT.with_alignment(4096).block_stride_bytes
    buf = allocate(LAYOUT, budget_bytes=10 * stride + stride - 1)
    assert buf.num_blocks == 10
    assert buf.raw.numel() == 10 * stride
    assert buf.raw.data_ptr() % 4096 == 0
    chunks = buf.block_chunks()
    assert chunks.shape == (10, LAYOUT.block_bytes)
    assert chunks.stride() == (stride, 1)
    assert not buf.raw.any()  # zeroed


def test_block_count_and_budget_refusals_name_the_value():
    with pytest.raises(ValueError, match="budget_bytes 1000 holds no block"):
        allocate(LAYOUT, budget_bytes=1000)
    with pytest.raises(ValueError, match="budget_bytes must be a positive integer, got -5"):
        allocate(LAYOUT, budget_bytes=-5)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        allocate(LAYOUT, num_blocks=0)
    with pytest.raises(ValueError, match=r"exactly one of num_blocks \(3\) and budget_bytes"):
        allocate(LAYOUT, num_blocks=3, budget_bytes=10**9)
    with pytest.raises(ValueError, match="exactly one of num_blocks"):
        allocate(LAYOUT)


def test_layer_major_buffer_has_no_block_chunks():
    buf = allocate(LAYOUT.with_order("LBHNC"), num_blocks=3)
    with pytest.raises(ValueError, match="LBHNC is layer-major"):
        buf.block_chunks()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_without_cuda_is_refused():
    with pytest.raises(ValueError, match="pinned=True needs CUDA"):
        allocate(LAYOUT, num_blocks=2, pinned=True)


_CHILD = """
import sys, torch
from kvconnector.layout.allocator import attach
from kvconnector.layout.descriptor import KVLayout
layout = KVLayout(num_layers=4, num_kv_heads=2, head_size=64, block_size=16, dtype="bf16")
buf = attach(sys.argv[1], layout)
chunks = buf.block_chunks()
print(buf.num_blocks, int(chunks[2].to(torch.int64).sum()), int(chunks[0].count_nonzero()))
chunks[4].fill_(0x5A)  # the parent must see this write
buf.close()
"""


def test_second_process_attaches_by_name_and_shares_bytes(shm_name: str):
    buf = allocate(LAYOUT, num_blocks=6, shared_name=shm_name)
    chunks = buf.block_chunks()
    pattern = torch.arange(LAYOUT.block_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    chunks[2].copy_(pattern)
    out = subprocess.run([sys.executable, "-c", _CHILD, shm_name], capture_output=True,
                         text=True, timeout=120, check=True)
    num_blocks, checksum, nonzero_in_block0 = map(int, out.stdout.split())
    assert num_blocks == 6
    assert checksum == int(pattern.to(torch.int64).sum())
    assert nonzero_in_block0 == 0
    assert bool((chunks[4] == 0x5A).all())
    assert not chunks[[0, 1, 3, 5]].any()
    buf.close(unlink=True)
    assert not os.path.exists(os.path.join(allocator.SHM_DIR, shm_name))


def test_shared_memory_too_small_says_so(shm_name: str, monkeypatch: pytest.MonkeyPatch):
    # /dev/shm cannot be shrunk from a test; report a small free size instead.
    monkeypatch.setattr(allocator, "shm_free_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match=r"/dev/shm has 0.00 GiB free; .* needs .*--shm-size"):
        allocate(LAYOUT, num_blocks=64, shared_name=shm_name)
    assert not os.path.exists(os.path.join(allocator.SHM_DIR, shm_name))


def test_shared_name_refusals(shm_name: str):
    with pytest.raises(ValueError, match="plain file name, got '../etc'"):
        allocate(LAYOUT, num_blocks=1, shared_name="../etc")
    with pytest.raises(ValueError, match=f"no shared buffer named '{shm_name}'"):
        attach(shm_name, LAYOUT)
    buf = allocate(LAYOUT, num_blocks=3, shared_name=shm_name)
    buf.raw[:8].fill_(9)
    with pytest.raises(FileExistsError):
        allocate(LAYOUT, num_blocks=3, shared_name=shm_name)
    assert buf.raw[:8].tolist() == [9] * 8  # the existing buffer is untouched
    other = KVLayout(num_layers=3, num_kv_heads=2, head_size=64, block_size=16, dtype="bf16")
    with pytest.raises(ValueError, match=f"'{shm_name}' holds BLNHC .* L=4 .*, not BLNHC .* L=3"):
        attach(shm_name, other)
    assert attach(shm_name).layout == buf.layout  # the header alone suffices
    buf.close(unlink=True)


@pytest.mark.parametrize(("slot_bytes", "stride"), [(1, 4096), (4100, 8192), (2 << 20, 2 << 20)])
def test_slots_are_their_bytes_each_page_aligned_and_zeroed(slot_bytes: int, stride: int):
    """Host pools and the bench's arenas size slots by bytes alone: no layout, each slot
    starting on a page, only the rounding up to the next page between slots."""
    assert slot_stride(slot_bytes) == stride
    buf = allocate_slots(3, slot_bytes)
    try:
        assert (buf.num_slots, buf.slot_bytes, buf.stride) == (3, slot_bytes, stride)
        assert buf.raw.numel() == 3 * stride and buf.raw.data_ptr() % 4096 == 0
        rows = buf.rows()
        assert rows.shape == (3, slot_bytes) and rows.stride() == (stride, 1)
        assert [rows[i].data_ptr() - buf.raw.data_ptr() for i in range(3)] == [0, stride,
                                                                               2 * stride]
        assert int(buf.raw.count_nonzero()) == 0
        rows[1].fill_(0xFF)  # a slot's bytes are its own: the rounding up is not in the row
        assert int(buf.raw.count_nonzero()) == slot_bytes
        assert not buf.pinned and buf.shared_name is None
    finally:
        buf.close()


def test_slot_count_from_a_budget_and_refusals_name_the_value():
    assert slots_in(3 * 8192 + 8191, 4100) == 3
    assert slots_in(4095, 4096) == 0
    with pytest.raises(ValueError, match="num_slots must be a positive integer, got 0"):
        allocate_slots(0, 4096)
    with pytest.raises(ValueError, match="slot_bytes must be a positive integer, got -1"):
        allocate_slots(2, -1)
    with pytest.raises(ValueError, match="budget_bytes must be a positive integer, got 0"):
        slots_in(0, 4096)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned=True needs CUDA"):
            allocate_slots(2, 4096, pinned=True)


def test_shared_slots_attach_with_the_creators_count_and_size(shm_name: str):
    buf = allocate_slots(4, 5000, shared_name=shm_name)
    try:
        buf.rows()[2].fill_(7)
        other = attach_slots(shm_name)
        assert (other.num_slots, other.slot_bytes, other.stride) == (4, 5000, 8192)
        assert other.shared_name == shm_name
        seen = other.rows()
        assert bool((seen[2] == 7).all()) and int(seen[[0, 1, 3]].count_nonzero()) == 0
        seen[3].fill_(9)  # and the creator sees this write
        assert bool((buf.rows()[3] == 9).all())
        other.close()
        # a slot buffer is not a cache buffer, nor the other way round
        with pytest.raises(ValueError, match=f"'{shm_name}' in /dev/shm is not a kvconnector "
                                             f"buffer"):
            attach(shm_name)
    finally:
        buf.close(unlink=True)
    cache = allocate(LAYOUT, num_blocks=2, shared_name=shm_name)
    try:
        with pytest.raises(ValueError, match="is not a kvconnector slot buffer"):
            attach_slots(shm_name)
    finally:
        cache.close(unlink=True)
    with pytest.raises(ValueError, match=f"no shared buffer named '{shm_name}'"):
        attach_slots(shm_name)


@pytest.mark.gpu
def test_gpu_slots_are_256_aligned_and_zeroed():
    buf = allocate_slots(5, 1000, device="cuda")
    assert buf.raw.is_cuda and buf.raw.data_ptr() % 256 == 0
    assert buf.stride == 1024 and buf.rows().stride() == (1024, 1)
    assert int(buf.raw.count_nonzero()) == 0


@pytest.mark.gpu
def test_gpu_buffer_is_256_aligned_and_zeroed():
    buf = allocate(LAYOUT, num_blocks=7, device="cuda")
    assert buf.raw.is_cuda and buf.raw.data_ptr() % 256 == 0
    assert buf.block_chunks().stride(0) % 256 == 0
    assert int(buf.raw.count_nonzero()) == 0


@pytest.mark.gpu
def test_pinned_host_buffer_is_registered(shm_name: str):
    buf = allocate(LAYOUT, num_blocks=8, pinned=True)
    assert buf.raw.is_pinned()
    shared = allocate(LAYOUT, num_blocks=8, shared_name=shm_name)
    other = attach(shm_name, LAYOUT, pinned=True)
    assert other.raw.is_pinned()
    other.close()
    shared.close(unlink=True)
    buf.close()


@pytest.mark.gpu
def test_pinned_slots_are_registered(shm_name: str):
    buf = allocate_slots(8, 5000, pinned=True)
    assert buf.pinned and buf.raw.is_pinned()
    shared = allocate_slots(8, 5000, shared_name=shm_name)
    other = attach_slots(shm_name, pinned=True)
    assert other.pinned and other.raw.is_pinned()
    other.close()
    shared.close(unlink=True)
    buf.close()
