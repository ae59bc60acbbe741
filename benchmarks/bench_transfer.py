"""Transfer-engine figures of issue 3 that `kvconnector bench` does not cover.

1. GEMM slowdown: a bf16 GEMM loop timed alone, then while the engine moves blocks both ways at
   full rate (batched DMA over block-major and layer-major caches; the SM RawKernel copy on every
   SM over the layer-major one; for 8 KiB pages, DMA against "auto", whose loads run on 12 SMs).
   Target: DMA slows the GEMM <= 3%; the SM copies' slowdown is reported.
2. Pinned pool ready time: HostPool.create of --pool-size (parallel first touch + chunked
   cudaHostRegister) against a plain single-threaded first-touch memset of the same size, timed
   before and after it in the same run (the faster memset is the baseline). Target >= 1.0x.
3. Batched DMA (cuMemcpyBatchAsync) vs "auto" (loads under 28 KiB on 12 SMs) vs the SM
   RawKernel copy on every SM at the fallback's page sizes (8-72 KB, one copy per layer per
   block), one way each direction, as ratios of the same-run ceiling.
Host time per block against one plain cudaMemcpyAsync is in `kvconnector bench`.

    python benchmarks/bench_transfer.py --json bench_transfer.json

Sections 1 and 3 need a CUDA GPU; without one only section 2 runs (unpinned), as a smoke test.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvconnector.bench import ceilings as ceilings_mod
from kvconnector.bench.movers import EngineMover
from kvconnector.bench.presets import Case, build_cases
from kvconnector.bench.runner import (
    allocate_arenas,
    case_capacity,
    case_segments,
    check_round_trip,
)
from kvconnector.bench.sizing import BenchError, disjoint_id_sets, format_bytes
from kvconnector.cli.units import parse_size
from kvconnector.layout.allocator import slots_in
from kvconnector.layout.descriptor import KVForm, KVLayout
from transfer.pool import HostPool

GEMM_N = 8192  # 1.1 TFLOP per GEMM: about 1.6 ms on an H200
GEMMS_PER_ROUND = 50
GEMM_ROUNDS = 7
TRAFFIC_BLOCKS = 128  # blocks per direction per job while the GEMM runs
PAGE_SIZES_KB = (8, 16, 32, 64, 72)  # the presets' per-layer pages: 70B TP8 .. DeepSeek MLA
PAGE_LAYERS = 32
PAGE_BLOCKS = 1024
ARENA_SIDE = 8 << 30


def gemm_ms(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> list[float]:
    """Per-GEMM milliseconds, one sample per round (CUDA events on the compute stream)."""
    torch.matmul(a, b, out=out)  # warm-up: cuBLAS heuristics, workspace
    samples = []
    for _ in range(GEMM_ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GEMMS_PER_ROUND):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GEMMS_PER_ROUND)
    return samples


def traffic(mover: EngineMover, side: torch.cuda.Stream, stop: threading.Event, moved: list[int],
            job_bytes: int, a_dev: list[int], a_host: list[int], b_dev: list[int],
            b_host: list[int]) -> None:
    """Both directions at once, job after job, until `stop`; `moved[0]` counts the bytes."""
    # A side stream: the engine orders stores after the *caller's* stream, and the GEMMs on the
    # default stream must not be what the stores wait for.
    with torch.cuda.stream(side):
        while not stop.is_set():
            mover.wait([mover.store(a_dev, a_host), mover.load(b_host, b_dev)])
            moved[0] += job_bytes


def gemm_slowdown(arenas: Any, ceilings: ceilings_mod.Ceilings, case: Case,
                  small_page_case: Case) -> list[dict]:
    a, b = (torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda") for _ in "ab")
    out = torch.empty_like(a)
    alone = statistics.median(gemm_ms(a, b, out))
    rows = [{"copy": "none", "gemm_ms": alone, "slowdown": 0.0}]
    small = f"layer-major, {small_page_case.name}"
    for label, case_, layer_major, backend in (
            ("DMA, block-major", case, False, "dma"),
            ("DMA, layer-major", case, True, "dma"),
            ("SM kernel on every SM, layer-major", case, True, "sm"),
            (f"DMA, {small}", small_page_case, True, "dma"),
            (f"auto (loads on 12 SMs), {small}", small_page_case, True, "auto")):
        capacity = case_capacity(case_, arenas)
        rng = random.Random(0)
        (a_dev, b_dev), (a_host, b_host) = (disjoint_id_sets(rng, TRAFFIC_BLOCKS, capacity)
                                            for _ in range(2))
        segments = case_segments(case_, arenas, capacity, layer_major)
        mover = EngineMover(segments, backend)
        check_round_trip(segments, mover, a_dev, a_host, b_dev)
        moved, stop = [0], threading.Event()
        job_bytes = 2 * TRAFFIC_BLOCKS * case_.layout.block_bytes
        args = (mover, torch.cuda.Stream(), stop, moved, job_bytes, a_dev, a_host, b_dev, b_host)
        lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-traffic")
        running = lane.submit(traffic, *args)
        try:
            time.sleep(0.2)  # traffic at steady state before the GEMMs start
            t0, m0 = time.perf_counter(), moved[0]
            loaded = statistics.median(gemm_ms(a, b, out))
            rate = (moved[0] - m0) / (time.perf_counter() - t0) / 1e9
        finally:
            stop.set()
            lane.shutdown()
            mover.close()
        running.result()  # a copy that failed under load fails the run
        rows.append({"copy": label, "gemm_ms": loaded, "slowdown": loaded / alone - 1,
                     "copy_gbps": rate, "copy_ratio": rate / ceilings.bidir_gbps})
    return rows


def first_touch_memset_s(size: int) -> float:
    """Seconds to mmap `size` bytes and memset them from one thread (every page faulted in)."""
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise BenchError(f"cannot map {format_bytes(size)} for the memset: {exc}") from None
    arr = np.frombuffer(mm, dtype=np.uint8)
    t0 = time.perf_counter()
    ctypes.memset(arr.ctypes.data, 0, size)
    seconds = time.perf_counter() - t0
    del arr
    mm.close()
    return seconds


def pool_ready(size: int, case: Case) -> dict:
    pinned = torch.cuda.is_available()
    before = first_touch_memset_s(size)
    t0 = time.perf_counter()
    try:
        block_bytes = case.layout.block_bytes
        pool = HostPool.create(slots_in(size, block_bytes), block_bytes, pinned=pinned)
    except (OSError, MemoryError, RuntimeError, ValueError) as exc:
        raise BenchError(f"cannot create a {format_bytes(size)} pool: {exc}") from None
    pool_s = time.perf_counter() - t0
    pool.close()
    after = first_touch_memset_s(size)
    memset_s = min(before, after)
    return {"bytes": size, "pinned": pinned, "pool_s": pool_s, "memset_s": [before, after],
            "pool_gbps": size / pool_s / 1e9, "memset_gbps": size / memset_s / 1e9,
            "ratio": memset_s / pool_s}


def time_one_way(mover: EngineMover, dev: list[int], host: list[int],
                 repeats: int) -> dict[str, list[float]]:
    """Wall seconds of a store job and a load job of the same ids, `repeats` times each."""
    times: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(repeats):
        for op in ("store", "load"):
            t0 = time.perf_counter()
            mover.wait([mover.store(dev, host) if op == "store" else mover.load(host, dev)])
            times[op].append(time.perf_counter() - t0)
    return times


def page_sweep(arenas: Any, ceilings: ceilings_mod.Ceilings, repeats: int) -> list[dict]:
    rows = []
    for kb in PAGE_SIZES_KB:
        # uint8 MLA-form rows with one token per block: a page is exactly head_size bytes.
        layout = KVLayout(PAGE_LAYERS, 1, kb << 10, 1, torch.uint8, KVForm.MLA, "BLNHC")
        case = Case(f"{kb} KB pages x {PAGE_LAYERS} layers", "synthetic", layout)
        capacity = case_capacity(case, arenas)
        blocks = min(PAGE_BLOCKS, capacity // 2)
        (a_dev, b_dev), (a_host, _) = (disjoint_id_sets(random.Random(kb), blocks, capacity)
                                       for _ in range(2))
        nbytes = blocks * layout.block_bytes
        for backend in ("dma", "auto", "sm"):
            segments = case_segments(case, arenas, capacity, True)
            mover = EngineMover(segments, backend)
            try:
                check_round_trip(segments, mover, a_dev, a_host, b_dev)
                times = time_one_way(mover, a_dev, a_host, repeats)
            finally:
                mover.close()
            row: dict[str, Any] = {"page_bytes": kb << 10, "backend": mover.name,
                                   "blocks": blocks, "copies_per_job": blocks * PAGE_LAYERS}
            for op, ceiling in (("load", ceilings.h2d_gbps), ("store", ceilings.d2h_gbps)):
                gbps = nbytes / statistics.median(times[op]) / 1e9
                row[op] = {"gbps": gbps, "ratio": gbps / ceiling, "seconds": times[op]}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-size", default="64G", help="pinned pool size (default 64G)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = parser.parse_args(argv)
    try:
        pool_size = parse_size(args.pool_size)
        if args.repeats <= 0:
            raise ValueError(f"--repeats must be positive, got {args.repeats}")
    except ValueError as exc:
        print(f"bench_transfer: error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    cuda = torch.cuda.is_available()
    llama = build_cases(["llama-3.1-8b"], ["bf16"], None, None, False)[0]
    tp8 = build_cases(["llama-3.1-70b-tp8"], ["bf16"], None, None, False)[0]  # 8 KiB pages
    record: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "CPU only",
        "command": "python benchmarks/bench_transfer.py " + " ".join(argv or sys.argv[1:]),
        "torch": torch.__version__}
    try:
        if cuda:
            arenas = allocate_arenas(ARENA_SIDE, torch.device("cuda"))
            try:
                ceilings = ceilings_mod.measure(arenas.device, arenas.host, args.repeats)
                record["ceilings"] = ceilings.as_dict()
                record["gemm"] = gemm_slowdown(arenas, ceilings, llama, tp8)
                record["pages"] = page_sweep(arenas, ceilings, args.repeats)
            finally:
                arenas.close()
        else:
            console.print("No CUDA device: only the pool-ready section runs, unpinned.")
        record["pool"] = pool_ready(pool_size, llama)
    except BenchError as exc:
        print(f"bench_transfer: error: {exc}", file=sys.stderr)
        return 2
    report(record, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def report(record: dict, console: Console) -> None:
    if "ceilings" in record:
        c = record["ceilings"]
        console.print(f"ceilings: load {c['h2d_gbps']:.1f} GB/s, store {c['d2h_gbps']:.1f} GB/s, "
                      f"both {c['bidir_gbps']:.1f} GB/s")
    if "gemm" in record:
        t = Table(title=f"bf16 GEMM {GEMM_N}^3 while blocks move both ways (target <= 3% for DMA)")
        for col in ("copy", "GEMM ms", "slowdown", "copy GB/s (of both-ways ceiling)"):
            t.add_column(col)
        for r in record["gemm"]:
            rate = f"{r['copy_gbps']:.1f} ({r['copy_ratio']:.2f})" if "copy_gbps" in r else ""
            t.add_row(r["copy"], f"{r['gemm_ms']:.3f}", f"{100 * r['slowdown']:+.1f}%", rate)
        console.print(t)
    if "pages" in record:
        t = Table(title=f"layer-major pages, one copy per layer per block ({PAGE_LAYERS} layers): "
                        "batched DMA, auto, SM kernel, GB/s (ratio of ceiling)")
        for col in ("page", "backend", "copies/job", "load", "store"):
            t.add_column(col)
        for r in record["pages"]:
            t.add_row(format_bytes(r["page_bytes"]), r["backend"], str(r["copies_per_job"]),
                      *(f"{r[op]['gbps']:.1f} ({r[op]['ratio']:.2f})" for op in ("load", "store")))
        console.print(t)
    p = record["pool"]
    console.print(f"pool of {format_bytes(p['bytes'])} ({'pinned' if p['pinned'] else 'unpinned'}) "
                  f"ready in {p['pool_s']:.2f} s ({p['pool_gbps']:.1f} GB/s); first-touch memset "
                  f"{min(p['memset_s']):.2f} s ({p['memset_gbps']:.1f} GB/s): "
                  f"{p['ratio']:.2f}x (target >= 1.0x)")


if __name__ == "__main__":
    sys.exit(main())
