"""Loads of a shared pool's blocks, each block checked before it is copied: by its xxh3, or, a
block committed by row sums and not hashed, by its row sum (on the host, where the copy engine
does not check them on the way: transfer/slot_checker.py).

Another process can write a shared slot after its commit (transfer/slot_checker.py), and a
corrupt block must never reach a KV block, so a load's checked blocks go to the copy engine only
once their checksums matched. Without losing the copy's bandwidth: the load is cut into chunks of
about CHUNK_BYTES (the first one a block per checker thread), every chunk's check starts at once
(in order, on the checker's threads), and a chunk is submitted as soon as its check passed, so
chunk k copies while the next ones are checked. Submits happen on the caller's thread
(`advance` at its poll points, `submit_all` where it may block): the copy engine is called from
one thread only, and a CUDA submit orders the copy after the caller's compute stream, which a
checker thread does not have.

From the first bad block on nothing more is submitted: the good blocks before it are copied and
`good` says how many (the caller fails the rest, vLLM recomputes them). Each chunk is an engine
job of its own id (negative: apart from the scheduler's ids); the load's result sums its chunks
once every submitted chunk copied and every check ended (the checker threads read the slots
until then, so the mapping outlives them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvconnector.offload.jobs import TransferJob
from transfer.engine import CopyResult, TransferEngine
from transfer.slot_checker import SlotChecker

# Per chunk, a submit and its completion cost host time that hashing threads contend for: on
# the H200, 2 GiB of 2 MiB blocks loaded at 24.8 GB/s in 16 MiB chunks, 39.0 in 64 MiB,
# 44.4 in 128 MiB, 43.6 in 256 MiB (docs/benchmarks.md, shared host pool).
CHUNK_BYTES = 128 << 20


@dataclass
class _Load:
    """One load in flight: its chunks [start, end) with their checks (None: nothing to check,
    e.g. blocks fetched into the pool, checked by their own tier), how many are submitted."""

    job_id: int
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    chunks: list[tuple[int, int, Future[int] | None]]
    submitted: int = 0
    good: int | None = None  # leading good blocks, once a check failed
    copying: int = 0  # chunks submitted, not yet copied
    ok: bool = True  # every chunk copied so far copied whole
    nbytes: int = 0
    seconds: float = 0.0

    def stopped(self) -> bool:
        return self.submitted == len(self.chunks) or self.good is not None or not self.ok

    def settled(self) -> bool:
        return self.copying == 0 and self.stopped() and \
            all(check is None or check.done() for _, _, check in self.chunks)


class CheckedLoads:
    """The checked loads of one worker of rank `rank` over `checker`'s threads (see module doc)."""

    def __init__(self, checker: SlotChecker, rank: int) -> None:
        self.checker = checker
        self.rank = rank
        self._loads: dict[int, _Load] = {}
        self._chunks: dict[int, int] = {}  # engine job id of a chunk -> its load's job id
        self._ids = itertools.count(-1, -1)
        self._good: dict[int, int] = {}  # settled load whose check failed -> its `good`

    def start(self, job: TransferJob, head: int, rows: torch.Tensor,
              engine: TransferEngine) -> bool:
        """Check the job's first `head` slots (this rank's part of each is its row of `rows`)
        before they are copied into its first `head` blocks; False when none of them carries a
        checksum (copy them at once). Bad ids raise ValueError here, before any check runs."""
        checked = min(head, len(job.checked))
        if not checked:
            return False
        engine.check_load(job.job_id, job.slots[:head], job.block_ids[:head])
        # A missing checksum (a rank the commit lacks) fails its block's check; a block not
        # hashed is checked by its row sum (a worker whose copy engine does not check them).
        sums = rank_sums(job.sums[:checked], self.rank)
        sums += [None] * (checked - len(sums))
        rows_of_rank = job.rank_row_sums(self.rank)
        by_rows: list[int | None] = [] if rows_of_rank is None else \
            rows_of_rank[:checked].tolist()
        by_rows += [None] * (checked - len(by_rows))
        step = max(1, CHUNK_BYTES // max(1, int(rows.shape[1])))
        # The first chunk is a block per thread: the copy starts after one block's check.
        ends = [min(step, self.checker.threads, checked)]
        while ends[-1] < checked:
            ends.append(min(ends[-1] + step, checked))
        chunks: list[tuple[int, int, Future[int] | None]] = []
        for start, end in zip([0, *ends], ends, strict=False):
            chunks.append((start, end, self.checker.verify(rows, job.slots[start:end],
                                                           job.checked[start:end],
                                                           sums[start:end],
                                                           by_rows[start:end])))
        if checked < head:
            chunks.append((checked, head, None))
        self._loads[job.job_id] = _Load(job.job_id, job.slots[:head], job.block_ids[:head], chunks)
        return True

    def advance(self, engine: TransferEngine) -> None:
        """Submit every chunk whose check passed (and the chunks before it did); never blocks."""
        for load in self._loads.values():
            self._advance(load, engine)

    def submit_all(self, engine: TransferEngine) -> None:
        """Submit every chunk that passes its check, waiting for each check in turn."""
        for load in list(self._loads.values()):
            for _, _, check in load.chunks:
                if check is not None:
                    check.exception()  # waits
                self._advance(load, engine)

    def _advance(self, load: _Load, engine: TransferEngine) -> None:
        while not load.stopped():
            start, end, check = load.chunks[load.submitted]
            if check is not None:
                if not check.done():
                    return
                # A check that could not run proves nothing: its blocks are refused.
                passed = 0 if check.exception() is not None else check.result()
                if passed < end - start:
                    load.good = end = start + passed
            if end > start:
                chunk = next(self._ids)
                engine.submit_load(chunk, load.slots[start:end], load.block_ids[start:end])
                self._chunks[chunk] = load.job_id
                load.copying += 1
            load.submitted += 1

    def copied(self, result: CopyResult) -> bool:
        """Take a finished engine job: True when it is a chunk of a load here."""
        job_id = self._chunks.pop(result.job_id, None)
        if job_id is None:
            return False
        load = self._loads[job_id]
        load.copying -= 1
        load.ok = load.ok and result.ok
        load.nbytes += result.nbytes
        load.seconds += result.seconds
        return True

    def settled(self, engine: TransferEngine) -> list[CopyResult]:
        """Submit what passed its check (`advance`), then the loads settled since the last call,
        each as one copy result (its chunks summed); a load with a failed check copied its good
        head only (`take_good` says how long)."""
        self.advance(engine)
        out = []
        for job_id, load in list(self._loads.items()):
            if load.settled():
                del self._loads[job_id]
                if load.good is not None:
                    self._good[job_id] = load.good
                out.append(CopyResult(job_id, load.ok, load.nbytes if load.ok else 0,
                                          load.seconds if load.ok else 0.0, False))
        return out

    def take_good(self, job_id: int) -> int | None:
        """The leading good blocks of a finished load whose check failed; None: all good (or
        not a load checked here)."""
        return self._good.pop(job_id, None)

    def wait(self) -> None:
        """Block until every check started is done."""
        for load in self._loads.values():
            for _, _, check in load.chunks:
                if check is not None:
                    check.exception()


def rank_sums(blocks: Sequence[Sequence[int]], rank: int) -> list[int | None]:
    """Rank `rank`'s entry of each block's per-rank checksums (None where the block lacks it)."""
    return [sums[rank] if rank < len(sums) else None for sums in blocks]
