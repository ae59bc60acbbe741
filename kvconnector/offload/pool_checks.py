"""A worker's checksums of a shared pool's blocks, job by job (transfer/slot_checker.py).

A store whose copy took its blocks' row sums (transfer/copy/row_sums.py: a worker whose cache is
on a GPU, ROW_SUMS_DEVICES) is reported as soon as its copy is done, with its row sums only (the
scheduler commits it by them: no host hashing on the store's path); where a reader, tier or disk
that checks by xxh3 needs them (`TransferJob.hash_later`), its xxh3s are taken after, on the
checker's threads (`SlotChecker.hash_checked`: only of slot bytes whose row sums still match the
commit) and reported apart (`JobReport.hashed`, None for a block whose slot changed since: the
scheduler drops it). Any other
store is hashed once its copy is done and reported with its checksums. A GPU worker checks a
load whose blocks all carry row sums on the way, by its copy engine (`expected`): no host
hashing on the load path. Else a load's blocks are checked before they are copied, chunk by
chunk (`loads`: checked_loads.py; a block not yet hashed fails its check), and the load is
reported once its checks and copies are done;
blocks a load fetched into the pool (from a tier below) are hashed, so they stay in the pool
with their checksums (those its tier verified are taken as they are). This worker's part
of every slot is `rows`; its checksum is entry `rank` of each block's per-rank list.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kvconnector.offload.checked_loads import CheckedLoads
from kvconnector.offload.jobs import JobReport, TransferJob
from transfer.engine import CopyResult, TransferEngine
from transfer.slot_checker import SlotChecker

# Caches whose workers take and check row sums: on a GPU they cost nothing on the host; a CPU
# computes them at ~1 GB/s a core against xxh3's ~20 (dev VM), so CPU workers use xxh3 only.
ROW_SUMS_DEVICES = ("cuda",)


class PoolChecks:
    """The checks of one worker of rank `rank` whose cache is on `device` (see module doc)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.row_sums = device.type in ROW_SUMS_DEVICES
        self.sum_stores = self.check_loads = False  # set by `bind`, per copy engine
        self.checker = SlotChecker()
        # store submitted -> its keys, slots, and whether a commit by row sums is hashed after
        self._stores: dict[int, tuple[tuple[bytes, ...], tuple[int, ...], bool]] = {}
        self._row_sums: dict[int, tuple[int, ...]] = {}  # store being hashed -> its row sums
        self._hashing: dict[int, Future[list[int]]] = {}  # store copied -> its checksums
        # store committed by its row sums -> its xxh3s (None: the slot no longer matched)
        self._hashing_later: dict[int, tuple[Future[list[int | None]], int]] = {}
        self.loads = CheckedLoads(self.checker, rank)
        self._fetched: dict[int, Future[list[int]]] = {}  # load -> its fetched blocks' sums

    # ---- stores ---------------------------------------------------------------------------

    def bind(self, engine: TransferEngine) -> None:
        """A new copy engine (a new mapping of the pool): whether its stores take row sums and
        its loads are checked by them (their staging allocated now, not in a step)."""
        self.sum_stores = self.row_sums and engine.can_sum
        self.check_loads = self.sum_stores and engine.reserve_checked_loads()

    def sums_store(self, job: TransferJob) -> bool:
        """Whether the store's copy also takes its blocks' row sums."""
        return self.sum_stores and bool(job.checked)

    def store_submitted(self, job: TransferJob) -> None:
        if job.checked:
            self._stores[job.job_id] = (job.checked, job.slots, job.hash_later)

    def store_copied(self, result: CopyResult, rows: torch.Tensor, report: JobReport) -> bool:
        """True when the store is being hashed now (reported by `report_hashed`); False: report
        it now (one whose copy took its row sums has them in `report` already: it commits by
        them, and its xxh3s follow from `report_hashed` where the job wants them)."""
        checked = self._stores.pop(result.job_id, None)
        if not result.ok or checked is None:
            return False
        keys, slots, hash_later = checked
        if len(result.sums) == len(keys) and keys:  # commit by row sums (hash after)
            report.sums[result.job_id] = {self.rank: [None] * len(keys) + list(result.sums)}
            if hash_later:
                later = self.checker.hash_checked(rows, slots, keys, result.sums)
                self._hashing_later[result.job_id] = (later, len(keys))
            return False
        self._hashing[result.job_id] = self.checker.hash(rows, slots, keys)
        self._row_sums[result.job_id] = result.sums
        return True

    def report_hashed(self, report: JobReport) -> list[int]:
        """Stores hashed since the last call, into `report`: done with their checksums (the
        blocks' xxh3s, then their row sums where the copy took them), or failed when hashing
        failed (never committed); and the xxh3s of stores committed by row sums
        (`report.hashed`). Returns the job ids of the former."""
        out = []
        for job_id, future in list(self._hashing.items()):
            if future.done():
                del self._hashing[job_id]
                row_sums = self._row_sums.pop(job_id)
                if future.exception() is None:
                    report.sums[job_id] = {self.rank: future.result() + list(row_sums)}
                    report.done[job_id] = 1
                else:
                    report.failed[job_id] = 1
                out.append(job_id)
        for job_id, (later, blocks) in list(self._hashing_later.items()):
            if later.done():  # a hash that could not run proves nothing: no xxh3 (dropped)
                del self._hashing_later[job_id]
                report.hashed[job_id] = {self.rank: later.result() if later.exception() is None
                                         else [None] * blocks}
        return out

    @property
    def hashing_later(self) -> int:
        """Stores committed by row sums whose xxh3s are still being taken."""
        return len(self._hashing_later)

    # ---- loads ----------------------------------------------------------------------------

    def expected(self, job: TransferJob, head: int) -> np.ndarray | None:
        """This rank's row sums of the job's first `head` blocks, when the engine checks them on
        the way: every one of them is checked and carries them (else None: checked here)."""
        if not self.check_loads or head == 0 or len(job.checked) < head:
            return None
        sums = job.rank_row_sums(self.rank)
        return None if sums is None or len(sums) < head else sums[:head]

    def fetched(self, job: TransferJob, rows: torch.Tensor,
                verified: Sequence[int | None] = ()) -> None:
        """Every block the job fetched is in its slot: hash them for their commit, but for
        those whose checksum their tier verified against the bytes in the slot (`verified`, in
        the order of its fetch keys: the same checksum, of the same bytes and key)."""
        keys = job.fetch_keys
        known = list(verified) + [None] * (len(keys) - len(verified))
        todo = [i for i, checksum in enumerate(known) if checksum is None]
        hashed = self.checker.hash(rows, [job.fetch_slots[i] for i in todo],
                                   [keys[i] for i in todo])
        result: Future[list[int]] = Future()

        def merge(done: Future[list[int]]) -> None:
            try:
                for i, checksum in zip(todo, done.result(), strict=True):
                    known[i] = checksum
            except Exception as exc:
                result.set_exception(exc)
                return
            result.set_result(known)

        hashed.add_done_callback(merge)
        self._fetched[job.job_id] = result

    def ready(self, job_id: int) -> bool:
        """Whether the hashing of the load's fetched blocks is done (it is reported only then)."""
        fetched = self._fetched.get(job_id)
        return fetched is None or fetched.done()

    def failed_tail(self, result: CopyResult, block_ids: tuple[int, ...],
                    report: JobReport) -> tuple[int, ...]:
        """The load's `block_ids` from the first whose check failed (only those before it were
        copied), counted in `report`; its fetched blocks' checksums go there too when the copy
        and their hashing succeeded."""
        job_id = result.job_id
        good, fetched = self.loads.take_good(job_id), self._fetched.pop(job_id, None)
        if good is None and result.good is not None and result.good < len(block_ids):
            good = result.good  # checked on the way by the engine
        if fetched is not None and result.ok and fetched.exception() is None:
            report.sums[job_id] = {self.rank: fetched.result()}
        if good is None or not result.ok:
            return ()
        report.checksum_failures += 1
        return block_ids[good:]

    # ---- lifetime -------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every hash and check started is done."""
        for future in [*self._hashing.values(), *self._fetched.values(),
                       *(later for later, _ in self._hashing_later.values())]:
            future.exception()
        self.loads.wait()

    def close(self) -> None:
        self.checker.close()
