"""Copy backends: how one job's row copies run, in order, on a lane.

A `Segment` pairs a 2-D uint8 GPU tensor (rows = GPU block ids) with a 2-D uint8 host tensor
(rows = pool slots) of the same row bytes. A block-major cache has one segment (whole blocks, one
copy per block); the fallback for other caches has one per layer (one copy per layer per block).
A `RowCopy` is one job over all segments: row `src_rows[i]` -> row `dst_rows[i]` of each, issued
as one batch. With one segment it may also carry row sums (transfer/copy/row_sums.py): a store's
`take_sums` sums its GPU rows beside its copies; a load's `expect` goes through a staging copy
first, and only its leading rows whose sums match go on into the GPU rows (`Completion.good`
says how many).

A `Lane` runs row copies in submission order (a CUDA stream, or a worker thread on CPU), each
after the `Completion`s it names; `submit` returns a Completion at once and never blocks.
A `CopyBackend` makes lanes. The CPU backend here runs copies on threads and takes a `gate` that
tests use to hold a job in flight; the CUDA backends (batched DMA, SM kernel) live in
`transfer.copy.cuda` and are imported only when asked for.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from transfer.copy.row_sums import checked_copy, row_sums

# A checked load goes through STAGE_BUFFERS staging buffers of this many bytes of rows (one
# buffer's rows go on into the cache while the next fills). On the H200, 2 GiB loads of 2 and
# 4 MiB blocks checked/plain: 32 MiB x 3 0.95, 64 MiB x 2 0.97, 64 MiB x 3 0.97 (the host
# issues a buffer's chunk in ~0.13 ms, so fewer, larger chunks block the submit less).
STAGE_BYTES = 64 << 20
STAGE_BUFFERS = 2


@dataclass(frozen=True)
class Segment:
    """One region of every block: GPU rows (num_gpu_blocks, nbytes), host rows (num_slots,
    nbytes). Both 2-D uint8, rows dense; the row stride may exceed the row bytes."""

    gpu: torch.Tensor
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.gpu.shape[1])


@dataclass(frozen=True, eq=False)
class RowCopy:
    """One job's copies: for each (src, dst) pair, row src_rows[i] -> row dst_rows[i]."""

    job_id: int
    pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    src_rows: np.ndarray  # int64
    dst_rows: np.ndarray  # int64
    take_sums: bool = False  # a store: the row sums of its GPU rows, beside its copies
    expect: np.ndarray | None = None  # a load: each row's sum (int64), checked before it lands

    @property
    def nbytes(self) -> int:
        return len(self.src_rows) * sum(int(src.shape[1]) for src, _ in self.pairs)

    @property
    def is_load(self) -> bool:
        """Host rows -> GPU rows (a store copies GPU rows -> host rows)."""
        return self.pairs[0][0].device.type == "cpu"

    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src addresses, dst addresses, sizes), one entry per row per pair, as int64 arrays."""
        n = len(self.src_rows)
        srcs = np.empty(n * len(self.pairs), dtype=np.int64)
        dsts = np.empty_like(srcs)
        sizes = np.empty_like(srcs)
        for k, (src, dst) in enumerate(self.pairs):
            part = slice(k * n, (k + 1) * n)
            # Element strides are byte strides: every tensor here is uint8.
            srcs[part] = src.data_ptr() + self.src_rows * src.stride(0)
            dsts[part] = dst.data_ptr() + self.dst_rows * dst.stride(0)
            sizes[part] = src.shape[1]
        return srcs, dsts, sizes

    def run_rows(self) -> None:
        """Copy on host tensors with numpy's fancy indexing, STAGE_BYTES of rows at a time (a
        bounded temporary): numpy moves the rows without the GIL, so the engine's own Python
        thread never waits behind a Python loop of small copies, nor they behind it."""
        for src, dst in self.pairs:
            src_array, dst_array = src.numpy(), dst.numpy()
            per = max(1, STAGE_BYTES // int(src.shape[1]))
            for start in range(0, len(self.src_rows), per):
                rows = slice(start, start + per)
                dst_array[self.dst_rows[rows]] = src_array[self.src_rows[rows]]

    def run_summed(self) -> tuple[np.ndarray | None, int | None]:
        """Run the copy on host tensors with its sums: (a store's row sums, a checked load's
        good rows). A checked load stages STAGE_BYTES of rows at a time, as a GPU does."""
        if self.expect is None:
            self.run_rows()
            if not self.take_sums:
                return None, None
            gpu = self.pairs[0][0]
            return row_sums(gpu, torch.from_numpy(self.src_rows)).numpy(), None
        (host, gpu), = self.pairs
        per = max(1, STAGE_BYTES // int(host.shape[1]))
        run, good = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        expect, dst_rows = torch.from_numpy(self.expect), torch.from_numpy(self.dst_rows)
        for start in range(0, len(self.src_rows), per):
            end = min(start + per, len(self.src_rows))
            stage = host.index_select(0, torch.from_numpy(self.src_rows[start:end]))
            checked_copy(stage, expect[start:end], gpu, dst_rows[start:end], run, good)
        return None, int(good)


class Completion(ABC):
    """The end of one submitted copy (or a point in the compute stream a copy must follow)."""

    @abstractmethod
    def done(self) -> bool:
        """True once finished, successfully or not; never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds passed; True when done."""

    @property
    @abstractmethod
    def ok(self) -> bool:
        """True when done and every byte was copied."""

    @property
    @abstractmethod
    def seconds(self) -> float:
        """How long the copy itself ran (0.0 when it failed)."""

    @property
    def sums(self) -> np.ndarray | None:
        """A store's row sums (int64, per row), once ok; None for other copies."""
        return None

    @property
    def good(self) -> int | None:
        """A checked load's leading rows that matched their sums and were copied (the rest were
        not written), once ok; None for other copies."""
        return None


