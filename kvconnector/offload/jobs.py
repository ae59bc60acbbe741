"""What the scheduler side sends the workers each step, and what they report back.

`StepJobs` (built by OffloadScheduler.build_step) travels in the connector metadata to every
worker; `JobReport` (OffloadWorker.take_report) travels back in the connector output, summed over
ranks by vLLM's aggregation. Both are small and picklable. `TransferEvents` (OffloadWorker.poll)
is what a worker's jobs mean to vLLM's get_finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from transfer.checksums import all_uint64
from transfer.tier import TierOp

# A job's row sums travel packed (`TransferJob.row_sums`): a worker hands its rank's to the copy
# engine as one array, with no per-block Python work on the load's path.
ROW_SUM_DTYPE = np.dtype("<u8")


@dataclass(frozen=True)
class TransferJob:
    """Copy `block_ids[i]` (GPU) <-> `slots[i]` (host pool) for every i, as one job.

    A load's `fetches`: ops of the tiers below the pool (in tier order) that fill its last
    slots (`fetch_slots`) before the copy; the copy then loads the head of its slots that holds
    good blocks. `fail`: the job cannot run (no slot for a fetch, no pin); the worker reports it
    failed at once. `pool`: the pool segment the slots belong to ("" for each worker's own pool).

    A checked pool's blocks carry checksums (transfer/slot_checker.py): `checked` are the keys
    of the job's first len(checked) slots; a store hashes each worker's part of them and reports
    it (`JobReport.sums`); a load checks each worker's part against `sums` (per block, one
    checksum per rank) and fails from the first block that differs. `row_sums`: per rank, the
    row sum (transfer/copy/row_sums.py) of each checked block, packed (`pack_row_sums`), where
    every block was committed with them; a worker whose copy engine sums rows checks those on
    the way instead. `hash_later`: a store
    committed by its row sums also gets its xxh3s after (some reader or tier needs them).
    """

    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    fail: bool = False
    pool: str = ""
    checked: tuple[bytes, ...] = ()
    sums: tuple[tuple[int, ...], ...] = ()
    row_sums: tuple[bytes, ...] = ()
    fetches: tuple[TierOp, ...] = ()
    hash_later: bool = True

    @property
    def fetch_slots(self) -> tuple[int, ...]:
        """Pool slots the fetches fill before the copy."""
        return self.slots[len(self.slots) - sum(len(op.keys) for op in self.fetches):]

    @property
    def fetch_keys(self) -> tuple[bytes, ...]:
        return tuple(key for op in self.fetches for key in op.keys)

    def rank_row_sums(self, rank: int) -> np.ndarray | None:
        """Rank `rank`'s row sums of the checked blocks (unsigned 64-bit, read-only); None
        where the job carries none for that rank."""
        if rank >= len(self.row_sums):
            return None
        return np.frombuffer(self.row_sums[rank], dtype=ROW_SUM_DTYPE)


def pack_row_sums(by_block: Sequence[Sequence[int | None]], ranks: int) -> tuple[bytes, ...]:
    """Each block's per-rank row sums -> `TransferJob.row_sums`; () unless every block carries
    an unsigned 64-bit int for each of the `ranks` ranks (such a load is checked by xxh3: the
    copy engine takes packed sums as they are)."""
    if not by_block or set(map(len, by_block)) != {ranks}:
        return ()
    flat = list(itertools.chain.from_iterable(by_block))
    if not all_uint64(flat):  # a None, or a value no summed store reports
        return ()
    table = np.array(flat, dtype=ROW_SUM_DTYPE).reshape(len(by_block), ranks)
    return tuple(table[:, rank].tobytes() for rank in range(ranks))


@dataclass
class StepJobs:
    """The work of one engine step, for every worker (small and picklable).

    `flush`: ids of store jobs to finish before this step's forward (their blocks were freed by a
    preemption and may be written again now). `held`: requests whose blocks the connector keeps
    after they finished; a worker reports each as finished sending once its stores are done.
    `writes`: tier writes out of pool slots; one of blocks the pool evicted runs before the
    stores that reuse their slots (the worker orders them). `erase`: tiers that were reset, whose
    workers forget every block they stored.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    writes: list[TierOp] = field(default_factory=list)
    erase: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.flush or self.held or self.writes
                    or self.erase)


