"""Transfer engine on CUDA: pinned pool round trips, compute-stream order, two processes.

Run on the GPU machine: `pytest -m gpu tests/copy_engine` (skipped without CUDA).
Every load goes into poisoned blocks and the whole cache buffer is compared byte for byte. Jobs
are held in flight deterministically by a spin kernel on the compute stream that waits for a flag
in pinned host memory (`ComputeGate`), never by timing.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid

import numpy as np
import pytest
import torch

from kvconnector.layout.allocator import KVBuffer, allocate
from kvconnector.layout.descriptor import KVLayout
from transfer.copy.base import CopyBackend
from transfer.engine import TransferEngine
from transfer.pool import HostPool

pytestmark = pytest.mark.gpu

POISON = 0x5A
TIMEOUT = 120.0  # liveness only


def layout(order: str) -> KVLayout:
    # 8 layers x 64 KB pages (8 heads x 16 tokens x 2*128 bf16): 512 KB blocks.
    return KVLayout(num_layers=8, num_kv_heads=8, head_size=128, block_size=16,
                    dtype="bfloat16", order=order)


def cache_chunks(buf: KVBuffer) -> list[torch.Tensor]:
    """Whole blocks (block-major), or one row tensor per layer (per layer and head for LHBNC)."""
    lay = buf.layout
    if lay.is_block_major:
        return [buf.block_chunks()]
    strides, esize, raw = lay.axis_strides(buf.num_blocks), lay.element_size, buf.raw
    if lay.order.index("H") < lay.order.index("B"):
        width = lay.block_size * lay.content_size * esize
        offsets = [(layer * strides["L"] + h * strides["H"]) * esize
                   for layer in range(lay.num_layers) for h in range(lay.num_kv_heads)]
    else:
        width = lay.page_bytes
        offsets = [layer * strides["L"] * esize for layer in range(lay.num_layers)]
    return [torch.as_strided(raw, (buf.num_blocks, width), (strides["B"] * esize, 1),
                             raw.storage_offset() + off) for off in offsets]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def host_copy(view: torch.Tensor, raw: torch.Tensor, raw_cpu: torch.Tensor) -> torch.Tensor:
    """`view` (over `raw`) re-pointed into `raw_cpu`, a host copy of `raw`."""
    return torch.as_strided(raw_cpu, view.shape, view.stride(),
                            view.storage_offset() - raw.storage_offset())


def make_backend(kind: str) -> CopyBackend:
    from transfer.copy.cuda import DmaBackend, SmCopyBackend

    if kind == "dma":
        backend = DmaBackend("cuda")
        assert backend.batched, "cudaMemcpyBatchAsync should work on this machine"
        return backend
    if kind == "dma-loop":
        return DmaBackend("cuda", batched=False)
    if kind == "dma-cuda12":  # the driver's pre-CUDA 13 batch symbol (it takes a failIdx)
        import ctypes
        from types import SimpleNamespace

        from transfer.copy.cuda_driver import BatchCopy, driver_batch_call

        backend = DmaBackend("cuda")
        cuda12 = SimpleNamespace(cuMemcpyBatchAsync=ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync)
        backend._batch = BatchCopy(backend._batch._attrs, driver_batch_call(cuda12))
        return backend
    if kind == "auto":
        from transfer.copy.factory import make_backend as factory

        return factory("auto", "cuda")
    if kind == "vllm":  # the benchmark's layer-major baseline
        from kvconnector.bench.vllm_path import VllmCopyPath

        return VllmCopyPath("cuda")
    assert kind == "sm", kind
    return SmCopyBackend("cuda")


class ComputeGate:
    """Holds a CUDA stream: a kernel on it spins until `open()` writes a flag in pinned memory."""

    _SRC = r"""
    extern "C" __global__ void spin_until_set(const unsigned long long flag_addr) {
        volatile int* flag = (volatile int*)flag_addr;
        while (*flag == 0) { __nanosleep(2000); }
    }
    """

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._kernel = cupy.RawKernel(self._SRC, "spin_until_set")

    def close_on(self, stream: torch.cuda.Stream) -> None:
        """Hold `stream` until `open()`; a watchdog opens it after TIMEOUT so a hidden
        synchronisation with the held stream fails the test instead of hanging it."""
        self._flag[0] = 0
        with self._cupy.cuda.ExternalStream(stream.cuda_stream):
            self._kernel((1,), (1,), (np.uint64(self._flag.data_ptr()),))
        watchdog = threading.Timer(TIMEOUT, self.open)
        watchdog.daemon = True
        watchdog.start()

    def open(self) -> None:
        self._flag[0] = 1


class Rig:
    def __init__(self, order: str, backend: str = "dma", num_blocks: int = 64,
                 num_slots: int = 48) -> None:
        self.cache = allocate(layout(order), num_blocks=num_blocks, device="cuda")
        self.cache.raw.copy_(random_bytes(self.cache.raw.numel(), 1))
        self.pool = HostPool.create(num_slots, layout(order).block_bytes, pinned=True)
        assert self.pool.pinned
        self.pool.buffer.raw.fill_(0xA5)
        self.segments = self.pool.segments(cache_chunks(self.cache))
        self.engine = TransferEngine(self.segments, make_backend(backend))

    def close(self) -> None:
        self.engine.close()
        self.pool.close()

    def results(self) -> dict:
        return {r.job_id: r for r in self.engine.get_finished()}

    def cache_cpu(self) -> torch.Tensor:
        torch.cuda.synchronize()
        return self.cache.raw.cpu()


@pytest.mark.parametrize("backend", ["auto", "dma", "dma-cuda12", "dma-loop", "sm", "vllm"])
@pytest.mark.parametrize("order", ["BLNHC", "LBHNC", "LHBNC"])
def test_round_trip_bit_exact(order: str, backend: str) -> None:
    r = Rig(order, backend)
    try:
        rng = np.random.default_rng(0)
        n = 24
        gpu_ids = rng.choice(64, n, replace=False).tolist()
        slots = rng.choice(48, n, replace=False).tolist()
        cache_before = r.cache_cpu()
        pool_want = r.pool.buffer.raw.clone()
        for seg in r.segments:
            src = host_copy(seg.gpu, r.cache.raw, cache_before)
            host_copy(seg.host, r.pool.buffer.raw, pool_want)[slots] = src[gpu_ids]
        assert r.engine.submit_store(1, gpu_ids, slots)
        assert r.engine.wait([1], TIMEOUT)
        res = r.results()[1]
        assert res.ok and res.nbytes == n * r.pool.block_bytes and res.seconds > 0
        assert torch.equal(r.pool.buffer.raw, pool_want)

        r.cache.raw.fill_(POISON)
        poisoned = r.cache_cpu()  # synchronises: the load must not race the fill
        targets = rng.choice(64, n, replace=False).tolist()
        cache_want = poisoned.clone()
        for seg in r.segments:
            host_copy(seg.gpu, r.cache.raw, cache_want)[targets] = \
                host_copy(seg.gpu, r.cache.raw, cache_before)[gpu_ids]
        assert r.engine.submit_load(2, slots, targets)
        assert r.engine.wait([2], TIMEOUT)
        assert r.results()[2].ok
        assert torch.equal(r.cache_cpu(), cache_want)
        # vLLM, and "auto" as vLLM does, load pages under 28 KiB (LHBNC: 8 KiB rows) on the SMs.
        if backend == "vllm":
            assert r.engine.backend.sm_jobs == (1 if order == "LHBNC" else 0)
        if backend == "auto":
            small = n * len(r.segments) if order == "LHBNC" else 0
            assert r.engine.backend.sm_load_copies == small
    finally:
        r.close()


@pytest.mark.parametrize("backend", ["dma", "sm"])
def test_store_sees_what_the_compute_stream_wrote(backend: str) -> None:
    r = Rig("BLNHC", backend)
    gate = ComputeGate()
    compute = torch.cuda.Stream()
    try:
        rows = r.cache.block_chunks()
        # Warm-up: the first job allocates (descriptor tables for "sm"); not under the gate.
        assert r.engine.submit_store(99, [0], [0]) and r.engine.wait(None, TIMEOUT)
        r.results()
        original = rows[9].cpu()
        # Held: the compute stream cannot have run the write when the store is submitted.
        with torch.cuda.stream(compute):
            gate.close_on(compute)
            rows[9].bitwise_not_()
            assert r.engine.submit_store(1, [9], [3])
        gate.open()
        assert r.engine.wait([1], TIMEOUT) and r.results()[1].ok
        assert torch.equal(r.pool.slots[3], torch.bitwise_not(original))

        # Unheld: a long matmul chain, then a kernel writing the block, then the store at once.
        x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
        out = rows[20][: 256 * 256 * 2].view(torch.bfloat16).view(256, 256)
        for _ in range(20):
            x = x @ x
            x = x / x.abs().amax().clamp(min=1)
        torch.matmul(x[:256, :256], x[:256, :256], out=out)
        assert r.engine.submit_store(2, [20], [4])
        assert r.engine.wait([2], TIMEOUT) and r.results()[2].ok
        assert torch.equal(r.pool.slots[4], rows[20].cpu())
    finally:
        gate.open()
        r.close()


@pytest.mark.parametrize("backend", ["dma", "sm"])
def test_load_waits_for_the_store_of_its_slot_only(backend: str) -> None:
    r = Rig("BLNHC", backend)
    gate = ComputeGate()
    compute = torch.cuda.Stream()
    try:
        rows = r.cache.block_chunks()
        r.pool.slots[2].copy_(random_bytes(r.pool.block_bytes, 5))
        for job in (100, 101):  # warm-up off the gate: the load lane and a spare lane allocate
            assert r.engine.submit_load(job, [0], [63])
        assert r.engine.wait(None, TIMEOUT)
        r.results()
        rows[40].fill_(POISON)
        rows[41].fill_(POISON)
        block5 = rows[5].cpu()
        torch.cuda.synchronize()
        # Jobs follow the stream current at submit: the store is held by the gated stream, the
        # loads are submitted from the (ungated) default stream.
        with torch.cuda.stream(compute):
            gate.close_on(compute)
            assert r.engine.submit_store(1, [5], [7])  # held behind the gate
        assert r.engine.submit_load(2, [7], [40])  # must wait for the store of slot 7
        assert r.engine.submit_load(3, [2], [41])  # must not
        assert r.engine.wait([3], TIMEOUT)
        assert r.engine.wait([1, 2], timeout=0) is False
        assert set(r.results()) == {3}
        gate.open()
        assert r.engine.wait(None, TIMEOUT)
        res = r.results()
        assert res[1].ok and res[2].ok
        assert torch.equal(rows[40].cpu(), block5)
        assert torch.equal(rows[41].cpu(), r.pool.slots[2])
    finally:
        gate.open()
        r.close()


def test_auto_splits_a_load_between_the_sms_and_dma_bit_exact() -> None:
    """Segments of 8 KiB and 64 KiB rows in one job: the small ones load on the SMs, the rest by
    DMA, every byte right; a load of fewer than 16 small copies goes by DMA alone."""
    from transfer.copy.base import Segment
    from transfer.copy.factory import make_backend

    small, large, blocks, slots = 8 << 10, 64 << 10, 64, 48
    pool = HostPool.create(slots, small + large, pinned=True)
    gpu = [random_bytes(blocks * w, 11 + i).cuda().view(blocks, w)
           for i, w in enumerate((small, large))]
    host = pool.slots
    segments = [Segment(gpu[0], host[:, :small]), Segment(gpu[1], host[:, small:])]
    engine = TransferEngine(segments, make_backend("auto", "cuda"))
    try:
        assert engine.backend.sm is not None
        rng = np.random.default_rng(3)
        ids, to = rng.choice(blocks, 20, replace=False), rng.choice(slots, 20, replace=False)
        assert engine.submit_store(1, ids.tolist(), to.tolist()) and engine.wait([1], TIMEOUT)
        want = [g.cpu() for g in gpu]
        for g in gpu:
            g.fill_(POISON)
        targets = rng.choice(blocks, 20, replace=False)
        assert engine.submit_load(2, to.tolist(), targets.tolist())
        assert engine.wait([2], TIMEOUT)
        assert engine.backend.sm_load_copies == 20  # the 8 KiB segment's copies only
        for g, w in zip(gpu, want, strict=True):
            expect = torch.full_like(w, POISON)
            expect[targets] = w[ids]
            assert torch.equal(g.cpu(), expect)
        assert engine.submit_load(3, to[:10].tolist(), ids[:10].tolist())  # 10 small copies
        assert engine.wait([3], TIMEOUT)
        assert engine.backend.sm_load_copies == 20
        assert all(torch.equal(g[ids[:10]].cpu(), w[ids[:10]]) for g, w in zip(gpu, want,
                                                                              strict=True))
        assert all(r.ok for r in engine.get_finished())
    finally:
        engine.close()
        pool.close()


def _small_page_rig(backend: CopyBackend, width: int = 8 << 10, blocks: int = 64,
                    slots: int = 48) -> tuple[TransferEngine, torch.Tensor, torch.Tensor]:
    """One segment of `width`-byte rows: GPU rows of random bytes, pinned host rows poisoned."""
    from transfer.copy.base import Segment

    gpu = random_bytes(blocks * width, 21).cuda().view(blocks, width)
    host = torch.empty(slots, width, dtype=torch.uint8, pin_memory=True).fill_(0xA5)
    return TransferEngine([Segment(gpu, host)], backend), gpu, host


def test_auto_sm_load_waits_for_the_dma_store_of_its_slot() -> None:
    """A load on the SMs ("auto", 8 KiB rows) of a slot a DMA store is still writing waits for
    it, on another lane; a second store to the slot and a second load see the new bytes."""
    from transfer.copy.factory import make_backend

    engine, gpu, host = _small_page_rig(make_backend("auto", "cuda"))
    gate, compute = ComputeGate(), torch.cuda.Stream()
    try:
        assert engine.backend.sm is not None
        for job in (100, 101):  # warm-up off the gate: lanes and descriptor tables allocate
            assert engine.submit_load(job, list(range(16)), list(range(48, 64)))
        assert engine.wait(None, TIMEOUT) and all(r.ok for r in engine.get_finished())
        src, slots, dst = list(range(16)), list(range(16, 32)), list(range(32, 48))
        with torch.cuda.stream(compute):
            gate.close_on(compute)
            # Held: runs only after the gate opens. A slice, not a list: indexing with a list
            # copies the index to the GPU on this (held) stream and would wait for the gate.
            gpu[:16].bitwise_not_()
            assert engine.submit_store(1, src, slots)
        assert engine.submit_load(2, slots, dst)  # 16 copies of 8 KiB: the SMs
        assert engine.wait([1, 2], timeout=0.5) is False
        gate.open()
        assert engine.wait([1, 2], TIMEOUT) and all(r.ok for r in engine.get_finished())
        assert torch.equal(gpu[dst].cpu(), gpu[src].cpu())
        gpu[:16].bitwise_not_()
        assert engine.submit_store(3, src, slots) and engine.submit_load(4, slots, dst)
        assert engine.wait([3, 4], TIMEOUT) and all(r.ok for r in engine.get_finished())
        assert torch.equal(gpu[dst].cpu(), gpu[src].cpu())
        assert torch.equal(host[slots], gpu[src].cpu())
        assert engine.backend.sm_load_copies == 16 * 4
    finally:
        gate.open()
        engine.close()


def test_sm_copy_on_few_sms_copies_unaligned_rows_bit_exact() -> None:
    """Rows of 8200 bytes (not 16-byte multiples) take the kernel's byte loop, 4 teams a block."""
    from transfer.copy.cuda import SmCopyBackend

    engine, gpu, host = _small_page_rig(SmCopyBackend("cuda", sms=12), width=8200)
    try:
        rng = np.random.default_rng(5)
        ids, slots = rng.choice(64, 40, replace=False), rng.choice(48, 40, replace=False)
        want_host = host.clone()
        want_host[slots] = gpu[ids].cpu()
        assert engine.submit_store(1, ids.tolist(), slots.tolist()) and engine.wait([1], TIMEOUT)
        assert torch.equal(host, want_host)
        back = ids[::-1].copy()
        want_gpu = torch.full_like(gpu, POISON).cpu()
        want_gpu[back] = host[slots]
        gpu.fill_(POISON)
        assert engine.submit_load(2, slots.tolist(), back.tolist())
        assert engine.wait([2], TIMEOUT) and all(r.ok for r in engine.get_finished())
        assert torch.equal(gpu.cpu(), want_gpu)
    finally:
        engine.close()


