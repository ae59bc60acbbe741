"""A worker's side of the remote tier (remote_tier.py) and of the loads whose blocks come from
below the pool: the store client over this worker's part of the pool's slots, the loads waiting
for their disk reads and store gets, and the write-through puts of finished stores.

The worker (worker.py) hands a load here first (`start_load`): one whose blocks must be read
from disk (worker_disk.py) and/or fetched from the store into its reserved slots waits here until
they are, then `fetched` yields it with the head of its slots that holds its blocks, for the
worker to copy; a load that cannot run (or has no block here) fails. A store's keys are put once
its copy is done (`store_copied`); `collect` reports the puts that ended. `failures` counts the
jobs whose get or put failed, or that could not run. The fetch stage is one for both lower
tiers (a load may read its first blocks from disk and fetch the rest), so it lives here even
without a store attached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future

import torch

from kvconnector.offload.jobs import JobReport, TransferJob
from kvconnector.offload.remote_tier import RemoteFetcher, leading_ok, settled
from kvconnector.offload.worker_disk import WorkerDisk
from transfer.remote.backend import TransferResult


class WorkerRemote:
    """The fetch stage and the store side of one worker (see module doc)."""

    def __init__(self) -> None:
        self.failures = 0  # jobs whose get or put failed (or could not run)
        self._make_fetcher: Callable[[torch.Tensor], RemoteFetcher] | None = None
        self._fetcher: RemoteFetcher | None = None  # over the current mapping's slots
        self._fetching: dict[int, tuple[TransferJob, Future[TransferResult] | None]] = {}
        self._doomed: list[TransferJob] = []  # loads that fail at the next poll
        self._put_keys: dict[int, tuple[tuple[bytes, ...], tuple[int, ...]]] = {}
        self._putting: dict[int, tuple[Future[TransferResult], tuple[int, ...]]] = {}

    def attach(self, make_fetcher: Callable[[torch.Tensor], RemoteFetcher],
               rows: torch.Tensor | None) -> None:
        """Use a remote store: `make_fetcher(rows)` makes its client over this worker's slot
        rows, now if they are mapped (`rows`), else at `bind`."""
        self._make_fetcher = make_fetcher
        if rows is not None:
            self.bind(rows)

    def bind(self, rows: torch.Tensor) -> None:
        """A new client over `rows` (a new mapping's), where a store is attached."""
        if self._make_fetcher is not None:
            self._fetcher = self._make_fetcher(rows)

    # ---- loads -------------------------------------------------------------------------------

    def start_load(self, job: TransferJob, disk: WorkerDisk | None) -> bool:
        """Take a load that reads and/or fetches blocks into its reserved slots before its copy
        (yielded by `fetched` once they are there), or that cannot run (yielded failed); False:
        every block is in the pool, the worker copies it now."""
        if job.fail or (job.keys and self._fetcher is None) or (job.disk_keys and not disk):
            self._doomed.append(job)
        elif job.keys or job.disk_keys:
            fetch_slots = job.fetch_slots
            future = None
            if job.keys:  # the store's blocks come after the disk's (TransferJob)
                future = self._fetcher.get(job.keys, fetch_slots[len(job.disk_keys):])
            if job.disk_keys:
                disk.read(job, fetch_slots[:len(job.disk_keys)])
            self._fetching[job.job_id] = (job, future)
        else:
            return False
        return True

    def fail_load(self, job: TransferJob) -> None:
        """A load that cannot run (its shared segment is gone): yielded failed by `fetched`."""
        self._doomed.append(job)

    def fetched(self, disk: WorkerDisk | None,
                report: JobReport) -> Iterator[tuple[TransferJob, int, Sequence[int | None]]]:
        """Loads ready to copy, one at a time: (job, head, sums): the job's first `head` slots
        hold its blocks (0: it fails, and nothing is copied); `sums`: the checksums its disk
        read verified. Failed disk blocks go into `report`; failed gets are counted."""
        doomed, self._doomed = self._doomed, []
        for job in doomed:
            self.failures += 1
            yield job, 0, ()
        for job_id, (job, future) in list(self._fetching.items()):
            if (future is not None and not future.done()) or \
                    (disk is not None and disk.reading(job_id)):
                continue
            del self._fetching[job_id]
            # Load the head that is here (CPU-tier blocks, then the leading good reads and
            # fetches); the rest are load errors, from which vLLM recomputes (0.32 may also look
            # the head up again: it is in a tier, and loading it here costs one more copy).
            good = len(job.disk_keys)
            read = None if disk is None else disk.take_read(job_id)
            if read is not None:
                good = next((i for i, ok in enumerate(read.ok) if not ok), good)
                bad = [k for k, ok in zip(job.disk_keys, read.ok, strict=True) if not ok]
                if bad:
                    report.disk_bad[job_id] = bad
            if future is not None:
                fetched = leading_ok(future)
                if fetched < len(job.keys):
                    self.failures += 1
                if good == len(job.disk_keys):
                    good += fetched
            head = len(job.slots) - len(job.keys) - len(job.disk_keys) + good
            yield job, head, read.sums if read is not None else ()

    # ---- write-through -----------------------------------------------------------------------

    def store_submitted(self, job: TransferJob) -> None:
        """A store's copy started: its keys are put once it is done, where a store is attached."""
        if job.keys and self._fetcher is not None:
            self._put_keys[job.job_id] = (job.keys, job.slots)

    def store_copied(self, job_id: int, ok: bool, report: JobReport) -> None:
        """A store's copy ended (`ok`): put its blocks, or count its put done in `report`."""
        if ok and job_id in self._put_keys and self._fetcher.writes:
            # Write-through; reported in `put` once done: the scheduler keeps the slots
            # pinned until then, so no new store overwrites what zmq still reads.
            keys, slots = self._put_keys.pop(job_id)
            self._putting[job_id] = (self._fetcher.put(keys, slots), slots)
        elif self._put_keys.pop(job_id, None) is not None:
            report.put[job_id] = 1  # no copy or another rank puts: counted, no put

    def collect(self, report: JobReport) -> None:
        """Puts that ended (done or failed) -> `report`."""
        for job_id, (future, slots) in list(self._putting.items()):
            ok = settled(future)
            if ok is None:
                continue
            if not ok:
                pinned = self._fetcher.pinned_slots()
                if any(slot in pinned for slot in slots):
                    continue  # a timed-out put zmq still reads: keep the slots reserved
                self.failures += 1
            del self._putting[job_id]
            report.put[job_id] = 1  # done or failed: a failed put is a later remote miss

    # ---- lifetime ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every get and put in flight is done (results still come from the polls)."""
        for future in [f for _, f in self._fetching.values() if f is not None] + \
                [f for f, _ in self._putting.values()]:
            with contextlib.suppress(CancelledError):
                future.exception()  # waits; store calls are bounded by their deadline

    @property
    def in_flight(self) -> int:
        """Loads waiting here (to fetch, or to fail) and puts not yet reported."""
        return len(self._fetching) + len(self._putting) + len(self._doomed)

    def close(self) -> None:
        """Close the store client (a new mapping binds a new one)."""
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None
