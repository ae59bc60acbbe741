"""Row sums on a CUDA lane (transfer/copy/row_sums.py): a store's sums, a checked load's checks.

Each lane that sums gets a second stream of its own, so its copies never wait for a sum:
- a store's rows are summed on it once the lane has copied them (the job ends there);
- a checked load is DMA'd chunk by chunk into STAGE_BUFFERS staging buffers of STAGE_BYTES
  (transfer.copy.base) on the lane's stream; the second stream sums each chunk as it lands and
  copies its leading good rows on into the cache (`checked_copy`), while the lane fills the
  next buffer. A buffer is filled again only once its rows went on. The host queues the whole
  job at submit and never waits: the good count comes back through pinned memory by the job's
  end event.
Nothing here is imported without CUDA (transfer.copy.cuda imports it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from transfer.copy import base
from transfer.copy.base import RowCopy
from transfer.copy.row_sums import checked_copy, row_sums

Issue = Callable[[RowCopy, torch.cuda.ExternalStream], None]


class LaneSums:
    """The summing side of one lane on `device`, on `stream` (see module doc)."""

    def __init__(self, device: torch.device, stream: torch.cuda.ExternalStream) -> None:
        self.device, self.stream = device, stream
        self._stages: list[torch.Tensor] = []
        self._freed: list[torch.cuda.Event | None] = []  # each buffer's last use

    def issue_store(self, copy: RowCopy, lane: torch.cuda.ExternalStream,
                    end: torch.cuda.Event) -> torch.Tensor:
        """Sum the store's GPU rows once `lane` copied them; records `end` after the sums.
        Returns the pinned int64 sums, valid once `end` is."""
        copied = torch.cuda.Event()
        copied.record(lane)
        out = torch.empty(len(copy.src_rows), dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            ids = _to_device(copy.src_rows, self.device)
            out.copy_(row_sums(copy.pairs[0][0], ids), non_blocking=True)
            end.record(self.stream)
        return out

    def issue_load(self, copy: RowCopy, lane: torch.cuda.ExternalStream, issue: Issue,
                   end: torch.cuda.Event) -> torch.Tensor:
        """Queue a checked load (see module doc); records `end` after its last rows went on.
        Returns the pinned int64 [good rows], valid once `end` is."""
        (host, gpu), = copy.pairs
        nbytes = int(host.shape[1])
        per = max(1, base.STAGE_BYTES // nbytes)
        self._ensure_stages(per, nbytes)
        out = torch.empty(1, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.stream):
            expect = _to_device(copy.expect, self.device)
            ids = _to_device(copy.dst_rows, self.device)
            run = torch.ones(1, dtype=torch.int64, device=self.device)
            good = torch.zeros(1, dtype=torch.int64, device=self.device)
        n = len(copy.src_rows)
        for k, start in enumerate(range(0, n, per)):
            end_row = min(start + per, n)
            buf = k % len(self._stages)
            stage = self._stages[buf][:end_row - start]
            if self._freed[buf] is not None:
                lane.wait_event(self._freed[buf])
            issue(RowCopy(copy.job_id, ((host, stage),), copy.src_rows[start:end_row],
                          np.arange(end_row - start, dtype=np.int64)), lane)
            landed = torch.cuda.Event()
            landed.record(lane)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(landed)
                checked_copy(stage, expect[start:end_row], gpu, ids[start:end_row], run, good)
                freed = torch.cuda.Event()
                freed.record(self.stream)
            self._freed[buf] = freed
        with torch.cuda.stream(self.stream):
            out.copy_(good, non_blocking=True)
            end.record(self.stream)
        return out

    def _ensure_stages(self, rows: int, nbytes: int) -> None:
        if self._stages and tuple(self._stages[0].shape) == (rows, nbytes):
            return
        # Rows of another size (not within one engine): the old buffers' work finishes first.
        torch.cuda.synchronize(self.device)
        self._stages = [torch.empty(rows, nbytes, dtype=torch.uint8, device=self.device)
                        for _ in range(base.STAGE_BUFFERS)]
        self._freed = [None] * base.STAGE_BUFFERS


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 array to `device`, queued on the current stream (torch keeps the pinned copy
    alive until the transfer ran)."""
    return torch.from_numpy(np.ascontiguousarray(values)).pin_memory().to(device,
                                                                          non_blocking=True)
