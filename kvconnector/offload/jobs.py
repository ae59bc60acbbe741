"""What the scheduler side sends the workers each step, and what they report back.

`StepJobs` (built by OffloadScheduler.build_step) travels in the connector metadata to every
worker; `JobReport` (OffloadWorker.take_report) travels back in the connector output, summed over
ranks by vLLM's aggregation. Both are small and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferJob:
    """Copy `block_ids[i]` (GPU) <-> `slots[i]` (host pool) for every i, as one job.

    With a remote tier: a store's `keys` are put to the store after the copy (write-through);
    a load's `keys` are fetched from the store into the last len(keys) slots before the copy.
    `fail`: the job cannot run (no slot for a fetch); the worker reports it failed at once.
    """

    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...] = ()
    fail: bool = False


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

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.flush or self.held)


@dataclass
class JobReport:
    """Jobs one or more workers finished since their last report; `merged` sums two reports."""

    done: dict[int, int] = field(default_factory=dict)  # job id -> workers that copied it
    failed: dict[int, int] = field(default_factory=dict)  # job id -> workers that failed it
    put: dict[int, int] = field(default_factory=dict)  # store job id -> workers done putting it
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0

    def merged(self, other: JobReport) -> JobReport:
        done, failed = dict(self.done), dict(self.failed)
        for job_id, count in other.done.items():
            done[job_id] = done.get(job_id, 0) + count
        for job_id, count in other.failed.items():
            failed[job_id] = failed.get(job_id, 0) + count
        put = dict(self.put)
        for job_id, count in other.put.items():
            put[job_id] = put.get(job_id, 0) + count
        return JobReport(done, failed, put, self.load_bytes + other.load_bytes,
                         self.load_seconds + other.load_seconds,
                         self.store_bytes + other.store_bytes,
                         self.store_seconds + other.store_seconds)

    def is_empty(self) -> bool:
        return not (self.done or self.failed or self.put)
