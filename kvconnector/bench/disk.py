"""`kvconnector bench --disk PATH`: whole blocks through the disk tier against fio.

Per block size: a host pool of blocks is written to the tier's slab under PATH (transfer.disk:
O_DIRECT from the pool slots, `threads` requests in flight), then read back into the poisoned pool
and compared; in the same run fio (Debian's package) writes and reads a file beside it with
O_DIRECT, the same request size and the same queue depth: the tier moves runs of consecutive
slots in one request (transfer.disk.io: `extent_blocks` blocks, each with its footer), so fio's
requests are that many (block + footer), on as many threads of synchronous requests (psync) as
the tier has, each through its part of the file in order. The ratio is the tier's block bytes
per second over fio's request bytes per second (the footers count against the tier).
Writes run twice: hashed on the tier's threads (a private pool's blocks carry no checksum) and
with the checksums given ("carried": a shared pool's blocks, committed with them), against the
same fio pass.
After one untimed write and read of each file (first passes over fresh extents run slower on
some virtual disks), each repeat is a pair per direction, fio and the tier back to back, the
order swapped every repeat; the ratio is each pair's, so load that drifts between repeats (a
shared machine) moves both sides of a pair alike. Reported: the median of the pairs' ratios and
their range, the median GB/s of each side with its range, and the load average per repeat.
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

from kvconnector.bench.report import ABOVE_CEILING, SCALE, judged
from kvconnector.bench.sizing import BenchError, format_bytes
from transfer.checksums import block_checksum
from transfer.disk.io import DiskIO
from transfer.disk.slab import FOOTER_BYTES, DiskError, SlabFile, slot_bytes
from transfer.pool import HostPool

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
    slot = slot_bytes(block_bytes)
    extent = DiskIO.extent_blocks_for(slot - FOOTER_BYTES)
    request = extent * slot
    # Whole requests, a multiple of the threads: every job below is threads full requests.
    n = extent * threads * max(2, total_bytes // (request * threads))
    free = shutil.disk_usage(tmp).free
    if free < 2 * n * slot + (64 << 20):
        raise BenchError(f"{tmp} has {format_bytes(free)} free; {name} needs "
                         f"{format_bytes(2 * n * slot)} (slab + fio file): lower --disk-bytes")
    pool = HostPool.create(n, block_bytes)
    digest = os.urandom(16)
    try:
        slab = SlabFile(tmp, digest, block_bytes, n)
    except DiskError as exc:
        pool.close()
        raise BenchError(str(exc)) from None
    # The bench submits a whole pass at once: its write bound is the pass (1 GiB by default).
    io = DiskIO(slab, pool.slots, threads=threads, max_write_bytes=n * slot)
    try:
        expected = _fill(pool.slots)
        keys = [digest + i.to_bytes(8, "little") for i in range(n)]
        fio_file = tmp / f"fio-{block_bytes}.dat"
        times: dict[str, list[float]] = {k: [] for k in ("tier_write", "tier_write_carried",
                                                          "tier_read", "fio_write", "fio_read")}
        # a checksum per block, as a pool's commit takes it (the bytes do not change after)
        sums = [block_checksum(row, k) for row, k in zip(pool.slots.numpy(), keys, strict=True)]
        loads: list[float] = []
        # Untimed first passes: both files fully written, so every timed write overwrites
        # written extents (a first write into preallocated space also converts them), and
        # read once.
        _fio(fio, fio_file, "write", request, n // extent, threads)
        _run(io, True, keys, 0, threads * extent)
        _fio(fio, fio_file, "read", request, n // extent, threads)
        _run(io, False, keys, n, threads * extent)
        next_job = 2 * n
        for repeat in range(repeats):
            loads.append(round(os.getloadavg()[0], 2))
            for write in (True, False):
                rw = "write" if write else "read"
                sides = ("fio", "tier", "carried")[:3 if write else 2]
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    if side == "fio":
                        times[f"fio_{rw}"].append(_fio(fio, fio_file, rw, request,
                                                       n // extent, threads))
                        continue
                    if not write:
                        pool.slots.fill_(POISON)
                    carried = side == "carried"
                    times[f"tier_{rw}{'_carried' if carried else ''}"].append(
                        _run(io, write, keys, next_job, threads * extent,
                             sums if carried else None))
                    next_job += n
                    if not write and (not torch.equal(pool.slots[:, 8:],
                                                      expected[8:].expand(n, -1))
                                      or not _stamps_ok(pool.slots)):
                        raise BenchError(f"{name}: blocks read back differ from those written")
        fio_file.unlink()
    finally:
        io.close()
        pool.close()
    tier_bytes, fio_bytes = n * block_bytes, n * slot
    rates = {k: [(tier_bytes if k.startswith("tier") else fio_bytes) / t / 1e9 for t in v]
             for k, v in times.items()}
    gbps = {f"{k}_GBps": round(statistics.median(v), 3) for k, v in rates.items()}
    spread = {f"{k}_GBps_range": [round(min(v), 3), round(max(v), 3)] for k, v in rates.items()}
    ratios = {rw: [t / f for t, f in zip(rates[f"tier_{rw}"], rates[f"fio_{rw[:5]}"],
                                         strict=True)]
              for rw in ("write", "write_carried", "read")}
    return {"case": name, "block_bytes": block_bytes, "request_bytes": request,
            "blocks_per_request": extent, "blocks": n, "fio_memory": fio_memory(request, threads),
            "queue_depth": threads,
            **gbps, **spread,
            **{f"{rw}_ratio": round(statistics.median(r), 3) for rw, r in ratios.items()},
            **{f"{rw}_ratio_range": [round(min(r), 3), round(max(r), 3)]
               for rw, r in ratios.items()},
            "load_average": loads}


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


def _run(io: DiskIO, write: bool, keys: list[bytes], first_job: int, job_blocks: int,
         sums: list[int] | None = None) -> float:
    """Seconds to move every block through the tier in jobs of `job_blocks` (all ok, else
    BenchError); `sums`: the blocks' checksums, given to the writes."""
    n = len(keys)
    start = time.perf_counter()
    for job, lo in enumerate(range(0, n, job_blocks)):
        ids = range(lo, min(n, lo + job_blocks))
        chosen = [keys[i] for i in ids]
        if write:
            given = None if sums is None else [sums[i] for i in ids]
            if not io.submit_write(first_job + job, chosen, ids, ids, given):
                raise BenchError("the disk tier refused a write: raise its write bound")
        else:
            io.submit_read(first_job + job, chosen, ids, ids)
    io.wait()
    seconds = time.perf_counter() - start
    results = io.get_finished()
    if not all(all(r.ok) for r in results):
        raise BenchError(f"disk tier {'write' if write else 'read'} failed: {io.last_error}")
    return seconds