@dataclass
class JobReport:
    """Jobs one or more workers finished since their last report; `merged` sums two reports."""

    done: dict[int, int] = field(default_factory=dict)  # job id -> workers that copied it
    failed: dict[int, int] = field(default_factory=dict)  # job id -> workers that failed it
    written: dict[int, int] = field(default_factory=dict)  # tier write id -> workers done
    # tier op (a write's id, or a load's for its fetches) -> keys that failed there
    bad: dict[int, list[bytes]] = field(default_factory=dict)
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)  # tier -> its counts
    # store -> rank -> its xxh3s (None each: committed by row sums, hashed after), then row
    # sums where taken (transfer.checksums.block_sums)
    sums: dict[int, dict[int, list[int | None]]] = field(default_factory=dict)
    checksum_failures: int = 0  # loads refused: a checked pool's block checksum differed
    # store committed by row sums -> rank -> its blocks' xxh3s, taken after the commit (None: the
    # slot no longer matched the committed row sums)
    hashed: dict[int, dict[int, list[int | None]]] = field(default_factory=dict)
    # rank -> whether it checks loads by row sums (sent once it mapped a shared pool)
    row_sum_reads: dict[int, bool] = field(default_factory=dict)

    def merged(self, other: JobReport) -> JobReport:
        counts = [_summed(a, b) for a, b in ((self.done, other.done), (self.failed, other.failed),
                                              (self.written, other.written))]
        bad = {op: list(keys) for op, keys in self.bad.items()}
        for op_id, keys in other.bad.items():
            bad[op_id] = bad.get(op_id, []) + [k for k in keys if k not in bad.get(op_id, ())]
        totals = [getattr(self, name) + getattr(other, name) for name in _TOTALS]
        sums = {job: dict(ranks) for job, ranks in self.sums.items()}
        for job_id, ranks in other.sums.items():
            sums.setdefault(job_id, {}).update(ranks)
        failures = self.checksum_failures + other.checksum_failures
        hashed = {job: dict(ranks) for job, ranks in self.hashed.items()}
        for job_id, ranks in other.hashed.items():
            hashed.setdefault(job_id, {}).update(ranks)
        out = JobReport(*counts, bad, *totals, {}, sums, failures, hashed,
                        {**self.row_sum_reads, **other.row_sum_reads})
        for report in (self, other):
            for tier, tier_counts in report.tiers.items():
                out.count(tier, tier_counts)
        return out

    def is_empty(self) -> bool:
        """Nothing to send (a report of tier counts or bad keys alone is not empty)."""
        return not (self.done or self.failed or self.written or self.bad
                    or any(any(c.values()) for c in self.tiers.values())
                    or self.checksum_failures or self.hashed or self.row_sum_reads)

    def count(self, tier: str, counts: dict[str, float]) -> None:
        """Add a tier's counts."""
        mine = self.tiers.setdefault(tier, {})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value


_TOTALS = ("load_bytes", "load_seconds", "store_bytes", "store_seconds")


def _summed(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for job_id, count in b.items():
        out[job_id] = out.get(job_id, 0) + count
    return out


@dataclass
class TransferEvents:
    """What finished since the last poll, in vLLM's terms.

    A failed load is in `finished_loads` AND `failed_loads`, and its GPU blocks are in
    `failed_block_ids`, so the engine both releases the request and recomputes the blocks.
    `finished_sending`: held requests whose stores are all done here.
    """

    finished_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)

    def update(self, other: TransferEvents) -> None:
        self.finished_loads |= other.finished_loads
        self.failed_loads |= other.failed_loads
        self.failed_block_ids |= other.failed_block_ids
        self.finished_sending |= other.finished_sending

    def load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        """The load of `req_id` ended, and vLLM recomputes `block_ids` (from the first)."""
        self.finished_loads.add(req_id)
        self.failed_loads.add(req_id)
        self.failed_block_ids.update(block_ids)
