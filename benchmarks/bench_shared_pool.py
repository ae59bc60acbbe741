"""The shared host pool on one GPU: two processes, each its own cache, one pool between them.

A `kvconnector pool serve` daemon owns the pool; a writer process stores n random blocks from
its GPU cache into the pool's slots by DMA, its copy engine summing each block's rows and its
threads hashing them (the checksums its commit carries); this process loads them into its own
GPU cache by DMA, straight from the shared slots, each block only once its checksum matched, as
an engine does: by row sums, checked on the way by the copy engine (staged on the GPU, summed,
copied on), and again by xxh3 on checker threads (as for blocks without row sums), and compares
every byte. Reported against raw pinned copies taken in turns with the rounds (one copy of a
round's direction before it, a set's bytes up to 1 GiB: kvconnector.bench.ceilings.RawCopies;
a figure's median over theirs) and against the ceilings
taken before the pool runs (one 2 GiB pinned memcpy each way, two at once): the loads, the
writer's stores, both directions at once (the writer storing a second set while this process
loads by row sums), and the metadata cost per block (lookup + pin + unpin; allocate + commit)
on the client side, in microseconds, per block of a batch of n.

    python benchmarks/bench_shared_pool.py [--block-sizes 2MiB,4MiB] [--repeats 5] [--json PATH]

With `--gpus 0,1,2,3` (or `--gpus all`) it runs one engine process per GPU on one pool, all
storing and loading at once, against the same run's raw pinned copies on every GPU at once
(kvconnector/bench/shared_pool_gpus.py); one GPU is the run above.

On a CPU the same runs host to host (memory bandwidth, not PCIe); there `--gpus 0,1` runs two
stand-in processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvconnector.bench.ceilings import CeilingMeter
from kvconnector.bench.runner import allocate_arenas
from kvconnector.bench.shared_pool import SHARED_MAX_BYTES, add_ratios, measure_one
from kvconnector.bench.shared_pool_gpus import (
    blocks_per_set,
    format_tables,
    measure_every_gpu,
    mismatched_blocks_in,
    resolve_gpus,
    visible_name,
)
from kvconnector.cli.units import parse_size
from kvconnector.layout.allocator import shm_free_bytes, slot_stride


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", default="2MiB,4MiB",
                        help="comma-separated block sizes (default 2MiB,4MiB)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed loads and stores per size (median)")
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--gpus", help="GPUs storing and loading at once, one engine process "
                        "each: 'all' or indices such as 0,1,2,3 (default: one GPU, the run above)")
    args = parser.parse_args(argv)
    if args.repeats < 1:  # each figure is a median of the timed rounds after a warm-up
        parser.error(f"--repeats must be a positive integer, got {args.repeats}")
    if args.gpus is not None and "," not in args.gpus and args.gpus.strip() != "all":
        # One GPU: the run above, on that GPU (chosen before CUDA starts in this process).
        try:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_name(int(args.gpus))
        except (ValueError, IndexError):
            parser.error(f"--gpus takes 'all' or indices such as 0,1,2,3, not {args.gpus!r}")
    elif args.gpus is not None:
        cuda = torch.cuda.is_available()
        try:
            gpus = resolve_gpus(args.gpus, cuda)
        except ValueError as exc:
            parser.error(str(exc))
        if len(gpus) > 1:
            return _every_gpu(args, gpus, "cuda" if cuda else "cpu",
                              sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arenas = allocate_arenas((4 << 30) if device.type == "cuda" else (256 << 20), device)
    try:
        meter = CeilingMeter(arenas.device, arenas.host, args.repeats)
        try:
            meter.measure()
            ceilings = meter.best("one round before the pool runs")
        finally:
            meter.close()
    finally:
        arenas.close()
    print(f"ceilings ({ceilings.copy_bytes >> 20} MiB copies): load {ceilings.h2d_gbps:.2f} "
          f"GB/s, store {ceilings.d2h_gbps:.2f} GB/s, both {ceilings.bidir_gbps:.2f} GB/s")
    rows = []
    for size in (parse_size(s) for s in args.block_sizes.split(",")):
        stride = slot_stride(size)
        n = min(SHARED_MAX_BYTES[device.type] // size, int(shm_free_bytes() * 0.8) // (3 * stride))
        if n < 1:
            raise SystemExit(f"/dev/shm has {shm_free_bytes() >> 20} MiB free: no room for "
                             f"three sets of {size} B blocks (docker: --shm-size)")
        row = measure_one(size, n, device, args.repeats)
        add_ratios(row, ceilings)
        rows.append(row)
        raw, once = row["raw"], row["ceiling_ratios"]
        print(f"block {size >> 10} KiB x {n}: raw copies in turns with the rounds: load "
              f"{raw['h2d_gbps']:.2f}, store {raw['d2h_gbps']:.2f}, both {raw['bidir_gbps']:.2f} "
              f"GB/s; of those (of the ceilings above): load {row['load_ratio']:.3f} "
              f"({once['load']:.3f}), store {row['store_ratio']:.3f} ({once['store']:.3f}), "
              f"both {row['bidir_ratio']:.3f} ({once['both']:.3f})", flush=True)
        print(f"  load {row['load_gbps']:.2f} GB/s, both at once {row['bidir_gbps']:.2f} GB/s, "
              f"writer store committed by row sums {row['store_gbps']:.2f} GB/s (its xxh3s "
              f"attached {row['late_hash_s'] * 1e3:.0f} ms after the last commit, "
              f"{row['late_hash_gbps']:.2f} GB/s from the store's start); load checked by xxh3 "
              f"{row['xxh3_load_gbps']:.2f} GB/s ({row['xxh3_load_ratio']:.3f} of raw) "
              f"on {row['check_threads']} threads; metadata per "
              f"block: load {row['load_meta_us']:.2f} us, store {row['store_meta_us']:.2f} us",
              flush=True)
    if args.json is not None:
        record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "host": platform.node(), "device": torch.cuda.get_device_name(0)
                  if device.type == "cuda" else platform.processor() or "cpu",
                  "ceilings": ceilings.as_dict(), "rows": rows}
        args.json.write_text(json.dumps(record, indent=2))
    return 0


def _every_gpu(args: argparse.Namespace, gpus: list[int], device_type: str,
               argv: list[str]) -> int:
    """One engine process per GPU, all at once; the tables last; 1 where a byte mismatched."""
    sizes = [parse_size(s) for s in args.block_sizes.split(",")]
    try:
        blocks_per_set(sizes, len(gpus), device_type)
    except ValueError as exc:  # said before anything runs
        raise SystemExit(str(exc)) from None
    result = measure_every_gpu(gpus, device_type, sizes, args.repeats,
                               lambda what: print(f"measuring {what}", flush=True))
    ceilings, rows = result["ceilings"], result["rows"]
    raw = ceilings["aggregate"]
    print(f"raw copies on {len(gpus)} GPUs at once: load {raw['h2d_gbps']:.2f} GB/s, "
          f"store {raw['d2h_gbps']:.2f} GB/s, both {raw['bidir_gbps']:.2f} GB/s")
    for row in rows:
        print(f"block {row['block_bytes'] >> 10} KiB x {row['blocks']} per engine and set: load "
              f"{row['ratios']['load']:.3f}, store {row['ratios']['store']:.3f}, both "
              f"{row['ratios']['both']:.3f} of the raw aggregate taken in turns with its rounds")
    print(format_tables(ceilings, rows), flush=True)
    if args.json is not None:
        record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["python benchmarks/bench_shared_pool.py", *argv]),
                  "host": platform.node(),
                  "hardware": {"device_type": device_type, "gpus": gpus,
                               "device_names": ceilings["device_names"],
                               "cpu_count": os.cpu_count()},
                  "block_sizes": [row["block_bytes"] for row in rows],
                  "ceilings": ceilings, "rows": rows}
        args.json.write_text(json.dumps(record, indent=2))
    return 1 if mismatched_blocks_in(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