def fio_memory(request: int, depth: int) -> str:
    """fio's --mem: huge pages ("shmhuge") when enough are reserved for its buffers, as the
    pool's slots are on transparent huge pages (a request then takes a few large segments, not
    one per 4 KiB page: on a virtio disk fio read 3.3 GB/s from 4 KiB pages and 7.0 from huge
    ones, 8 MiB requests); else "malloc", and the ceiling may understate the drive."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    page = int(info.get("Hugepagesize", "0 kB").split()[0]) << 10
    free = int(info.get("HugePages_Free", "0"))
    if page and free * page >= depth * (-(-request // page) + 1) * page:
        return "shmhuge"
    return "malloc"


def huge_pages_needed(request: int, depth: int, page: int = 2 << 20) -> int:
    """vm.nr_hugepages that lets fio_memory pick huge pages (2 MiB pages)."""
    return depth * (-(-request // page) + 1)


def _fio(fio: str, file: Path, rw: str, request: int, n: int, depth: int) -> float:
    """Seconds fio takes to move n requests of `request` bytes (its own bandwidth figure):
    `depth` threads of synchronous O_DIRECT requests (psync), each through its own contiguous
    part of the file in order, as the tier's threads take the slots; buffers on huge pages
    where reserved (fio_memory)."""
    per_job = n // depth * request
    cmd = [fio, "--name=ceiling", f"--filename={file}", f"--rw={rw}", f"--bs={request}",
           f"--size={per_job}", f"--offset_increment={per_job}", f"--numjobs={depth}",
           "--direct=1", "--ioengine=psync", "--overwrite=1", "--group_reporting",
           f"--mem={fio_memory(request, depth)}", "--output-format=json"]
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
                  "ratio (pairs)", "checksum carried", "ratio (pairs)", "tier read GB/s",
                  "fio read GB/s", "ratio (pairs)")
    for row in record["disk"]["rows"]:
        table.add_row(row["case"], format_bytes(row["block_bytes"]),
                      format_bytes(row["request_bytes"]), str(row["blocks"]),
                      f"{row['tier_write_GBps']:.2f}", f"{row['fio_write_GBps']:.2f}",
                      _ratio(row, "write"), f"{row['tier_write_carried_GBps']:.2f}",
                      _ratio(row, "write_carried"), f"{row['tier_read_GBps']:.2f}",
                      f"{row['fio_read_GBps']:.2f}", _ratio(row, "read"))
    console.print(table)
    for line in disk_verdicts(record["disk"]["rows"]):
        console.print(line, highlight=False, markup=False)
    short = [row for row in record["disk"]["rows"] if row["fio_memory"] != "shmhuge"]
    if short:
        need = max(huge_pages_needed(row["request_bytes"], row["queue_depth"]) for row in short)
        console.print(f"[yellow]fio's buffers were 4 KiB pages, the pool's huge pages: the "
                      f"ceiling may understate the drive; reserve huge pages for fio (as root: "
                      f"sysctl vm.nr_hugepages={need}) and run again[/]")


def disk_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's ratios against fio (the drive's rate for the same requests), in words."""
    if not rows:
        return []
    lines = [f"verdicts against fio on the same file system, request size and queue depth (the "
             f"drive's limit); {SCALE}:"]
    above = False
    for row in rows:
        ratios = [(name, row[f"{rw}_ratio"]) for name, rw in (
            ("write", "write"), ("carried write", "write_carried"), ("read", "read"))]
        above = above or any(ratio > ABOVE_CEILING for _, ratio in ratios)
        lines.append(f"  {row['case']}: " + ", ".join(judged(n, r) for n, r in ratios))
    if above:
        lines.append("  above 1: the tier moved its blocks faster than fio its requests in that "
                     "pair (fio's buffers on 4 KiB pages, or load shifting between the two "
                     "halves): fio is a reference for the drive, not a hard limit")
    return lines


def _ratio(row: dict[str, Any], rw: str) -> str:
    low, high = row[f"{rw}_ratio_range"]
    return f"{row[f'{rw}_ratio']:.2f} ({low:.2f}-{high:.2f})"
