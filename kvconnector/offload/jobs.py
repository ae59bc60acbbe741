"""What the scheduler side sends the workers each step, and what they report back.

`StepJobs` (built by OffloadScheduler.build_step) travels in the connector metadata to every
worker; `JobReport` (OffloadWorker.take_report) travels back in the connector output, summed over
ranks by vLLM's aggregation. Both are small and picklable. `TransferEvents` (OffloadWorker.poll)
is what a worker's jobs mean to vLLM's get_finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferJob:
    """Copy `block_ids[i]` (GPU) <-> `slots[i]` (host pool) for every i, as one job.

    With a remote tier: a store's `keys` are put to the store after the copy (write-through);
    a load's `keys` are fetched from the store into the last len(keys) slots before the copy.
    With a disk tier: a load's `disk_keys` are read from `disk_slots` into the slots before
    those (after the blocks the pool holds). `fail`: the job cannot run (no slot for a fetch,
    no pin); the worker reports it failed at once. `pool`: the shared pool's segment the slots
    belong to ("" for each worker's own pool).

    A shared pool's blocks carry checksums (transfer/shared/checks.py): `checked` are the keys
    of the job's first len(checked) slots; a store hashes each worker's part of them and reports
    it (`JobReport.sums`); a load checks each worker's part against `sums` (per block, one
    checksum per rank) and fails from the first block that differs. `row_sums`: per block, one
    row sum per rank (transfer/copy/row_sums.py), where the block was committed with them; a
    worker whose copy engine sums rows checks those on the way instead.
    """

    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...] = ()
    fail: bool = False
    disk_keys: tuple[bytes, ...] = ()
    disk_slots: tuple[int, ...] = ()
    pool: str = ""
    checked: tuple[bytes, ...] = ()
    sums: tuple[tuple[int, ...], ...] = ()
    row_sums: tuple[tuple[int, ...], ...] = ()

    @property
    def fetch_slots(self) -> tuple[int, ...]:
        """Pool slots a disk read or a remote get fills before the copy."""
        return self.slots[len(self.slots) - len(self.keys) - len(self.disk_keys):]


@dataclass(frozen=True)
class DiskWrite:
    """Write pool `slots` (holding `keys`) to `disk_slots`, one block each. A spill of blocks
    the pool evicted runs before the stores that reuse their slots (the worker orders them).
    `pool`: the shared pool's segment of the slots ("" for each worker's own pool); `sums`: per
    block, the per-rank checksums it was committed with (a shared pool's), which each worker
    writes into its footers instead of hashing its part again; empty: hashed on the disk
    threads."""

    job_id: int
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    disk_slots: tuple[int, ...]
    pool: str = ""
    sums: tuple[tuple[int, ...], ...] = ()


@dataclass
class StepJobs:
    """The work of one engine step, for every worker (small and picklable).

    `flush`: ids of store jobs to finish before this step's forward (their blocks were freed by a
    preemption and may be written again now). `held`: requests whose blocks the connector keeps
    after they finished; a worker reports each as finished sending once its stores are done.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    spills: list[DiskWrite] = field(default_factory=list)
    erase_disk: bool = False  # the tiers were reset: no block on disk may come back

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.flush or self.held or self.spills
                    or self.erase_disk)


@dataclass
class JobReport:
    """Jobs one or more workers finished since their last report; `merged` sums two reports."""

    done: dict[int, int] = field(default_factory=dict)  # job id -> workers that copied it
    failed: dict[int, int] = field(default_factory=dict)  # job id -> workers that failed it
    put: dict[int, int] = field(default_factory=dict)  # store job id -> workers done putting it
    spilled: dict[int, int] = field(default_factory=dict)  # DiskWrite id -> workers done
    disk_bad: dict[int, list[bytes]] = field(default_factory=dict)  # job -> keys a disk failed
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    # store -> rank -> its blocks' xxh3s, then their row sums where taken (protocol.block_sums)
    sums: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    checksum_failures: int = 0  # loads refused: a shared pool block's checksum differed

    def merged(self, other: JobReport) -> JobReport:
        counts = [_summed(a, b) for a, b in ((self.done, other.done), (self.failed, other.failed),
                                              (self.put, other.put),
                                              (self.spilled, other.spilled))]
        bad = {job: list(keys) for job, keys in self.disk_bad.items()}
        for job_id, keys in other.disk_bad.items():
            bad[job_id] = bad.get(job_id, []) + [k for k in keys if k not in bad.get(job_id, ())]
        totals = [getattr(self, name) + getattr(other, name) for name in _TOTALS]
        sums = {job: dict(ranks) for job, ranks in self.sums.items()}
        for job_id, ranks in other.sums.items():
            sums.setdefault(job_id, {}).update(ranks)
        failures = self.checksum_failures + other.checksum_failures
        return JobReport(*counts, bad, *totals, sums, failures)

    def is_empty(self) -> bool:
        """Nothing to send (a report of disk bytes or bad keys alone is not empty)."""
        return not (self.done or self.failed or self.put or self.spilled or self.disk_bad
                    or self.disk_read_bytes or self.disk_write_bytes or self.checksum_failures)


_TOTALS = ("load_bytes", "load_seconds", "store_bytes", "store_seconds", "disk_read_bytes",
           "disk_read_seconds", "disk_write_bytes", "disk_write_seconds")


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
