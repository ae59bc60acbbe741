"""Measure one case: both layouts, one way each direction, bidirectional, host cost, prefix load.

Buffers are carved out of two arenas allocated once per run (the device cache side and the host
pool side), so pinning cost is paid once and every case sees the same memory. A case is measured
a layout at a time (the run takes a ceiling round before each); ratios are taken against the
run's ceilings once all rounds are in.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import torch

from kvconnector.bench.ceilings import Ceilings
from kvconnector.bench.movers import EngineMover, segments_for
from kvconnector.bench.presets import Case
from kvconnector.bench.sizing import (
    BenchError,
    blocks_for_tokens,
    disjoint_id_sets,
    format_bytes,
)
from kvconnector.layout.allocator import KVBuffer, SlotBuffer, allocate_slots, slot_stride
from kvconnector.layout.descriptor import HOST_ALIGNMENT
from transfer.copy.base import Segment
from transfer.pool import HostPool

_ARENA_ROW = 1 << 20  # arenas are allocated as rows of 1 MiB
CHECKED_BLOCKS = 4  # blocks whose bytes are compared after the warm-up round trip
# Both ways at once: each direction's blocks as this many jobs, submitted in turns (a store, a
# load, a store...), as a node serving several requests has them in flight. A job's copies
# are all issued by its submit, so of two lone whole jobs the second starts one submit late
# (~0.6 ms for 1024 blocks): `bidir_pair` keeps that figure.
BOTH_WAYS_JOBS = 4
LAYOUTS = ("block_major", "layer_major")

@dataclass
class Arenas:
    device: torch.Tensor  # 1-D uint8: GPU memory, or host memory standing in for it on a CPU
    host: torch.Tensor  # 1-D uint8: pinned on CUDA
    pinned: bool
    ready_s: float  # time to allocate, first-touch and pin both
    _keep: list[SlotBuffer] = field(default_factory=list, repr=False)

    def close(self) -> None:
        _release(self._keep)
        self._keep = []


def _release(buffers: list[SlotBuffer]) -> None:
    for buf in buffers:
        if buf.pinned:  # the arena's own registration (see allocate_arenas)
            torch.cuda.cudart().cudaHostUnregister(buf.raw.data_ptr())
            buf.pinned = False
        buf.close()


def allocate_arenas(side_bytes: int, device: torch.device) -> Arenas:
    """Two arenas of `side_bytes` each; BenchError (exit 2) when memory cannot be had."""
    rows = side_bytes // _ARENA_ROW
    if rows < 2:
        raise BenchError(f"budget per side {format_bytes(side_bytes)} is below 2 MiB")
    t0 = time.perf_counter()
    keep: list[SlotBuffer] = []
    try:
        keep.append(allocate_slots(rows, _ARENA_ROW, device=device))
        keep.append(allocate_slots(rows, _ARENA_ROW, device="cpu"))
        if device.type == "cuda":
            # Cases carve pools of every block size out of this arena; one copy may not straddle
            # two cudaHostRegister ranges, so the arena is registered as one range.
            err = torch.cuda.cudart().cudaHostRegister(keep[1].raw.data_ptr(), rows * _ARENA_ROW, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the host arena failed: {err}")
            keep[1].pinned = True
    except (OSError, MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        _release(keep)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BenchError(f"cannot allocate 2 x {format_bytes(rows * _ARENA_ROW)} "
                         f"({device.type} + host): {reason}") from None
    return Arenas(keep[0].raw, keep[1].raw, keep[1].pinned, time.perf_counter() - t0, keep)


def case_capacity(case: Case, arenas: Arenas) -> int:
    """Blocks one side holds (same count on both sides)."""
    lay = case.layout.with_alignment(HOST_ALIGNMENT)
    return min(arenas.device.numel(), arenas.host.numel()) // lay.block_stride_bytes


def case_segments(case: Case, arenas: Arenas, capacity: int, layer_major: bool) -> list[Segment]:
    """A cache of `capacity` blocks in the device arena and a pool of as many in the host arena."""
    block_bytes = case.layout.block_bytes
    stride = slot_stride(block_bytes)
    cache_layout = case.layer_major if layer_major else case.layout.with_alignment(HOST_ALIGNMENT)
    cache_raw = arenas.device[: cache_layout.buffer_bytes(capacity)]
    pool_raw = arenas.host[: capacity * stride]
    cache = KVBuffer(cache_layout, capacity, cache_raw)
    pool = HostPool(SlotBuffer(capacity, block_bytes, stride, pool_raw, pinned=arenas.pinned))
    return segments_for(cache, pool)


@dataclass
class Rate:
    gbps: float
    seconds: list[float]  # every timed repeat; gbps uses the median


@dataclass
class LayoutResult:
    row_bytes: int  # bytes per copy: the block (block-major) or the page (layer-major)
    copies_per_job: int
    h2d: Rate
    d2h: Rate
    bidir: Rate  # BOTH_WAYS_JOBS jobs each way, submitted in turns
    bidir_pair: Rate  # one whole store job, then one whole load job
    host_us_per_block: float  # host time inside submit calls, per block submitted
    prefix_tokens: int
    prefix_blocks: int
    prefix_ms: float


def _rate(nbytes: int, seconds: list[float]) -> Rate:
    return Rate(nbytes / statistics.median(seconds) / 1e9, seconds)


class CaseRun:
    """One case: the same random ids for both layouts, each measured by `measure(layout)`."""

    def __init__(self, case: Case, arenas: Arenas, blocks: int, prefix_tokens: int,
                 repeats: int, seed: int) -> None:
        self.case, self.arenas, self.blocks, self.repeats = case, arenas, blocks, repeats
        self.capacity = case_capacity(case, arenas)
        rng = random.Random(seed)
        self.ids = {side: disjoint_id_sets(rng, blocks, self.capacity) for side in ("dev", "host")}
        prefix_blocks = blocks_for_tokens(prefix_tokens, case.layout.block_size)
        self.prefix_tokens = prefix_tokens
        self.prefix = {side: rng.sample(range(0, self.capacity, 2), prefix_blocks)
                       for side in ("dev", "host")}
        self.movers: dict[str, str] = {}
        self.results: dict[str, LayoutResult] = {}

    def measure(self, name: str) -> None:
        segments = case_segments(self.case, self.arenas, self.capacity,
                                 layer_major=name == "layer_major")
        # Layer-major is the baseline: the copies vLLM itself would issue for it.
        mover = EngineMover(segments, "vllm" if name == "layer_major" else "auto")
        self.movers[name] = mover.name
        try:
            self.results[name] = _measure_layout(self.case, segments, mover, self.ids,
                                                 self.prefix, self.prefix_tokens, self.repeats)
        finally:
            mover.close()

    def as_dict(self, ceilings: Ceilings) -> dict[str, Any]:
        """The case's record, every figure with its ratio of the run's ceilings."""
        layouts = {}
        for name, result in self.results.items():
            r = asdict(result)
            for key, ceiling in (("h2d", ceilings.h2d_gbps), ("d2h", ceilings.d2h_gbps),
                                 ("bidir", ceilings.bidir_gbps),
                                 ("bidir_pair", ceilings.bidir_gbps)):
                r[key]["ratio"] = r[key]["gbps"] / ceiling
            r["host_ratio"] = result.host_us_per_block / ceilings.plain_call_us
            # ideal time at the load ceiling / measured time
            prefix_bytes = result.prefix_blocks * self.case.layout.block_bytes
            r["prefix_ratio"] = prefix_bytes / (ceilings.h2d_gbps * 1e9) / (result.prefix_ms / 1e3)
            layouts[name] = r
        return {"case": self.case.describe(), "capacity": self.capacity, "blocks": self.blocks,
                "mover": self.movers["block_major"], "baseline": self.movers["layer_major"],
                "layouts": layouts}


def _measure_layout(case: Case, segments: list[Segment], mover: EngineMover,
                    ids: dict[str, tuple[list[int], list[int]]],
                    prefix: dict[str, list[int]], prefix_tokens: int,
                    repeats: int) -> LayoutResult:
    (a_dev, b_dev), (a_host, b_host) = ids["dev"], ids["host"]
    job_bytes = len(a_dev) * case.layout.block_bytes
    check_round_trip(segments, mover, a_dev, a_host, b_dev)

    submit_s: list[float] = []

    def one_job(submit: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        job = submit()
        t1 = time.perf_counter()
        mover.wait([job])
        submit_s.append(t1 - t0)
        return time.perf_counter() - t0

    h2d, d2h = [], []
    for _ in range(repeats):
        d2h.append(one_job(lambda: mover.store(a_dev, a_host)))
        h2d.append(one_job(lambda: mover.load(a_host, a_dev)))

    def both_ways(jobs_each_way: int) -> float:
        count = min(jobs_each_way, len(a_dev))
        bounds = [len(a_dev) * j // count for j in range(count + 1)]  # as even as they go
        t0 = time.perf_counter()
        jobs = []
        for start, end in pairwise(bounds):
            part = slice(start, end)
            jobs += [mover.store(a_dev[part], a_host[part]), mover.load(b_host[part], b_dev[part])]
        mover.wait(jobs)
        return time.perf_counter() - t0

    bidir, bidir_pair = [], []
    for _ in range(repeats):  # in turns: a drift in time reaches both figures alike
        bidir.append(both_ways(BOTH_WAYS_JOBS))
        bidir_pair.append(both_ways(1))

    prefix_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mover.wait([mover.load(prefix["host"], prefix["dev"])])
        prefix_s.append(time.perf_counter() - t0)

    return LayoutResult(
        row_bytes=segments[0].nbytes,
        copies_per_job=len(segments) * len(a_dev),
        h2d=_rate(job_bytes, h2d),
        d2h=_rate(job_bytes, d2h),
        bidir=_rate(2 * job_bytes, bidir),
        bidir_pair=_rate(2 * job_bytes, bidir_pair),
        host_us_per_block=statistics.median(submit_s) / len(a_dev) * 1e6,
        prefix_tokens=prefix_tokens,
        prefix_blocks=len(prefix["dev"]),
        prefix_ms=statistics.median(prefix_s) * 1e3,
    )


def check_round_trip(segments: list[Segment], mover: EngineMover, a_dev: list[int],
                     a_host: list[int], b_dev: list[int]) -> None:
    """Random bytes into a few device blocks, store them, load them elsewhere, compare every byte.

    Also the warm-up: the first jobs on a fresh mover pay one-time costs outside the timings.
    """
    n = min(CHECKED_BLOCKS, len(a_dev))
    device = segments[0].gpu.device
    gen = torch.Generator(device=device).manual_seed(n)
    for seg in segments:
        for d in a_dev[:n]:
            seg.gpu[d].copy_(torch.randint(0, 256, seg.gpu[d].shape, dtype=torch.uint8,
                                           generator=gen, device=device))
    mover.wait([mover.store(a_dev, a_host)])
    mover.wait([mover.load(a_host, b_dev)])
    for layer, seg in enumerate(segments):
        for i in range(n):
            sent = seg.gpu[a_dev[i]].cpu()
            if not (torch.equal(seg.host[a_host[i]], sent)
                    and torch.equal(seg.gpu[b_dev[i]].cpu(), sent)):
                raise RuntimeError(f"copy check failed: block {a_dev[i]} -> slot {a_host[i]} "
                                   f"-> block {b_dev[i]} differs (segment {layer})")
