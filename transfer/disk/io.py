"""Disk I/O threads: whole blocks between pool slots and a slab, many requests in flight.

Two-phase like the copy engine: `submit_write` / `submit_read` queue a job of blocks and return
at once; `get_finished` reports each job once, with one flag per block (a full disk, EIO or a
bad checksum fails that block only). `threads` requests run at once (os.preadv/os.pwritev release
the GIL); reads go before queued writes (a read is a hit someone waits for). A job's blocks in
consecutive disk slots go as runs of up to `max_extent_bytes` in one request (fewer system calls
and thread wake-ups a byte: on a loaded machine those, not the drive, bound small blocks), split
so that a small job still spreads over the threads; a run that fails is retried block by block,
so one bad block fails alone. Writes queued or
running are bounded by `max_write_bytes`: past it a write job is refused whole (reported failed,
nothing written); reads are bounded by the pool slots the caller reserves for them.

The caller orders jobs that touch one pool slot (a read into a slot a write still reads from
must wait for it): jobs here run in any order.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from transfer.disk.slab import ALIGN, FOOTER_BYTES, DiskError, SlabFile, aligned_buffer

# Requests in flight: 16 keeps the drive busy while threads wait for a CPU to verify a block on
# a loaded host (2 busy vCPUs: reads 0.87 of fio at 8, 0.97 at 16, fio at the same depth).
DEFAULT_THREADS = 16
DEFAULT_MAX_WRITE_BYTES = 1 << 30
DEFAULT_MAX_EXTENT_BYTES = 16 << 20
# Blocks a request takes at most whatever their size: two iovecs each, far below IOV_MAX (1024),
# and each thread's footer buffers stay small (64 x 4 KiB).
MAX_RUN_BLOCKS = 64


@dataclass(frozen=True)
class DiskResult:
    """One finished job: per-block `ok` flags, `nbytes` of the good blocks; a read's `sums`:
    each good block's checksum, verified against the bytes read (None where it failed)."""

    job_id: int
    is_write: bool
    ok: tuple[bool, ...]
    nbytes: int
    sums: tuple[int | None, ...] = ()