def test_sm_copy_refuses_an_unpinned_pool() -> None:
    from transfer.copy.cuda import SmCopyBackend

    cache = allocate(layout("BLNHC"), num_blocks=4, device="cuda")
    pool = HostPool.create(4, layout("BLNHC").block_bytes, pinned=False)
    try:
        with pytest.raises(ValueError, match="not pinned memory"):
            TransferEngine(pool.segments([cache.block_chunks()]), SmCopyBackend("cuda"))
    finally:
        pool.close()


def _child(name: str, order: str, slots: list[int], seed_in: int, out_slots: list[int],
           seed_out: int) -> None:
    pool = HostPool.attach(name, pinned=True)
    cache = allocate(layout(order), num_blocks=8, device="cuda")
    engine = TransferEngine(pool.segments(cache_chunks(cache)))
    try:
        cache.raw.fill_(POISON)
        torch.cuda.synchronize()
        if not (engine.submit_load(1, slots, list(range(len(slots))))
                and engine.wait(None, TIMEOUT) and engine.get_finished()[0].ok):
            raise SystemExit(3)
        rows = cache.block_chunks()
        for i in range(len(slots)):
            if not torch.equal(rows[i].cpu(), random_bytes(pool.block_bytes, seed_in + i)):
                raise SystemExit(4)
        for i in range(len(out_slots)):
            rows[i].copy_(random_bytes(pool.block_bytes, seed_out + i).cuda())
        if not (engine.submit_store(2, list(range(len(out_slots))), out_slots)
                and engine.wait(None, TIMEOUT) and engine.get_finished()[0].ok):
            raise SystemExit(5)
    finally:
        engine.close()
        pool.close()


