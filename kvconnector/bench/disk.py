"""`kvconnector bench --disk PATH`: whole blocks through the disk tier against fio.

Per block size: a host pool of blocks is written to the tier's slab under PATH (transfer.disk:
O_DIRECT from the pool slots, `threads` requests in flight), then read back into the poisoned pool
and compared; in the same run fio (Debian's package) writes and reads a file beside it with
O_DIRECT, the same request size (block + footer) and the same queue depth: as many threads of
synchronous requests (psync), each through its part of the file in order. The ratio is the tier's
block bytes per second over fio's request bytes per second (the footer counts against the tier).
After one untimed write of each file, repeats alternate fio and the tier; medians are reported,
with each figure's range over the repeats.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvconnector.bench.sizing import BenchError, format_bytes
from kvconnector.layout.descriptor import KVForm, KVLayout
from transfer.disk.io import DiskIO
from transfer.disk.slab import DiskError, SlabFile, slot_bytes
from transfer.pool import HostPool

JOB_BLOCKS = 64  # blocks per submitted job: a few jobs keep every thread busy
POISON = 0x5A


def measure_disk(cases: list[Any], path: Path, total_bytes: int, threads: int,
                 repeats: int) -> dict[str, Any]:
    """One row per distinct block size of `cases`: tier and fio GB/s each way, and ratios."""
    if not path.is_dir():
        raise BenchError(f"--disk {str(path)!r} is not a directory")
    fio = shutil.which("fio")
    if fio is None:
        raise BenchError("fio is not installed (Debian: apt-get install fio; offline: unpack "
                         "its .deb files and put its bin/ on PATH)")
    sizes: dict[int, str] = {}
    for case in cases:
        sizes.setdefault(case.layout.block_bytes, case.name)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvconnector-disk-bench-", dir=path) as tmp:
        for block_bytes, name in sizes.items():
            rows.append(_measure_size(Path(tmp), fio, name, block_bytes, total_bytes, threads,
                                      repeats))
    return {"path": str(path), "filesystem": _filesystem(path), "threads": threads,
            "rows": rows}


def _measure_size(tmp: Path, fio: str, name: str, block_bytes: int, total_bytes: int,
                  threads: int, repeats: int) -> dict[str, Any]:
    request = slot_bytes(block_bytes)
    n = max(2 * threads, total_bytes // request)
    free = shutil.disk_usage(tmp).free
    if free < 2 * n * request + (64 << 20):
        raise BenchError(f"{tmp} has {format_bytes(free)} free; {name} needs "
                         f"{format_bytes(2 * n * request)} (slab + fio file): lower --disk-bytes")
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=block_bytes, block_size=1,
                      dtype=torch.uint8, form=KVForm.MLA, order="BLNHC")
    pool = HostPool.create(layout, num_slots=n)
    digest = os.urandom(16)
    try:
        slab = SlabFile(tmp, digest, block_bytes, n)
    except DiskError as exc:
        pool.close()
        raise BenchError(str(exc)) from None
    # The bench submits a whole pass at once: its write bound is the pass (1 GiB by default).
    io = DiskIO(slab, pool.slots, threads=threads, max_write_bytes=n * request)
    try:
        expected = _fill(pool.slots)
        keys = [digest + i.to_bytes(8, "little") for i in range(n)]
        fio_file = tmp / f"fio-{block_bytes}.dat"
        times: dict[str, list[float]] = {k: [] for k in ("tier_write", "tier_read", "fio_write",
                                                          "fio_read")}
        # Untimed first passes: both files fully written, so every timed write overwrites
        # written extents (a first write into preallocated space also converts them).
        _fio(fio, fio_file, "write", request, n, threads)
        _run(io, True, keys, 0)
        next_job = n
        for _ in range(repeats):
            times["fio_write"].append(_fio(fio, fio_file, "write", request, n, threads))
            times["tier_write"].append(_run(io, True, keys, next_job))
            next_job += n
            times["fio_read"].append(_fio(fio, fio_file, "read", request, n, threads))
            pool.slots.fill_(POISON)
            times["tier_read"].append(_run(io, False, keys, next_job))
            next_job += n
            if not torch.equal(pool.slots[:, 8:], expected[8:].expand(n, -1)) or not \
                    _stamps_ok(pool.slots):
                raise BenchError(f"{name}: blocks read back differ from those written")
        fio_file.unlink()
    finally:
        io.close()
        pool.close()
    tier_bytes, fio_bytes = n * block_bytes, n * request
    gbps = {k: round((tier_bytes if k.startswith("tier") else fio_bytes)
                     / statistics.median(v) / 1e9, 3) for k, v in times.items()}
    spread = {f"{k}_GBps_range": [round((tier_bytes if k.startswith("tier") else fio_bytes)
                                        / t / 1e9, 3) for t in (max(v), min(v))]
              for k, v in times.items()}
    return {"case": name, "block_bytes": block_bytes, "request_bytes": request, "blocks": n,
            "queue_depth": threads, **{f"{k}_GBps": v for k, v in gbps.items()}, **spread,
            "write_ratio": round(gbps["tier_write"] / gbps["fio_write"], 3),
            "read_ratio": round(gbps["tier_read"] / gbps["fio_read"], 3)}


def _fill(slots: torch.Tensor) -> torch.Tensor:
    """Every block the same random bytes but for an 8-byte stamp of its index in front."""
    row = torch.randint(0, 256, (slots.shape[1],), dtype=torch.uint8)
    slots.copy_(row.expand_as(slots))
    _stamp(slots)
    return row


def _stamp(slots: torch.Tensor) -> None:
    stamps = torch.arange(slots.shape[0], dtype=torch.int64).view(torch.uint8).view(-1, 8)
    slots[:, :8] = stamps


def _stamps_ok(slots: torch.Tensor) -> bool:
    want = torch.arange(slots.shape[0], dtype=torch.int64).view(torch.uint8).view(-1, 8)
    return torch.equal(slots[:, :8], want)


def _run(io: DiskIO, write: bool, keys: list[bytes], first_job: int) -> float:
    """Seconds to move every block through the tier (all ok, else BenchError)."""
    n = len(keys)
    start = time.perf_counter()
    for job, lo in enumerate(range(0, n, JOB_BLOCKS)):
        ids = range(lo, min(n, lo + JOB_BLOCKS))
        chosen = [keys[i] for i in ids]
        if write:
            if not io.submit_write(first_job + job, chosen, ids, ids):
                raise BenchError("the disk tier refused a write: raise its write bound")
        else:
            io.submit_read(first_job + job, chosen, ids, ids)
    io.wait()
    seconds = time.perf_counter() - start
    results = io.get_finished()
    if not all(all(r.ok) for r in results):
        raise BenchError(f"disk tier {'write' if write else 'read'} failed: {io.last_error}")
    return seconds


def _fio(fio: str, file: Path, rw: str, request: int, n: int, depth: int) -> float:
    """Seconds fio takes to move n requests of `request` bytes (its own bandwidth figure):
    `depth` threads of synchronous O_DIRECT requests (psync), each through its own contiguous
    part of the file in order, as the tier's threads take the slots."""
    per_job = n // depth * request
    cmd = [fio, "--name=ceiling", f"--filename={file}", f"--rw={rw}", f"--bs={request}",
           f"--size={per_job}", f"--offset_increment={per_job}", f"--numjobs={depth}",
           "--direct=1", "--ioengine=psync", "--overwrite=1", "--group_reporting",
           "--output-format=json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise BenchError(f"fio failed: {done.stderr.strip() or done.stdout.strip()}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][rw]
    return n * request / job["bw_bytes"]


def _filesystem(path: Path) -> str:
    done = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True,
                          text=True)
    lines = done.stdout.split("\n")
    return " ".join(lines[1].split()) if done.returncode == 0 and len(lines) > 1 else "?"


def print_disk(record: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    meta = record["meta"]
    console.print(f"[bold]Disk tier[/] {meta['disk']['path']} ({meta['disk']['filesystem']}), "
                  f"{meta['disk']['threads']} requests in flight, {meta['date']}, "
                  f"{meta['device']}")
    table = Table("case", "block", "request", "blocks", "tier write GB/s", "fio write GB/s",
                  "ratio", "tier read GB/s", "fio read GB/s", "ratio")
    for row in record["disk"]["rows"]:
        table.add_row(row["case"], format_bytes(row["block_bytes"]),
                      format_bytes(row["request_bytes"]), str(row["blocks"]),
                      f"{row['tier_write_GBps']:.2f}", f"{row['fio_write_GBps']:.2f}",
                      f"{row['write_ratio']:.2f}", f"{row['tier_read_GBps']:.2f}",
                      f"{row['fio_read_GBps']:.2f}", f"{row['read_ratio']:.2f}")
    console.print(table)