@dataclass
class _Job:
    job_id: int
    is_write: bool
    keys: tuple[bytes, ...]
    disk_slots: tuple[int, ...]
    pool_slots: tuple[int, ...]
    sums: tuple[int | None, ...] | None  # write: checksums the blocks carry (None: hash them)
    ok: list[bool]
    read_sums: list[int | None]  # read: the checksums verified
    left: int
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class DiskCounters:
    """Bytes moved and the seconds each direction had requests in flight (GB/s = the ratio)."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    failed_reads: int = 0  # blocks
    failed_writes: int = 0  # blocks, refused ones included


class DiskIO:
    """Moves blocks between the rows of `pool` ((num_slots, block_bytes) uint8 host rows, each
    starting 4 KiB-aligned: a private pool's slots, or one rank's part of a shared pool's) and
    `slab` (see module doc); `pool` may come later, by `rebind`."""

    def __init__(self, slab: SlabFile, pool: torch.Tensor | None,
                 threads: int = DEFAULT_THREADS,
                 max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES,
                 max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES) -> None:
        for name, value in (("threads", threads), ("max_write_bytes", max_write_bytes),
                            ("max_extent_bytes", max_extent_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.slab = slab
        self.max_write_bytes = max_write_bytes
        self.extent_blocks = self.extent_blocks_for(slab.data_bytes, max_extent_bytes)
        self._num_threads = threads
        self._lock = threading.Condition()
        self._queues: dict[bool, deque[tuple[_Job, range]]] = {True: deque(), False: deque()}
        self._jobs: dict[int, _Job] = {}  # submitted, not yet reported
        self.num_pool_slots = 0  # no pool yet (a shared pool is mapped at its first job)
        if pool is not None:
            self.rebind(pool)
        self._finished: list[DiskResult] = []
        self._write_bytes = 0  # of write jobs queued or running
        self._active = {True: 0, False: 0}
        self._since = {True: 0.0, False: 0.0}
        self._counters = DiskCounters()
        self.last_error: str | None = None
        self._closing = False
        self._threads = [threading.Thread(target=self._run, name=f"kvconnector-disk-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def rebind(self, pool: torch.Tensor, room: int | None = None) -> None:
        """Move blocks from and to the rows of `pool` from now on (a shared pool mapped again
        after its daemon restarted); only with no job in flight. `room`: the bytes from each
        row's start that are this tier's to write (default: the row stride; a rank's part of a
        shared slot: its region): a read writes the slot's data_bytes, the block rounded up to
        4 KiB, so they must fit."""
        if pool.dim() != 2 or pool.dtype != torch.uint8 or pool.device.type != "cpu":
            raise ValueError(f"the pool must be 2-D uint8 host rows, got {pool.dtype} "
                             f"{tuple(pool.shape)} on {pool.device}")
        slab, stride = self.slab, pool.stride(0)
        room = stride if room is None else room
        if pool.shape[1] != slab.block_bytes or not slab.data_bytes <= room <= stride \
                or stride % ALIGN or pool.data_ptr() % ALIGN:
            raise ValueError(f"pool rows of {pool.shape[1]} B every {stride} B at "
                             f"{pool.data_ptr():#x}, {room} B of each ours, do not take the "
                             f"slab's {slab.block_bytes} B blocks in {slab.data_bytes} B, "
                             f"{ALIGN}-aligned")
        if self._jobs:
            raise RuntimeError(f"rebind with {len(self._jobs)} disk job(s) in flight")
        self.num_pool_slots = int(pool.shape[0])
        self._pool = pool  # keeps the memory behind the view below alive
        self._stride = stride
        nbytes = (self.num_pool_slots - 1) * stride + slab.data_bytes
        self._memory = memoryview((ctypes.c_char * nbytes).from_address(pool.data_ptr())
                                  ).cast("B")

    @staticmethod
    def extent_blocks_for(data_bytes: int,
                          max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES) -> int:
        """Blocks of `data_bytes` (a slot's data) one request takes at most: a whole block
        however small the bound, MAX_RUN_BLOCKS however small the blocks."""
        return max(1, min(MAX_RUN_BLOCKS, max_extent_bytes // data_bytes))

    # ---- verbs -----------------------------------------------------------------------------
    def submit_write(self, job_id: int, keys: Sequence[bytes], pool_slots: Sequence[int],
                     disk_slots: Sequence[int],
                     sums: Sequence[int | None] | None = None) -> bool:
        """Queue pool slots -> disk slots under `keys`; False when refused (reported failed).
        `sums`: the checksum a block carries since it entered the pool (block_checksum of its
        bytes and key), None where it has none: those are hashed on the I/O threads."""
        job = self._job(job_id, True, keys, disk_slots, pool_slots, sums)
        nbytes = len(job.keys) * self.slab.data_bytes
        with self._lock:
            if self._write_bytes and self._write_bytes + nbytes > self.max_write_bytes:
                self._counters.failed_writes += len(job.keys)
                self._finished.append(DiskResult(job_id, True, (False,) * len(job.keys), 0))
                job.done.set()
                self._jobs[job_id] = job
                return False
            self._write_bytes += nbytes
            self._enqueue(job)
        return True

    def submit_read(self, job_id: int, keys: Sequence[bytes], disk_slots: Sequence[int],
                    pool_slots: Sequence[int]) -> None:
        """Queue disk slots -> pool slots, each checked against its key and checksum."""
        job = self._job(job_id, False, keys, disk_slots, pool_slots)
        with self._lock:
            self._enqueue(job)

    def get_finished(self) -> list[DiskResult]:
        """Jobs finished since the last call, once each."""
        with self._lock:
            results, self._finished = self._finished, []
            for result in results:
                del self._jobs[result.job_id]
        return results

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        """Block until the jobs (default: all submitted) are done; False on timeout."""
        with self._lock:
            ids = list(self._jobs) if job_ids is None else list(job_ids)
            jobs = [self._jobs[i] for i in ids if i in self._jobs]
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                return False
        return True

    def take_counters(self) -> DiskCounters:
        """Counters since the last call."""
        with self._lock:
            now = time.monotonic()
            for is_write in (True, False):  # close the busy intervals still open
                if self._active[is_write]:
                    self._add_busy(is_write, now)
                    self._since[is_write] = now
            counters, self._counters = self._counters, DiskCounters()
        return counters

    def close(self) -> None:
        """Finish every queued job, stop the threads, close the slab."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        self.slab.close()

    # ---- internals -------------------------------------------------------------------------
    def _job(self, job_id: int, is_write: bool, keys: Sequence[bytes],
             disk_slots: Sequence[int], pool_slots: Sequence[int],
             sums: Sequence[int | None] | None = None) -> _Job:
        if self._closing:
            raise RuntimeError("the disk tier is closed")
        keys, disk, pool = tuple(keys), tuple(map(int, disk_slots)), tuple(map(int, pool_slots))
        if not (len(keys) == len(disk) == len(pool)) or not keys:
            raise ValueError(f"job {job_id}: {len(keys)} keys, {len(disk)} disk slots and "
                             f"{len(pool)} pool slots (equal and > 0)")
        if sums is not None and len(sums) != len(keys):
            raise ValueError(f"job {job_id}: {len(sums)} checksums for {len(keys)} keys")
        for slot in pool:
            if not 0 <= slot < self.num_pool_slots:
                raise ValueError(f"pool slot {slot} out of range [0, {self.num_pool_slots})")
        for slot in disk:
            if not 0 <= slot < self.slab.num_slots:
                raise ValueError(f"disk slot {slot} out of range [0, {self.slab.num_slots})")
        with self._lock:
            if job_id in self._jobs:
                raise ValueError(f"job id {job_id} is still in flight or unreported")
        return _Job(job_id, is_write, keys, disk, pool, None if sums is None else tuple(sums),
                    [False] * len(keys), [None] * len(keys), len(keys))

    def _enqueue(self, job: _Job) -> None:
        self._jobs[job.job_id] = job
        # Requests of at most extent_blocks, and at least as many as the threads when the job
        # has the blocks (a short load still runs on every thread).
        per = max(1, min(self.extent_blocks, len(job.keys) // self._num_threads))
        runs: list[range] = []
        start = 0
        for i in range(1, len(job.keys) + 1):
            if i == len(job.keys) or i - start == per \
                    or job.disk_slots[i] != job.disk_slots[i - 1] + 1:
                runs.append(range(start, i))
                start = i
        self._queues[job.is_write].extend((job, run) for run in runs)
        self._lock.notify(len(runs))

    def _run(self) -> None:
        footers = aligned_buffer(self.extent_blocks * FOOTER_BYTES)
        scratch = [footers[j * FOOTER_BYTES:(j + 1) * FOOTER_BYTES]
                   for j in range(self.extent_blocks)]
        while True:
            with self._lock:
                while not (self._queues[False] or self._queues[True] or self._closing):
                    self._lock.wait()
                queue = self._queues[False] or self._queues[True]
                if not queue:
                    return  # closing, nothing left
                job, run = queue.popleft()
                if self._active[job.is_write] == 0:
                    self._since[job.is_write] = time.monotonic()
                self._active[job.is_write] += 1
            ok = self._move(job, run, scratch)
            with self._lock:
                self._active[job.is_write] -= 1
                if self._active[job.is_write] == 0:
                    self._add_busy(job.is_write, time.monotonic())
                for i, good in zip(run, ok, strict=True):
                    self._settle(job, i, good)

    def _move(self, job: _Job, run: range, footers: list[memoryview]) -> list[bool]:
        """One request for the blocks `run` of `job`; when it fails, one request a block."""
        stride, size = self._stride, self.slab.data_bytes
        datas = [self._memory[job.pool_slots[i] * stride:job.pool_slots[i] * stride + size]
                 for i in run]
        keys = [job.keys[i] for i in run]
        try:
            if job.is_write:
                sums = None if job.sums is None else [job.sums[i] for i in run]
                self.slab.write(job.disk_slots[run[0]], keys, datas, footers, sums)
            else:
                verified = self.slab.read(job.disk_slots[run[0]], keys, datas, footers)
                for i, checksum in zip(run, verified, strict=True):
                    job.read_sums[i] = checksum  # each block is this thread's alone
        except Exception as exc:  # any failure fails blocks, never the thread (no stall)
            if len(run) > 1:
                return [self._move(job, range(i, i + 1), footers)[0] for i in run]
            self.last_error = str(exc) if isinstance(exc, DiskError | OSError) else repr(exc)
            return [False]
        return [True] * len(run)

    def _settle(self, job: _Job, i: int, ok: bool) -> None:
        job.ok[i] = ok
        nbytes = self.slab.block_bytes
        if job.is_write:
            self._write_bytes -= self.slab.data_bytes
            self._counters.write_bytes += nbytes if ok else 0
            self._counters.failed_writes += not ok
        else:
            self._counters.read_bytes += nbytes if ok else 0
            self._counters.failed_reads += not ok
        job.left -= 1
        if job.left == 0:
            self._finished.append(DiskResult(
                job.job_id, job.is_write, tuple(job.ok), sum(job.ok) * nbytes,
                () if job.is_write else tuple(s if ok else None
                                              for s, ok in zip(job.read_sums, job.ok,
                                                               strict=True))))
            job.done.set()

    def _add_busy(self, is_write: bool, now: float) -> None:
        elapsed = now - self._since[is_write]
        if is_write:
            self._counters.write_seconds += elapsed
        else:
            self._counters.read_seconds += elapsed