def test_shared_pool_registered_and_used_from_two_processes() -> None:
    name = f"kvc-gpu-{uuid.uuid4().hex[:12]}"
    pool = HostPool.create(16, layout("BLNHC").block_bytes, pinned=True, shared_name=name)
    cache = allocate(layout("BLNHC"), num_blocks=8, device="cuda")
    engine = TransferEngine(pool.segments(cache_chunks(cache)))
    try:
        rows = cache.block_chunks()
        for i in range(3):
            rows[i].copy_(random_bytes(pool.block_bytes, 100 + i).cuda())
        assert engine.submit_store(1, [0, 1, 2], [9, 2, 14])
        assert engine.wait(None, TIMEOUT) and engine.get_finished()[0].ok

        proc = mp.get_context("spawn").Process(
            target=_child, args=(name, "BLNHC", [9, 2, 14], 100, [5, 11], 200))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0

        cache.raw.fill_(POISON)
        torch.cuda.synchronize()
        assert engine.submit_load(2, [5, 11], [6, 3])
        assert engine.wait(None, TIMEOUT) and engine.get_finished()[0].ok
        assert torch.equal(rows[6].cpu(), random_bytes(pool.block_bytes, 200))
        assert torch.equal(rows[3].cpu(), random_bytes(pool.block_bytes, 201))
        assert torch.equal(rows[0].cpu(), torch.full_like(rows[0].cpu(), POISON))
    finally:
        engine.close()
        pool.close(unlink=True)