class Lane(ABC):
    """An ordered queue of copies: a CUDA stream, or a worker thread on CPU."""

    @abstractmethod
    def submit(self, copy: RowCopy, after: Sequence[Completion]) -> Completion:
        """Queue `copy` behind this lane's earlier copies and behind `after`; never blocks.

        If any of `after` fails, `copy` fails without moving a byte.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the lane; only call when everything submitted to it is done."""

    def reserve_checked_loads(self, row_bytes: int) -> None:
        """Allocate now what checked loads of rows of `row_bytes` need (GPU staging buffers);
        raises where that fails. Nothing to do on a host lane."""
        return None


class CopyBackend(ABC):
    """Makes lanes for one device and says which tensors it can copy."""

    name: str

    @abstractmethod
    def check(self, segments: Sequence[Segment]) -> None:
        """Raise ValueError, naming the tensor, when this backend cannot copy these segments."""

    @abstractmethod
    def new_lane(self) -> Lane:
        """A fresh lane, independent of every other lane."""

    def mark_compute(self) -> Completion | None:
        """A point after all work queued so far on the caller's compute stream (None on CPU)."""
        return None

    @property
    def sums_rows(self) -> bool:
        """Whether this backend's lanes take row sums (RowCopy.take_sums / expect)."""
        return True


# -- CPU backend: one thread per lane ----------------------------------------------------------

Gate = Callable[[int], None]


class ThreadCompletion(Completion):
    def __init__(self) -> None:
        self._event = threading.Event()
        self._ok = False
        self._seconds = 0.0
        self._sums: np.ndarray | None = None
        self._good: int | None = None

    def finish(self, ok: bool, seconds: float = 0.0, sums: np.ndarray | None = None,
               good: int | None = None) -> None:
        self._ok, self._seconds, self._sums, self._good = ok, seconds, sums, good
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    @property
    def ok(self) -> bool:
        return self._event.is_set() and self._ok

    @property
    def seconds(self) -> float:
        return self._seconds

    @property
    def sums(self) -> np.ndarray | None:
        return self._sums if self.ok else None

    @property
    def good(self) -> int | None:
        return self._good if self.ok else None


class _ThreadLane(Lane):
    def __init__(self, gate: Gate | None) -> None:
        self._gate = gate
        self._queue: queue.SimpleQueue[tuple[RowCopy, Sequence[Completion], ThreadCompletion]
                                       | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-copy-lane", daemon=True)
        self._thread.start()

    def submit(self, copy: RowCopy, after: Sequence[Completion]) -> Completion:
        done = ThreadCompletion()
        self._queue.put((copy, tuple(after), done))
        return done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            copy, after, done = item
            ok, seconds, sums, good = False, 0.0, None, None
            try:
                for prior in after:
                    prior.wait()
                if all(prior.ok for prior in after):
                    if self._gate is not None:
                        self._gate(copy.job_id)
                    start = time.perf_counter()
                    sums, good = copy.run_summed()
                    ok, seconds = True, time.perf_counter() - start
            except Exception:  # a failed copy is reported as not ok; the lane keeps running
                ok = False
            done.finish(ok, seconds, sums, good)


class ThreadBackend(CopyBackend):
    """Copies between host tensors on worker threads (CPU-only machines, CI).

    `gate(job_id)`, when given, is called on the lane's thread before each copy runs; tests block
    in it to hold a job in flight.
    """

    name = "thread"

    def __init__(self, gate: Gate | None = None) -> None:
        self._gate = gate

    def check(self, segments: Sequence[Segment]) -> None:
        for i, seg in enumerate(segments):
            for side, t in (("gpu", seg.gpu), ("host", seg.host)):
                if t.device.type != "cpu":
                    raise ValueError(f"segment {i} {side} tensor is on {t.device}; the thread "
                                     f"backend copies host tensors only (use 'dma' or 'sm')")

    def new_lane(self) -> Lane:
        return _ThreadLane(self._gate)
