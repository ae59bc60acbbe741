"""Same-run baselines every figure is divided by.

- one large copy each way (pinned host <-> GPU; host <-> host on a CPU): the one-way ceiling;
- two opposite large copies at once (two CUDA streams; two threads on a CPU): bidirectional.
  On a CPU the copies run on worker threads, as the engine's CPU lanes run theirs;
- one plain copy call (cudaMemcpyAsync through cuda-bindings; a CPU Tensor.copy_) of a small page:
  the host cost a per-block submit is held against.

They are taken in rounds interleaved with the cases (CeilingMeter), and each is its best round: a
ceiling taken once can read low (an H200 run's both-ways ceiling, 90.7 GB/s, under the 99.5 GB/s
block-major copies then moved: ratios of 1.09-1.10).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

CEILING_COPY_BYTES = 2 << 30  # the ceilings are 2 GiB copies (docs/benchmarks.md)
RAW_COPY_BYTES = {"cuda": 1 << 30, "cpu": 16 << 20}  # one raw copy in turns with rounds
PLAIN_CALL_BYTES = 4096
PLAIN_CALLS = 1000


@dataclass
class Ceilings:
    copy_bytes: int
    h2d_gbps: float  # host -> device (a load)
    d2h_gbps: float  # device -> host (a store)
    bidir_gbps: float  # both copies' bytes over the time both took
    plain_call_us: float  # host time of one plain copy call
    plain_call: str  # what that call was
    method: str = ""  # how the figures were taken
    rounds: list[dict[str, float]] = field(default_factory=list)  # every round's figures

    def one_way(self, direction: str) -> float:
        return self.h2d_gbps if direction == "load" else self.d2h_gbps

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    """Wall seconds of `fn` (device work included), one untimed warm-up first."""
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


class CeilingMeter:
    """Ceilings over the first bytes of two 1-D uint8 arenas (each holds two copy regions), one
    round per `measure()`; `best()` holds each figure's best round: the highest rates and the
    cheapest plain call."""

    def __init__(self, device_arena: torch.Tensor, host_arena: torch.Tensor,
                 repeats: int) -> None:
        self._device_arena, self._host_arena, self._repeats = device_arena, host_arena, repeats
        self._size = min(CEILING_COPY_BYTES, device_arena.numel() // 2, host_arena.numel() // 2)
        self._pinned: torch.Tensor | None = None
        if device_arena.device.type == "cuda":
            # The arena is pinned in block-aligned cudaHostRegister ranges, which one 2 GiB copy
            # may not straddle; the ceiling is one cudaHostAlloc buffer of its own.
            self._pinned = torch.empty(2 * self._size, dtype=torch.uint8, pin_memory=True)
        self._rounds: list[Ceilings] = []

    def measure(self) -> None:
        self._rounds.append(_measure_round(self._device_arena, self._host_arena, self._pinned,
                                           self._size, self._repeats))

    def best(self, schedule: str) -> Ceilings:
        """`schedule`: when the rounds were taken, for the record."""
        rounds = self._rounds
        cheapest = min(rounds, key=lambda r: r.plain_call_us)
        return Ceilings(
            self._size, max(r.h2d_gbps for r in rounds), max(r.d2h_gbps for r in rounds),
            max(r.bidir_gbps for r in rounds), cheapest.plain_call_us, cheapest.plain_call,
            method=f"each figure the best of {len(rounds)} rounds, each the median of "
                   f"{self._repeats} timed copies; {schedule}",
            rounds=[{"h2d_gbps": r.h2d_gbps, "d2h_gbps": r.d2h_gbps, "bidir_gbps": r.bidir_gbps,
                     "plain_call_us": r.plain_call_us} for r in rounds])

    def close(self) -> None:
        self._pinned = None


def measure(device_arena: torch.Tensor, host_arena: torch.Tensor, repeats: int) -> Ceilings:
    """One round, for a script that takes its ceilings once (benchmarks/bench_transfer.py)."""
    meter = CeilingMeter(device_arena, host_arena, repeats)
    try:
        meter.measure()
        return meter.best("taken once")
    finally:
        meter.close()


def raw_copies(device_buffers: tuple[torch.Tensor, torch.Tensor],
               host_buffers: tuple[torch.Tensor, torch.Tensor],
               lanes: ThreadPoolExecutor) -> dict[str, Callable[[], None]]:
    """The raw copies a ceiling times, by direction ("h2d", "d2h", "bidir": one each way at
    once) between two device and two host buffers of one size: on CUDA async copies (two streams
    for "bidir"; host buffers pinned), elsewhere on `lanes` (two threads, one per direction, as
    the engine's CPU lanes copy)."""
    (d0, d1), (h0, h1) = device_buffers, host_buffers
    device = d0.device
    if device.type == "cuda":
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

        def both() -> None:
            for s in streams:
                s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(streams[0]):
                d0.copy_(h0, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                h1.copy_(d1, non_blocking=True)
            for s in streams:
                torch.cuda.current_stream(device).wait_stream(s)

        return {"h2d": lambda: d0.copy_(h0, non_blocking=True),
                "d2h": lambda: h0.copy_(d0, non_blocking=True), "bidir": both}

    def cpu_both() -> None:
        for job in [lanes.submit(d0.copy_, h0), lanes.submit(h1.copy_, d1)]:
            job.result()

    return {"h2d": lambda: lanes.submit(d0.copy_, h0).result(),
            "d2h": lambda: lanes.submit(h0.copy_, d0).result(), "bidir": cpu_both}


class RawCopies:
    """Raw copies of one process, taken in turns with a bench's rounds (before each round, one of
    its direction): as the ceilings take them (`raw_copies`), on buffers of its own. The host's
    limit can move while a bench runs (other tenants of the host, other engines): the median of
    such copies spans the same minutes as the rounds it is held against, where a ceiling taken
    before them does not."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device, self.size = device, size
        self._cuda = device.type == "cuda"
        self._host = torch.empty(2 * size, dtype=torch.uint8, pin_memory=self._cuda)
        self._dev = torch.empty(2 * size, dtype=torch.uint8, device=device)
        self._host.fill_(1)  # touched before any copy is timed
        self._dev.fill_(2)
        self._lanes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-raw")
        self._copies = raw_copies((self._dev[:size], self._dev[size:]),
                                  (self._host[:size], self._host[size:]), self._lanes)

    def timed(self, direction: str) -> tuple[float, float]:
        """One raw copy of `direction` ("h2d", "d2h", "bidir"): its (start, end) by time.time(),
        which other processes' spans share."""
        sync(self.device)
        t0 = time.time()
        self._copies[direction]()
        sync(self.device)
        return t0, time.time()

    def gbps(self, direction: str) -> float:
        """One raw copy of `direction`, as GB/s (both directions' bytes for "bidir")."""
        t0, t1 = self.timed(direction)
        return (2 if direction == "bidir" else 1) * self.size / (t1 - t0) / 1e9

    def close(self) -> None:
        """Stop the lanes and let the buffers go: the GPU's back to the device (what runs next
        may need the room); the pinned ones stay in torch's cache for the next such copies."""
        self._lanes.shutdown()
        self._copies = {}
        self._host = self._dev = torch.empty(0, dtype=torch.uint8)
        if self._cuda:
            torch.cuda.empty_cache()


def _measure_round(device_arena: torch.Tensor, host_arena: torch.Tensor,
                   pinned: torch.Tensor | None, size: int, repeats: int) -> Ceilings:
    device = device_arena.device
    h0, h1 = host_arena[:size], host_arena[size: 2 * size]
    if device.type == "cuda":
        assert pinned is not None
        h0, h1 = pinned[:size], pinned[size:]
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-ceiling") as lanes:
        copies = raw_copies((device_arena[:size], device_arena[size: 2 * size]), (h0, h1), lanes)
        h2d, d2h, bidir = (statistics.median(timed(copies[direction], device, repeats))
                           for direction in ("h2d", "d2h", "bidir"))
    call_us, call_name = plain_call_us(device_arena, host_arena, repeats)
    return Ceilings(size, size / h2d / 1e9, size / d2h / 1e9, 2 * size / bidir / 1e9,
                    call_us, call_name)


def plain_call_us(device_arena: torch.Tensor, host_arena: torch.Tensor,
                  repeats: int) -> tuple[float, str]:
    """Median host microseconds of one plain copy call of PLAIN_CALL_BYTES."""
    device = device_arena.device
    n = PLAIN_CALL_BYTES
    if device.type != "cuda":
        dst, src = device_arena[:n], host_arena[:n]
        per_round = timed(lambda: [dst.copy_(src) for _ in range(PLAIN_CALLS)], device, repeats)
        return statistics.median(per_round) / PLAIN_CALLS * 1e6, "Tensor.copy_ 4 KiB host->host"
    from cuda.bindings import runtime as cudart  # lazy: CUDA-only dependency

    stream = torch.cuda.Stream(device)
    dst, src = device_arena.data_ptr(), host_arena.data_ptr()
    kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
    samples = []
    for _ in range(repeats + 1):  # the first round warms up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(PLAIN_CALLS):
            err, = cudart.cudaMemcpyAsync(dst + i * n, src + i * n, n, kind, stream.cuda_stream)
        samples.append((time.perf_counter() - t0) / PLAIN_CALLS)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyAsync failed: {err}")
    torch.cuda.synchronize(device)
    return statistics.median(samples[1:]) * 1e6, "cudaMemcpyAsync 4 KiB pinned->GPU (cuda-bindings)"
