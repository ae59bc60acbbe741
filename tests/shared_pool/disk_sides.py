"""An engine of two ranks over a shared pool with the disk tier below it, at the level of the
connector's vLLM-free cores (as pool_sides.py, which has one rank and no disk).

`DiskSide`: one scheduler core (OffloadScheduler over a SharedIndex, with a DiskPlanner that
finds what the slabs hold) and two workers, ranks 0 and 1, each over its own CPU cache, its own
part of every shared slot and its own slab under `directory`; every step runs both workers and
sums their reports, as vLLM's aggregation does. Each rank's block is 4 KiB (whole pages: a
rank reads its part of a slot with O_DIRECT). `store_child` and `load_child` run one in a
spawned process.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvconnector.layout import KVLayout
from kvconnector.layout.allocator import allocate
from kvconnector.offload.jobs import TransferEvents
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from transfer.copy.base import ThreadBackend
from transfer.disk.io import DiskIO
from transfer.disk.planner import DiskPlanner, restored_blocks
from transfer.disk.slab import SlabFile
from transfer.disk.worker import DiskWorker
from transfer.keys import Namespace
from transfer.shared.client import SharedIndex
from transfer.shared.mapping import SharedPart

BS = 4
RANKS = 2
NUM_BLOCKS = 16
DISK_SLOTS = 32
POISON = 0xA5
NS = Namespace(model="tiny-disk", dtype="bfloat16", block_size=BS, block_layout="test",
               tp_size=RANKS)
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=32, block_size=BS,
                  dtype=torch.bfloat16, order="BLNHC")  # 4 KiB a block


def rank_digest(rank: int) -> bytes:
    """The digest naming rank `rank`'s slab (as kvconnector.vllm.namespace.own_namespace)."""
    return dataclasses.replace(NS, tp_rank=rank).digest


class DiskSide:
    """One engine of RANKS ranks over pool `name`, its slabs in `directory` (see module doc)."""

    def __init__(self, name: str, directory: Path, write_policy: str = "through") -> None:
        self.caches = [allocate(LAYOUT, num_blocks=NUM_BLOCKS, device="cpu")
                       for _ in range(RANKS)]
        self.rows = [cache.block_chunks() for cache in self.caches]
        block = int(self.rows[0].shape[1])
        self.index = SharedIndex(name, NS, block * RANKS, retry_s=0.0)
        stored = restored_blocks(directory, NS.digest, [rank_digest(r) for r in range(RANKS)],
                                 DISK_SLOTS)
        self.disk = DiskPlanner(NS, DISK_SLOTS, "lru", write_policy, stored)
        self.core = OffloadScheduler(NS, self.index.num_slots, BS, RANKS, tiers=[self.disk],
                                     index=self.index)
        self.workers = []
        for rank, cache in enumerate(self.caches):
            worker = OffloadWorker({f"l{i}": v for i, v in enumerate(cache.layer_views())}, 0,
                                   backend=ThreadBackend(), mapping=SharedPart(name, rank * block,
                                                                              rank))
            slab = SlabFile(directory, rank_digest(rank), block, DISK_SLOTS)
            worker.attach(DiskWorker(DiskIO(slab, None, threads=3), rank))
            self.workers.append(worker)

    def step(self) -> TransferEvents:
        """One engine step on every rank (under inference mode, as vLLM calls the workers),
        waited for; the ranks' events and reports summed."""
        jobs = self.core.build_step()
        events = TransferEvents()
        with torch.inference_mode():
            for worker in self.workers:
                worker.flush(jobs)
                worker.start_loads(jobs)
                worker.submit_stores(jobs)
            for worker in self.workers:
                worker.drain()
                events.update(worker.poll())
        report = self.workers[0].take_report()
        for worker in self.workers[1:]:
            report = report.merged(worker.take_report())
        self.core.complete(report)
        return events

    def settle(self) -> None:
        for _ in range(10):
            self.step()
            if not self.core.has_jobs():
                return
        raise AssertionError("jobs still in flight after 10 steps")

    def store(self, req: str, hashes: list[bytes], seed: int) -> list[list[torch.Tensor]]:
        """Fill blocks 0.. of every rank with random bytes, store them under `hashes` and wait
        for every job (the writes through to disk included); the bytes, per rank."""
        written = [fill(rows, range(len(hashes)), seed + 1000 * r)
                   for r, rows in enumerate(self.rows)]
        self.core.plan_stores(req, hashes, list(range(len(hashes))), len(hashes) * BS)
        self.settle()
        return written

    def load(self, req: str, hashes: list[bytes]) -> tuple[tuple[int, int, int],
                                                           TransferEvents]:
        """Poison every rank's blocks, look up and load the hits into blocks 0..: (blocks per
        tier: pool, disk, remote; the events of the steps that ran it)."""
        for rows in self.rows:
            rows.fill_(POISON)
        hits = self.core.lookup(req, hashes, 0, len(hashes) * BS + 1) // BS
        split = self.core.plan_load(req, hashes, list(range(len(hashes))), hits * BS)
        events = TransferEvents()
        for _ in range(10):
            events.update(self.step())
            if req in events.finished_loads and not self.core.has_jobs():
                return split, events
        raise AssertionError(f"the load of {req} did not finish")

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.index.close()
        for cache in self.caches:
            cache.close()


def fill(rows: torch.Tensor, blocks: range, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    written = [torch.randint(0, 256, (rows.shape[1],), dtype=torch.uint8, generator=g)
               for _ in blocks]
    for block, data in zip(blocks, written, strict=True):
        rows[block].copy_(data)
    return written


def hashes(tag: str, count: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(count)]


def store_child(name: str, directory: str, tag: str, count: int, seed: int, tear: bool,
                conn: Connection) -> None:
    """Store `count` blocks and write them through; `tear`: every block write writes the
    footers of its blocks and half of each block, and once every rank's slab holds all `count`
    torn blocks (whatever order the writer threads run in) the process is SIGKILLed: the kill
    is placed by what was written, never by time."""
    side = DiskSide(name, Path(directory))
    if tear:
        real = os.pwritev
        torn: dict[int, set[int]] = {}  # slab fd -> offsets of its torn blocks
        lock = threading.Lock()

        def tear_write(fd: int, buffers: list[memoryview], offset: int) -> int:
            position = offset
            with lock:
                for data, footer in zip(buffers[::2], buffers[1::2], strict=True):
                    real(fd, [footer], position + len(data))
                    real(fd, [data[:len(data) // 2]], position)
                    torn.setdefault(fd, set()).add(position)
                    position += len(data) + len(footer)
                if len(torn) == RANKS and all(len(t) == count for t in torn.values()):
                    os.kill(os.getpid(), signal.SIGKILL)
            return position - offset  # as if whole: the writer goes on to its next blocks

        os.pwritev = tear_write
    side.store("w", hashes(tag, count), seed)
    side.close()
    conn.send("stored")


def load_child(name: str, directory: str, tag: str, count: int, conn: Connection) -> None:
    """A fresh engine over the slabs: load `count` blocks; sends (split, failed block ids, the
    bytes of every rank's blocks after the load, the split of a second load of them)."""
    side = DiskSide(name, Path(directory))
    split, events = side.load("r", hashes(tag, count))
    got = [[bytes(rows[b].numpy()) for b in range(count)] for rows in side.rows]
    again, _ = side.load("r2", hashes(tag, count))
    side.close()
    conn.send((split, sorted(events.failed_block_ids), got, again))
