"""The vLLM-free worker core, driven with the scheduler core by a stand-in engine step.

Caches come from our allocator (block-major and layer-major orders); every loaded byte is
compared with what was written, after poisoning the destination. The `gpu` test runs the same
round trip on CUDA with a pinned pool and a kernel writing the KV.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import KVLayout
from kvconnector.offload.jobs import StepJobs, TransferEvents
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import BLOCK_MAJOR, PER_LAYER, OffloadWorker
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace

BS = 4
NUM_BLOCKS = 12
POISON = 0xA5
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")


def make_caches(order: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=8, block_size=BS,
                      dtype=torch.bfloat16, order=order)
    buf = allocate(layout, num_blocks=NUM_BLOCKS, device=device)
    return {f"layer.{i}": view for i, view in enumerate(buf.layer_views())}


def block_bytes(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [view[block].view(torch.uint8) for view in caches.values()]


def fill_random(caches: dict[str, torch.Tensor], blocks: list[int], seed: int
                ) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    written = []
    for b in blocks:
        per_layer = []
        for page in block_bytes(caches, b):
            data = torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen)
            page.copy_(data.to(page.device))
            per_layer.append(data)
        written.append(per_layer)
    return written


def poison(caches: dict[str, torch.Tensor], blocks: list[int]) -> None:
    for b in blocks:
        for page in block_bytes(caches, b):
            page.fill_(POISON)


def assert_blocks_equal(caches: dict[str, torch.Tensor], blocks: list[int],
                        expected: list[list[torch.Tensor]]) -> None:
    for b, want in zip(blocks, expected, strict=True):
        for layer, (page, data) in enumerate(zip(block_bytes(caches, b), want, strict=True)):
            assert torch.equal(page.cpu(), data), f"block {b} layer {layer} differs"


def run_step(core: OffloadScheduler, worker: OffloadWorker) -> tuple[StepJobs, TransferEvents]:
    """One stand-in engine step: plan, flush, (forward), loads, stores, wait, report."""
    step = core.build_step()
    worker.flush(step)
    worker.start_loads(step)
    worker.submit_stores(step)
    worker.drain()
    events = worker.poll()
    core.complete(worker.take_report())
    return step, events


def round_trip(caches: dict[str, torch.Tensor], worker: OffloadWorker, written_blocks: list[int],
               load_blocks: list[int]) -> None:
    core = OffloadScheduler(NS, worker.pool.num_slots, BS, 1)
    hashes = [f"h{i}".encode() for i in range(len(written_blocks))]
    written = fill_random(caches, written_blocks, seed=1)
    core.plan_stores("a", hashes, written_blocks, len(hashes) * BS)
    step, _ = run_step(core, worker)
    assert len(step.stores) == 1 and not core.has_jobs()
    poison(caches, written_blocks + load_blocks)
    assert core.lookup("b", hashes, 0, len(hashes) * BS + 1) == len(hashes) * BS
    core.plan_load("b", hashes, load_blocks, len(hashes) * BS)
    step, events = run_step(core, worker)
    assert events.finished_loads == {"b"} and not events.failed_loads
    assert_blocks_equal(caches, load_blocks, written)
    # The poisoned source blocks were not written by the load.
    for b in written_blocks:
        assert all(bool((page == POISON).all()) for page in block_bytes(caches, b))


@pytest.mark.parametrize(("order", "mode", "copies"), [
    ("BLNHC", BLOCK_MAJOR, 1), ("BLHNC", BLOCK_MAJOR, 1),
    ("LBNHC", PER_LAYER, 3), ("LHBNC", PER_LAYER, 3 * 2)])
def test_store_poison_load_every_byte(order: str, mode: str, copies: int) -> None:
    caches = make_caches(order)
    worker = OffloadWorker(caches, num_slots=6)
    try:
        assert (worker.mode, worker.copies_per_block) == (mode, copies)
        assert (worker.reason is None) == (mode == BLOCK_MAJOR)
        assert worker.block_bytes == 3 * 2 * BS * 16 * 2
        assert worker.pool.pinned == torch.cuda.is_available()  # the default: pinned on CUDA
        round_trip(caches, worker, written_blocks=[7, 2, 9], load_blocks=[1, 11, 4])
    finally:
        worker.close()


def test_describe_names_the_mode_and_the_reason() -> None:
    worker = OffloadWorker(make_caches("LBNHC"), num_slots=2)
    try:
        line = worker.describe()
        memory = "pinned" if torch.cuda.is_available() else "pageable"
        assert line.startswith(f"per-layer: 3 copies per block; 2 {memory} host slots of 768 B")
        assert "layer-major" in line
    finally:
        worker.close()


class Gate:
    """Holds chosen jobs on the copy thread until released; fails others on request."""

    def __init__(self) -> None:
        self.hold: dict[int, threading.Event] = {}
        self.fail: set[int] = set()

    def __call__(self, job_id: int) -> None:
        if job_id in self.fail:
            raise RuntimeError(f"injected failure of job {job_id}")
        if job_id in self.hold:
            self.hold[job_id].wait()


def test_held_request_finishes_sending_only_after_its_store() -> None:
    gate = Gate()
    caches = make_caches("BLNHC")
    worker = OffloadWorker(caches, num_slots=6, backend=ThreadBackend(gate))
    core = OffloadScheduler(NS, 6, BS, 1)
    try:
        hashes = [b"x0", b"x1"]
        written = fill_random(caches, [3, 5], seed=2)
        core.plan_stores("a", hashes, [3, 5], BS)
        gate.hold[0] = threading.Event()
        step = core.build_step()
        worker.submit_stores(step)
        assert core.request_finished("a", hashes, [3, 5], 2 * BS) is True
        step = core.build_step()
        assert step.held == ["a"] and len(step.stores) == 1
        worker.submit_stores(step)
        assert worker.poll().finished_sending == set()  # job 0 is held on the copy thread
        assert worker.jobs_in_flight >= 1
        gate.hold[0].set()
        worker.drain()
        assert worker.poll().finished_sending == {"a"}
        core.complete(worker.take_report())
        assert not core.has_jobs()
        # What was stored is what the blocks held when the store was submitted.
        poison(caches, [3, 5])
        core.lookup("b", hashes, 0, 100)
        core.plan_load("b", hashes, [0, 1], 2 * BS)
        run_step(core, worker)
        assert_blocks_equal(caches, [0, 1], written)
    finally:
        worker.close()


def test_flush_waits_for_a_preempted_request_store() -> None:
    gate = Gate()
    caches = make_caches("BLNHC")
    worker = OffloadWorker(caches, num_slots=6, backend=ThreadBackend(gate))
    core = OffloadScheduler(NS, 6, BS, 1)
    try:
        written = fill_random(caches, [2], seed=3)
        core.plan_stores("a", [b"p0"], [2], BS)
        gate.hold[0] = threading.Event()
        worker.submit_stores(core.build_step())
        core.request_preempted("a")
        step = core.build_step()
        assert step.flush == [0]
        gate.hold[0].set()
        worker.flush(step)  # returns only once the store is done
        poison(caches, [2])  # the forward may now write the freed block
        assert worker.engine.wait([0], timeout=0)
        worker.poll()
        core.complete(worker.take_report())
        core.lookup("b", [b"p0"], 0, 100)
        core.plan_load("b", [b"p0"], [6], BS)
        run_step(core, worker)
        assert_blocks_equal(caches, [6], written)
    finally:
        worker.close()


def test_failed_load_is_finished_failed_and_names_its_blocks() -> None:
    gate = Gate()
    caches = make_caches("BLNHC")
    worker = OffloadWorker(caches, num_slots=6, backend=ThreadBackend(gate))
    core = OffloadScheduler(NS, 6, BS, 1)
    try:
        fill_random(caches, [1, 2], seed=4)
        core.plan_stores("a", [b"f0", b"f1"], [1, 2], 2 * BS)
        run_step(core, worker)
        poison(caches, [8, 9])
        core.lookup("b", [b"f0", b"f1"], 0, 100)
        core.plan_load("b", [b"f0", b"f1"], [8, 9], 2 * BS)
        gate.fail.add(1)
        _, events = run_step(core, worker)
        assert events.finished_loads == {"b"} and events.failed_loads == {"b"}
        assert events.failed_block_ids == {8, 9}
        assert core.take_counters().failed_loads == 1
        assert all(bool((page == POISON).all()) for b in (8, 9) for page in block_bytes(caches, b))
    finally:
        worker.close()


def test_store_dropped_under_pressure_is_reported_failed() -> None:
    gate = Gate()
    caches = make_caches("BLNHC")
    worker = OffloadWorker(caches, num_slots=6, backend=ThreadBackend(gate), max_store_bytes=1)
    core = OffloadScheduler(NS, 6, BS, 1)
    try:
        gate.hold[0] = threading.Event()
        core.plan_stores("a", [b"d0"], [1], BS)
        core.plan_stores("b", [b"e0"], [2], BS)
        worker.submit_stores(core.build_step())
        gate.hold[0].set()
        worker.drain()
        worker.poll()
        report = worker.take_report()
        assert (report.done, report.failed) == ({0: 1}, {1: 1})
        core.complete(report)
        assert core.take_counters().failed_stores == 1
        assert core.lookup("c", [b"d0"], 0, 100) == BS and core.lookup("c", [b"e0"], 0, 100) == 0
    finally:
        worker.close()


def test_refuses_caches_without_layer_views() -> None:
    raw = torch.zeros(4096, dtype=torch.int8)
    with pytest.raises(ValueError, match="no KV cache layer to offload"):
        OffloadWorker({"mamba": raw}, num_slots=2)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["BLNHC", "LBNHC"])
def test_gpu_kernel_writes_store_poison_load(order: str) -> None:
    """On CUDA with a pinned pool: a kernel writes KV, store, poison, load, compare bytes."""
    caches = make_caches(order, device="cuda")
    worker = OffloadWorker(caches, num_slots=8)
    core = OffloadScheduler(NS, 8, BS, 1)
    try:
        assert worker.pool.pinned
        assert worker.mode == (BLOCK_MAJOR if order == "BLNHC" else PER_LAYER)
        written_blocks, load_blocks = [5, 0, 10], [3, 8, 1]
        hashes = [f"g{i}".encode() for i in range(3)]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # a "forward" on a compute stream: the store follows it
            for layer, view in enumerate(caches.values()):
                for i, b in enumerate(written_blocks):
                    values = torch.arange(view[b].numel(), device="cuda", dtype=torch.float32)
                    view[b].copy_((values * (layer + 1) + i * 0.5).reshape(view[b].shape))
            core.plan_stores("a", hashes, written_blocks, 3 * BS)
            step = core.build_step()
            worker.submit_stores(step)
        worker.drain()
        worker.poll()
        core.complete(worker.take_report())
        torch.cuda.synchronize()
        expected = [[p.cpu().clone() for p in block_bytes(caches, b)] for b in written_blocks]
        poison(caches, written_blocks + load_blocks)
        torch.cuda.synchronize()
        core.lookup("b", hashes, 0, 100)
        core.plan_load("b", hashes, load_blocks, 3 * BS)
        _, events = run_step(core, worker)
        assert events.finished_loads == {"b"} and not events.failed_loads
        torch.cuda.synchronize()
        assert_blocks_equal(caches, load_blocks, expected)
        counters = core.take_counters()
        assert counters.load_bytes == counters.store_bytes == 3 * worker.block_bytes
    finally:
        worker.close()
