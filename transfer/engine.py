"""Transfer engine: asynchronous whole-block jobs between the GPU cache and the host pool.

Verbs come in two phases, as in vLLM's kv_offload: `submit_store` / `submit_load` queue a job and
return at once; `get_finished` reports each job exactly once; `wait` blocks on chosen jobs.

Ordering and back-pressure:
- one lane (CUDA stream / thread) per direction, so a load never queues behind stores (PCIe is
  full duplex); every job is queued after everything the caller's current (compute) stream had
  queued at submit: a store copies what the step wrote, a load never races a queued forward;
- a job that touches what an unfinished job touches (a load of slots a store is still writing, a
  store of blocks a load is still filling, ...) goes on a spare lane that waits for exactly those
  jobs, so jobs on the direction's lane never wait for it;
- stores in flight are bounded by `max_store_bytes`: past it a store is dropped whole before any
  byte moves (submit returns False, get_finished reports it not ok); loads are never dropped;
- nothing here blocks the caller except `wait` and `close`.
Row sums (transfer/copy/row_sums.py), where the blocks are one segment of whole 32-bit words
(`can_sum`): a store with `sums=True` reports the sums of its blocks (taken beside its
copies); a load with `expect` is checked on the way (staged, summed, compared) and only its
leading blocks that match reach the GPU (`CopyResult.good`).
Bad input raises ValueError before any byte moves. Call from one thread (the worker's).
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from transfer.checksums import all_uint64
from transfer.copy.base import Completion, CopyBackend, Lane, RowCopy, Segment
from transfer.copy.factory import make_backend
from transfer.copy.row_sums import to_int64, to_unsigned

log = logging.getLogger(__name__)

DEFAULT_MAX_STORE_BYTES = 2 << 30  # ~40 ms of stores at PCIe Gen5 x16 speed


@dataclass(frozen=True)
class CopyResult:
    """One finished job: `nbytes` moved in `seconds` of copy time (0 and 0.0 when not ok; a
    checked load's: the blocks that matched).
    `sums`: a summed store's block sums (unsigned 64-bit); `good`: a checked load's leading
    blocks that matched and were copied (None: not a checked load, or not ok)."""

    job_id: int
    ok: bool
    nbytes: int
    seconds: float
    is_store: bool
    sums: tuple[int, ...] = ()
    good: int | None = None


@dataclass
class _Ids:
    """A job's GPU block ids and slot ids; the sets are made only when another job's conflict
    check asks (a job submitted while nothing is in flight never needs them)."""

    gpu: np.ndarray
    slots: np.ndarray

    @functools.cached_property
    def gpu_set(self) -> frozenset[int]:
        return frozenset(self.gpu.tolist())

    @functools.cached_property
    def slot_set(self) -> frozenset[int]:
        return frozenset(self.slots.tolist())


@dataclass
class _Job:
    job_id: int
    is_store: bool
    nbytes: int
    ids: _Ids
    completion: Completion
    lane: Lane
    spare: bool  # ran on a spare lane, which goes back to the spare list when reported

    def conflicts(self, is_store: bool, ids: _Ids) -> bool:
        """Must a new job on these ids wait for this one?"""
        if self.is_store != is_store:  # opposite directions: any shared block or slot
            return not (self.ids.gpu_set.isdisjoint(ids.gpu_set)
                        and self.ids.slot_set.isdisjoint(ids.slot_set))
        # Same direction: both read one side and write the other; only the written side matters.
        return not (self.ids.slot_set.isdisjoint(ids.slot_set) if is_store
                    else self.ids.gpu_set.isdisjoint(ids.gpu_set))


class _Busy:
    """How many unreported jobs touch each GPU block and each slot, by direction (a filter: a job
    whose ids meet nothing that could conflict skips the per-job set checks, so a job beside
    disjoint ones, or on an idle engine, costs a few numpy gathers before its first copy)."""

    def __init__(self, num_gpu_blocks: int, num_slots: int) -> None:
        self._gpu = {is_store: np.zeros(num_gpu_blocks, np.int32) for is_store in (True, False)}
        self._slots = {is_store: np.zeros(num_slots, np.int32) for is_store in (True, False)}

    def add(self, is_store: bool, ids: _Ids, delta: int) -> None:
        # A repeated id (a store may read one GPU block twice) counts once either way.
        self._gpu[is_store][ids.gpu] += delta
        self._slots[is_store][ids.slots] += delta

    def may_conflict(self, is_store: bool, ids: _Ids) -> bool:
        """False when no unreported job could conflict (see `_Job.conflicts`)."""
        opposite = not is_store
        if self._gpu[opposite][ids.gpu].any() or self._slots[opposite][ids.slots].any():
            return True
        written = self._slots[True][ids.slots] if is_store else self._gpu[False][ids.gpu]
        return bool(written.any())


class TransferEngine:
    """Moves blocks GPU <-> host pool over `segments` (see `HostPool.segments`).

    `backend` defaults to batched DMA for CUDA segments and worker threads for host ones.
    """

    def __init__(self, segments: Sequence[Segment], backend: CopyBackend | None = None, *,
                 max_store_bytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        self.segments = _check_segments(segments)
        if not isinstance(max_store_bytes, int) or max_store_bytes <= 0:
            raise ValueError(f"max_store_bytes must be a positive integer, got {max_store_bytes!r}")
        self.num_gpu_blocks = int(self.segments[0].gpu.shape[0])
        self.num_slots = int(self.segments[0].host.shape[0])
        self.block_bytes = sum(seg.nbytes for seg in self.segments)
        self.max_store_bytes = max_store_bytes
        self.backend = backend or make_backend("auto", self.segments[0].gpu.device)
        self.backend.check(self.segments)
        self._store_pairs = tuple((seg.gpu, seg.host) for seg in self.segments)
        self._load_pairs = tuple((seg.host, seg.gpu) for seg in self.segments)
        self._lanes = {True: self.backend.new_lane(), False: self.backend.new_lane()}
        self._spare: list[Lane] = []
        self._all_spares: list[Lane] = []
        self._jobs: dict[int, _Job] = {}  # accepted and not yet reported, in submission order
        self._busy = _Busy(self.num_gpu_blocks, self.num_slots)  # what those jobs touch
        self._dropped: dict[int, CopyResult] = {}
        self._closed = False

    @functools.cached_property
    def can_sum(self) -> bool:
        """Whether jobs here may take row sums: blocks that can be summed (`_summable`) and a
        backend that sums (a CUDA one compiles its kernels when first asked: engines that never
        sum never need cupy or NVRTC)."""
        return self._summable and self.backend.sums_rows

    @property
    def _summable(self) -> bool:
        """A block in one piece, of whole 32-bit words, each word-aligned."""
        gpu = self.segments[0].gpu
        return len(self.segments) == 1 and self.block_bytes % 4 == 0 and \
            gpu.data_ptr() % 4 == 0 and gpu.stride(0) % 4 == 0

    # -- verbs -----------------------------------------------------------------------------
    def submit_store(self, job_id: int, gpu_block_ids: Sequence[int] | np.ndarray | torch.Tensor,
                     slot_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
                     sums: bool = False) -> bool:
        """Queue GPU blocks -> pool slots; False when dropped under pressure (nothing copied).

        The copy sees everything the caller's current stream had queued before this call.
        `sums`: the job also sums its blocks, beside its copies (`CopyResult.sums`).
        """
        if sums:
            self._check_can_sum(job_id)
        return self._submit(job_id, True, gpu_block_ids, slot_ids, take_sums=sums)

    def submit_load(self, job_id: int, slot_ids: Sequence[int] | np.ndarray | torch.Tensor,
                    gpu_block_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
                    expect: Sequence[int] | np.ndarray | None = None) -> bool:
        """Queue pool slots -> GPU blocks; always accepted (True). Finished only once on the GPU.

        `expect`: each block's sum (unsigned 64-bit, as a summed store reported it; fastest as
        a uint64 array: Python ints are checked one by one); then only the leading blocks whose
        slots match are copied (`CopyResult.good`), the others' GPU blocks keep their bytes.
        """
        expected = None
        if isinstance(expect, np.ndarray) and expect.dtype == np.uint64 and expect.ndim == 1:
            self._check_can_sum(job_id)
            expected = to_int64(expect).copy()  # its dtype bounds every value; ours to keep
        elif expect is not None:
            self._check_can_sum(job_id)
            values = list(expect)
            # The loop, ~0.3-0.5 ms per 1024 sums, only names a bad one.
            if not all_uint64(values):
                for i, value in enumerate(values):
                    if isinstance(value, bool) or not isinstance(value, int | np.integer) \
                            or not 0 <= int(value) < 1 << 64:
                        raise ValueError(f"job {job_id}: expected sums must be unsigned 64-bit "
                                         f"ints, got {value!r} at {i}")
            expected = to_int64(values)
        return self._submit(job_id, False, gpu_block_ids, slot_ids, expect=expected)

    def reserve_checked_loads(self) -> bool:
        """Allocate now what loads with `expect` need (a GPU's staging buffers: 2 x 64 MiB);
        False, logged, where that fails (then they would fail too: check them another way)."""
        try:
            self._lanes[False].reserve_checked_loads(self.block_bytes)
        except Exception as exc:  # e.g. out of GPU memory next to the engine's cache
            log.warning("no room for checked loads' staging (%s): checks stay on the host", exc)
            return False
        return True

    def check_load(self, job_id: int, slot_ids: Sequence[int] | np.ndarray | torch.Tensor,
                   gpu_block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Raise ValueError where `submit_load` of these ids would, queueing nothing (for a
        caller that submits the load later, in parts)."""
        self._checked_ids(job_id, False, gpu_block_ids, slot_ids)

    def get_finished(self) -> list[CopyResult]:
        """Results of every job that finished (or was dropped) since the last call, once each."""
        results = list(self._dropped.values())
        self._dropped.clear()
        for job_id, job in list(self._jobs.items()):
            if not job.completion.done():
                continue
            del self._jobs[job_id]
            self._busy.add(job.is_store, job.ids, -1)
            if job.spare:
                self._spare.append(job.lane)
            ok, sums, good = job.completion.ok, job.completion.sums, job.completion.good
            nbytes = job.nbytes if good is None else good * self.block_bytes  # bytes that landed
            results.append(CopyResult(job_id, ok, nbytes if ok else 0,
                                          job.completion.seconds if ok else 0.0, job.is_store,
                                          () if sums is None else tuple(to_unsigned(sums)),
                                          good))
        return results

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        """Block until the given jobs (default: all in flight) are done; False on timeout.

        Ids not in flight (reported already, dropped, unknown) count as done. Results still come
        from get_finished.
        """
        ids = list(self._jobs) if job_ids is None else job_ids
        jobs = [self._jobs[i] for i in ids if i in self._jobs]
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.completion.wait(left):
                return False
        return True

    def close(self) -> None:
        """Finish every job in flight, then release the lanes. Unreported results are dropped."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        for lane in (*self._lanes.values(), *self._all_spares):
            lane.close()
        self._jobs.clear()

    @property
    def inflight_store_bytes(self) -> int:
        """Bytes of accepted stores not finished yet (what `max_store_bytes` bounds)."""
        return sum(j.nbytes for j in self._jobs.values()
                   if j.is_store and not j.completion.done())

    # -- internals -------------------------------------------------------------------------
    def _check_can_sum(self, job_id: int) -> None:
        if self.can_sum:
            return
        if self._summable:  # the blocks are not the reason: do not blame them
            raise ValueError(f"job {job_id}: row sums need a backend that sums; the "
                             f"{self.backend.name} backend here cannot (see the log)")
        raise ValueError(f"job {job_id}: row sums need blocks of one segment of whole 32-bit "
                         f"words, word-aligned; these blocks are {len(self.segments)} "
                         f"segment(s) of {self.block_bytes} bytes")

    def _submit(self, job_id: int, is_store: bool, gpu_block_ids: object,
                slot_ids: object, take_sums: bool = False,
                expect: np.ndarray | None = None) -> bool:
        if self._closed:
            raise RuntimeError("the transfer engine is closed")
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise ValueError(f"job id must be an int, got {job_id!r}")
        if job_id in self._jobs or job_id in self._dropped:
            raise ValueError(f"job id {job_id} is still in flight or unreported")
        gpu, slots = self._checked_ids(job_id, is_store, gpu_block_ids, slot_ids)
        if expect is not None and expect.shape != slots.shape:
            raise ValueError(f"job {job_id}: {len(expect)} expected sums for {len(slots)} slots")
        nbytes = len(gpu) * self.block_bytes
        if is_store:
            inflight = self.inflight_store_bytes
            # An idle lane takes any store, so one larger than the bound is never refused forever.
            if inflight and inflight + nbytes > self.max_store_bytes:
                self._dropped[job_id] = CopyResult(job_id, False, 0, 0.0, True)
                return False
        ids = _Ids(gpu, slots)
        after: list[Completion] = []
        if self._busy.may_conflict(is_store, ids):
            after = [j.completion for j in self._jobs.values()
                     if not j.completion.done() and j.conflicts(is_store, ids)]
        spare = bool(after)
        lane = self._take_spare() if spare else self._lanes[is_store]
        # Both directions follow what the compute stream queued before submit: a store must copy
        # what the step wrote; a load must not overwrite a block that a forward already queued
        # (async scheduling runs the CPU a step ahead) may still read.
        if (marker := self.backend.mark_compute()) is not None:
            after.append(marker)
        copy = (RowCopy(job_id, self._store_pairs, gpu, slots, take_sums=take_sums) if is_store
                else RowCopy(job_id, self._load_pairs, slots, gpu, expect=expect))
        completion = lane.submit(copy, after)
        self._jobs[job_id] = _Job(job_id, is_store, nbytes, ids, completion, lane, spare)
        self._busy.add(is_store, ids, 1)
        return True

    def _checked_ids(self, job_id: int, is_store: bool, gpu_block_ids: object,
                     slot_ids: object) -> tuple[np.ndarray, np.ndarray]:
        gpu = _ids(gpu_block_ids, self.num_gpu_blocks, "GPU block id")
        slots = _ids(slot_ids, self.num_slots, "slot id")
        if len(gpu) != len(slots):
            raise ValueError(f"job {job_id}: {len(gpu)} GPU block ids but {len(slots)} slot ids")
        _check_unique(slots if is_store else gpu, "slot id" if is_store else "GPU block id")
        return gpu, slots

    def _take_spare(self) -> Lane:
        if self._spare:
            return self._spare.pop()
        lane = self.backend.new_lane()
        self._all_spares.append(lane)
        return lane


def _ids(values: object, limit: int, what: str) -> np.ndarray:
    """`values` as a 1-D int64 array of ids in [0, limit); ValueError naming the first bad one."""
    arr = _from_ints(values) if isinstance(values, list | tuple) else None
    if arr is None:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"{what}s must be a 1-D sequence, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{what}s must be integers, got {arr.dtype} values "
                             f"{arr[:4].tolist()}")
        arr = arr.astype(np.int64)  # a copy: the caller may reuse its array (its job keeps it)
    # min and max first: a job's ids are checked before its first copy, on its critical path.
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        bad = (arr < 0) | (arr >= limit)
        raise ValueError(f"{what} {int(arr[bad][0])} out of range [0, {limit})")
    return arr


def _from_ints(values: list | tuple) -> np.ndarray | None:
    """A list or tuple of ints (a worker's job carries its ids as a tuple) as a new int64
    array, packed by struct: a fifth to a third of numpy's time from Python ints, and a job's
    ids are converted before its first copy. None where a value is not an int in int64's range
    or the first is a bool: numpy's way then takes them, and names what is wrong."""
    if not values or isinstance(values[0], bool | np.bool_):
        return None
    arr = np.empty(len(values), dtype=np.int64)
    try:
        struct.pack_into(f"{len(values)}q", arr, 0, *values)
    except Exception:  # a float, a str, a list, an int past int64, an __index__ that raises
        return None
    return arr


def _check_unique(dst: np.ndarray, what: str) -> None:
    ordered = np.sort(dst)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        value = int(repeated[0])
        raise ValueError(f"destination {what} {value} appears {int((dst == value).sum())} "
                         f"times in one job")


def _check_segments(segments: Sequence[Segment]) -> list[Segment]:
    if not segments:
        raise ValueError("no segments given")
    out = []
    for i, seg in enumerate(segments):
        for side, t in (("gpu", seg.gpu), ("host", seg.host)):
            if t.dim() != 2 or t.dtype not in (torch.uint8, torch.int8) or t.shape[1] == 0:
                raise ValueError(f"segment {i} {side} must be a 2-D uint8 row tensor, got "
                                 f"{t.dtype} {tuple(t.shape)}")
            if t.shape[1] > 1 and t.stride(1) != 1:
                raise ValueError(f"segment {i} {side} rows are not dense: stride {t.stride()}")
        if seg.gpu.shape[1] != seg.host.shape[1]:
            raise ValueError(f"segment {i}: GPU rows hold {seg.gpu.shape[1]} B, host rows "
                             f"{seg.host.shape[1]} B")
        if seg.gpu.shape[0] != segments[0].gpu.shape[0]:
            raise ValueError(f"segment {i} has {seg.gpu.shape[0]} GPU rows, segment 0 has "
                             f"{segments[0].gpu.shape[0]}")
        if seg.host.shape[0] != segments[0].host.shape[0]:
            raise ValueError(f"segment {i} has {seg.host.shape[0]} host rows, segment 0 has "
                             f"{segments[0].host.shape[0]}")
        out.append(Segment(seg.gpu.view(torch.uint8), seg.host.view(torch.uint8)))
    return out
