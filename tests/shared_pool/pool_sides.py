"""Engines sharing one pool, at the level of the connector's vLLM-free cores.

`Side` is one engine: a scheduler core (OffloadScheduler over a SharedIndex) and one worker
(OffloadWorker mapping the daemon's segment) over its own CPU cache, stepped as the engine
would. Tests run one side in the test process and others in spawned children (each its own
process, own connection, own mapping); `writer_child` / `reader_child` are the children, each
driven through a `Child`.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvconnector.layout import KVLayout
from kvconnector.layout.allocator import allocate
from kvconnector.offload import pool_checks
from kvconnector.offload.jobs import TransferEvents
from kvconnector.offload.scheduler import OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from transfer.copy.base import ThreadBackend
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.shared.client import SharedIndex
from transfer.shared.mapping import SharedPart

BS = 4
NUM_BLOCKS = 16
POISON = 0xA5
NS = Namespace(model="tiny", dtype="bfloat16", block_size=BS, block_layout="test")
OTHER_NS = Namespace(model="other", dtype="bfloat16", block_size=BS, block_layout="test")
TIMEOUT_S = 120.0
_SPAWN = mp.get_context("spawn")


class Side:
    """One engine over pool `name` (see module doc). `release`: when given, every copy waits
    until it is set (a copy cut short: the process is killed while it waits). `device`: "cuda"
    puts the cache on the GPU and copies by DMA (the worker's default backend; no `release`)."""

    def __init__(self, name: str, namespace: Namespace = NS,
                 release: threading.Event | None = None, device: str = "cpu") -> None:
        layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=8, block_size=BS,
                          dtype=torch.bfloat16, order="BLNHC")
        self.cache = allocate(layout, num_blocks=NUM_BLOCKS, device=device)
        self.rows = self.cache.block_chunks()
        self.index = SharedIndex(name, namespace, self.rows.shape[1], retry_s=0.0)
        self.core = OffloadScheduler(namespace, self.index.num_slots, BS, 1, index=self.index)
        self.release = release

        def gate(job_id: int) -> None:
            if release is not None and not release.wait(TIMEOUT_S):
                raise RuntimeError(f"job {job_id} held too long")

        self.worker = OffloadWorker({f"l{i}": v for i, v in enumerate(self.cache.layer_views())},
                                    0, backend=ThreadBackend(gate) if device == "cpu" else None,
                                    mapping=SharedPart(name, 0))

    def step(self, wait: bool = True) -> TransferEvents:
        """One engine step: plan, loads, stores, (wait), report; the worker's calls under
        torch.inference_mode, as vLLM makes them (the segment is mapped there)."""
        jobs = self.last_jobs = self.core.build_step()
        with torch.inference_mode():
            self.worker.flush(jobs)
            self.worker.start_loads(jobs)
            self.worker.submit_stores(jobs)
            if wait:
                self.worker.drain()
            events = self.worker.poll()
        self.core.complete(self.worker.take_report())
        return events

    def store(self, req: str, hashes: list[bytes], blocks: list[int], seed: int,
              wait: bool = True) -> list[torch.Tensor]:
        """Fill `blocks` with random bytes and store them under `hashes`; the bytes written."""
        written = fill(self.rows, blocks, seed)
        self.core.plan_stores(req, hashes, blocks, len(hashes) * BS)
        self.step(wait)
        return written

    def load(self, req: str, hashes: list[bytes], blocks: list[int]) -> tuple[int, TransferEvents]:
        """Poison `blocks`, look the hashes up and load the hits into them: (hit blocks,
        events of the step that ran the load)."""
        self.rows[blocks] = POISON
        hits = self.core.lookup(req, hashes, 0, len(hashes) * BS + 1) // BS
        self.core.plan_load(req, hashes, blocks, hits * BS)
        return hits, self.step()

    def close(self) -> None:
        if self.release is not None:
            self.release.set()
        self.worker.close()
        self.index.close()
        self.cache.close()


class Child:
    """A spawned engine process and the pipe that drives it."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_end = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=target, args=(*args, child_end), daemon=True)
        self.process.start()

    def ask(self, message: Any) -> Any:
        self.conn.send(message)
        return self.answer()

    def answer(self) -> Any:
        assert self.conn.poll(TIMEOUT_S), "the child did not answer"
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(TIMEOUT_S)

    def exit(self) -> None:
        self.conn.send("exit")
        self.process.join(TIMEOUT_S)
        assert self.process.exitcode == 0


def fill(rows: torch.Tensor, blocks: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    written = [torch.randint(0, 256, (rows.shape[1],), dtype=torch.uint8, generator=g)
               for _ in blocks]
    for block, data in zip(blocks, written, strict=True):
        rows[block].copy_(data)
    return written


def flip(side: Side, key: bytes, offset: int) -> None:
    """Flip one bit of `key`'s slot through the shared segment (a stray write after its
    commit)."""
    plan = side.index.prepare_load([key])
    side.index.complete_load([key])
    segment = HostPool.attach(side.index.segment, pinned=False)
    segment.slots[plan.slots[0], offset] ^= 0x01
    segment.close()


def hashes(tag: str, count: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(count)]


def writer_child(name: str, conn: Connection, device: str = "cpu") -> None:
    """An engine that stores on command: ("store", tag, count, seed) stores `count` blocks and
    answers "stored"; ("hold", tag, count, seed) plans the store, writes half of each slot
    (a copy cut short), answers "storing" and never commits; "exit" closes."""
    release = threading.Event()
    release.set()  # cleared by "hold": its copy never runs
    side = Side(name, release=release if device == "cpu" else None, device=device)
    served = 0
    while (command := conn.recv()) != "exit":
        verb, tag, count, seed = command
        served += 1
        req = f"w{served}"  # a new request each time, as a new prompt would be
        if verb == "store":
            side.store(req, hashes(tag, count), list(range(count)), seed)
            conn.send("stored")
            continue
        release.clear()
        side.store(req, hashes(tag, count), list(range(count)), seed, wait=False)
        pool = side.worker.pool
        for job in side.last_jobs.stores:
            for slot in job.slots:
                pool.slots[slot, :pool.block_bytes // 2].fill_(0x5A)
        conn.send("storing")
    side.close()


def reader_child(name: str, tag: str, count: int, conn: Connection) -> None:
    """Pin `count` blocks for a load whose copy never finishes; report the hits, wait to die."""
    side = Side(name, release=threading.Event())  # never set: the copy never runs
    side.rows[:count].fill_(POISON)
    hits = side.core.lookup("r", hashes(tag, count), 0, count * BS + 1) // BS
    side.core.plan_load("r", hashes(tag, count), list(range(count)), hits * BS)
    side.worker.start_loads(side.core.build_step())
    conn.send(hits)
    conn.recv()


def gpu_writer_child(name: str, conn: Connection) -> None:
    """writer_child with its cache on the GPU, copying by DMA."""
    writer_child(name, conn, "cuda")


def row_sums_writer_child(name: str, conn: Connection) -> None:
    """writer_child on CPU whose worker takes row sums, as a GPU worker's does."""
    pool_checks.ROW_SUMS_DEVICES = ("cuda", "cpu")
    writer_child(name, conn)
