"""A CUDA lane: a dedicated non-blocking stream; events order and time its jobs
(transfer/copy/cuda.py issues their copies; transfer/copy/cuda_sums.py their row sums).

Streams are created here, not taken from torch's stream pool (which hands the same 32 streams
round-robin to every caller, so a lane could end up queued behind someone else's work).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch

from transfer.copy.base import Completion, Lane, RowCopy
from transfer.copy.cuda_sums import LaneSums, SumsOutput

log = logging.getLogger(__name__)

_POLL_SECONDS = 1e-4
Issue = Callable[[RowCopy, torch.cuda.ExternalStream], None]


def runtime() -> ModuleType:
    from cuda.bindings import runtime

    return runtime


def check(err: object, what: str) -> None:
    if int(err) != 0:  # cudaSuccess
        raise RuntimeError(f"{what} failed: {err}")


class CudaCompletion(Completion):
    """The end event of a job on a lane (and its start event, for timing)."""

    def __init__(self, start: torch.cuda.Event | None, end: torch.cuda.Event | None,
                 error: BaseException | None = None, output: SumsOutput | None = None) -> None:
        self.start, self.end, self.error = start, end, error
        self._output = output  # a summing job's results, written by its end
        # A job that failed part-way may have queued copies before the failure: it is done only
        # when its end event is (nothing may reuse its blocks or slots earlier). Done at once
        # only when nothing was queued.
        self._done = end is None

    def done(self) -> bool:
        if not self._done:
            try:
                self._done = self.end.query()  # type: ignore[union-attr]
            except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
                self.error, self._done = exc, True
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None and not self._done:
            try:
                self.end.synchronize()  # type: ignore[union-attr]
            except RuntimeError as exc:
                self.error = exc
            self._done = True
        deadline = time.monotonic() + (timeout or 0.0)
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)
        return True

    @property
    def ok(self) -> bool:
        return self.done() and self.error is None

    @property
    def seconds(self) -> float:
        if self.start is None or not self.ok:
            return 0.0
        return self.start.elapsed_time(self.end) / 1e3

    @property
    def sums(self) -> np.ndarray | None:
        out = self._output
        return out.values.numpy().copy() if out and not out.is_load and self.ok else None

    @property
    def good(self) -> int | None:
        out = self._output
        return int(out.values[0]) if out and out.is_load and self.ok else None


def new_stream(device: torch.device) -> tuple[object, torch.cuda.ExternalStream]:
    rt = runtime()
    with torch.cuda.device(device):
        err, handle = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        check(err, "cudaStreamCreateWithFlags")
    return handle, torch.cuda.ExternalStream(int(handle), device=device)


class StreamLane(Lane):
    """A lane on a stream of its own; `issue` queues a job's copies on a stream."""

    def __init__(self, device: torch.device, issue: Issue) -> None:
        self.device, self._issue = device, issue
        self._handle, self.stream = new_stream(device)
        self._sums: LaneSums | None = None  # its second stream, made at the first summed job
        self._sums_handle: object = None

    def submit(self, copy: RowCopy, after: Sequence[Completion]) -> Completion:
        if any(prior.done() and not prior.ok for prior in after):
            return CudaCompletion(None, None, RuntimeError(
                f"job {copy.job_id}: a job it must follow failed; nothing copied"))
        with torch.cuda.device(self.device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            for prior in after:
                self.stream.wait_event(prior.end)  # type: ignore[attr-defined]
            start.record(self.stream)
            error: BaseException | None = None
            output = None
            if self._sums is not None:  # what a failure below hands on is this job's alone
                self._sums.holding = None
            try:
                if copy.expect is not None:
                    output = self._summing().issue_load(copy, self.stream, self._issue,
                                                        end)
                else:
                    self._issue(copy, self.stream)
                    if copy.take_sums:
                        output = self._summing().issue_store(copy, self.stream, start, end)
            except Exception as exc:  # reported as a failed job, never raised into the step
                log.error("job %s: issuing %d copies failed: %s", copy.job_id,
                          len(copy.src_rows) * len(copy.pairs), exc)
                error = exc
                if self._sums is not None:  # what kernels queued before the failure read
                    output, self._sums.holding = self._sums.holding, None
            if error is not None and self._sums is not None:
                self.stream.wait_stream(self._sums.stream)  # what was queued there ends first
            if error is not None or output is None:
                end.record(self.stream)
        return CudaCompletion(start, end, error, output)

    def reserve_checked_loads(self, row_bytes: int) -> None:
        self._summing().reserve(row_bytes)

    def _summing(self) -> LaneSums:
        if self._sums is None:
            handle, stream = new_stream(self.device)
            try:
                self._sums = LaneSums(self.device, stream)
            except BaseException:
                runtime().cudaStreamDestroy(handle)
                raise
            self._sums_handle = handle
        return self._sums

    def close(self) -> None:
        for handle in (self._handle, self._sums_handle):
            if handle is not None:
                runtime().cudaStreamDestroy(handle)
        self._handle = self._sums_handle = None
