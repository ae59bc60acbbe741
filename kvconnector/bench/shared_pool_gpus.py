"""Every GPU of the host on one shared pool: one engine process per GPU, all storing and loading
at once, against the same run's raw aggregate ceilings.

Both measurements run one process per GPU, each seeing only its own GPU (CUDA_VISIBLE_DEVICES,
so each runs as a one-GPU engine does), all started together and stepped behind one barrier:

- the raw ceilings (`measure_ceilings`): each process its own pinned buffer and device buffer,
  one large copy host -> device, device -> host and both at once (two streams), every GPU alone
  in turn, then all GPUs at once: the host's aggregate limit against the sum of the single-GPU
  ceilings;
- the engines (`measure_engines`): a `kvconnector pool serve` daemon and one engine per GPU, each
  with its own cache, its own mapping of the pool and its own connection. Untimed first, every
  engine stores a set of its own, and all race to store one common set (each stores the blocks
  the daemon hands it). Then three timed phases of rounds, each round started behind the
  barrier: every engine loads n blocks (a third of the common set, a third of its own set, a
  third of the next engine's), then stores n new blocks, then does both at once (one thread and
  one TransferEngine per direction, as the one-GPU bench's reader and writer). Loads are checked
  as an engine checks them, by the blocks' row sums on the way (the copy engine; on a CPU its
  lanes); stores are committed by the row sums their copy took, as the one-GPU bench's writer
  stores (`store_blocks`): a store's time runs until its commits are applied. The engines are a
  GPU fleet with no tier below: no lease needs xxh3s, so none is taken (the pool says so in each
  store's plan: `hash_later`); were one needed, it would be taken and attached after the commit
  (`late_hash_s`: from the last commit to the last xxh3).

The ratios hold each phase's engine aggregate against raw copies taken in turns with its rounds:
before each engine round, every process makes one raw copy of that phase's direction at once
(loads: host -> device; stores: device -> host; both: one each way), on its own buffers, behind
the same barrier. The host's aggregate limit moves from round to round (raw copies on four H200s
read 157-177 GB/s within one minute), so a ceiling taken once, before the engines, held the
engines against another moment's limit. The ceilings first taken alone and all at once stay in
the record: they show the host's limit against the GPUs'.

Every block's bytes are a function of its key (`block_pattern`), so every loaded byte is compared
with what its writer, whichever engine that was, stored (destinations poisoned before each copy),
and every stored block is read back and compared too. An engine's rate is the median of its
timed rounds (the first round of each phase warms up); the aggregate of a round is every
engine's bytes over the time from the first start to the last end, and its figure the median.

On a CPU the same runs host to host: N processes, each its own "device" (host memory).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvconnector.bench.ceilings import RAW_COPY_BYTES, RawCopies, raw_copies
from kvconnector.bench.shared_pool import (
    SHARED_MAX_BYTES,
    WRITER_JOBS,
    expected_row_sums,
    store_blocks,
)
from kvconnector.layout.allocator import SlotBuffer, allocate_slots, shm_free_bytes, slot_stride
from kvconnector.servers.pool import PoolProcess
from transfer.engine import TransferEngine
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.shared.client import SharedIndex
from transfer.slot_checker import SlotChecker

# One set of blocks of one engine, a round's work in each direction: on a GPU the one-GPU
# bench's set (SHARED_MAX_BYTES), so a round's fixed costs (the first copy's issue, the wait
# for the last commit: 1-1.5 ms) weigh the same in both benches.
SET_MAX_BYTES = {"cuda": SHARED_MAX_BYTES["cuda"], "cpu": 16 << 20}
DIRECTIONS = ("h2d", "d2h", "bidir")
PHASES = ("load", "store", "both")
POISON = 0xA5
_BATCH = 1_000_000  # key numbers: batch * _BATCH + block
_COMMON, _OWN, _STORES = 1, 2, 1000  # batches: the common set, engine r's own (2 + r), stores
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: spreads a key over its bytes
_CHUNK_BYTES = 64 << 20  # blocks patterned and compared at a time
_TIMEOUT_S = 300.0


def resolve_gpus(spec: str, cuda: bool) -> list[int]:
    """`--gpus`: "all" (every visible GPU) or comma-separated indices; on a CPU the indices only
    count stand-in processes. ValueError for a bad list."""
    if spec.strip() == "all":
        if not cuda:
            raise ValueError("--gpus all needs CUDA GPUs; on a CPU name stand-ins, e.g. --gpus 0,1")
        return list(range(torch.cuda.device_count()))
    try:
        gpus = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--gpus takes 'all' or indices such as 0,1,2,3, not {spec!r}") from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise ValueError(f"--gpus: distinct indices from 0, not {spec!r}")
    if cuda and max(gpus) >= torch.cuda.device_count():
        raise ValueError(f"--gpus {spec}: this host shows {torch.cuda.device_count()} GPU(s)")
    return gpus


def visible_name(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's GPU `gpu` (of the list it was given)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(gpu)
    return [name.strip() for name in visible.split(",") if name.strip()][gpu]


# -- blocks whose bytes are a function of their key ----------------------------------------------

def block_pattern(numbers: Sequence[int], block_bytes: int, device: torch.device) -> torch.Tensor:
    """(len(numbers), block_bytes) uint8: the bytes of the blocks of these key numbers."""
    words = block_bytes // 8
    base = torch.tensor(list(numbers), dtype=torch.int64, device=device)[:, None]
    mixed = (base * words + torch.arange(words, dtype=torch.int64, device=device)) * _GOLDEN
    return (mixed ^ (mixed >> 31)).view(torch.uint8)


def fill_blocks(rows: torch.Tensor, first: int, numbers: Sequence[int]) -> None:
    """rows[first + i] = the block of numbers[i]."""
    step = max(1, _CHUNK_BYTES // rows.shape[1])
    for i in range(0, len(numbers), step):
        part = numbers[i: i + step]
        rows[first + i: first + i + len(part)].copy_(
            block_pattern(part, rows.shape[1], rows.device))


def mismatched_blocks(rows: torch.Tensor, ids: Sequence[int], numbers: Sequence[int]) -> list[int]:
    """Positions i whose rows[ids[i]] is not the block of numbers[i]; compares every byte."""
    bad: list[int] = []
    step = max(1, _CHUNK_BYTES // rows.shape[1])
    for i in range(0, len(ids), step):
        got = rows[torch.tensor(list(ids[i: i + step]), device=rows.device)]
        want = block_pattern(numbers[i: i + step], rows.shape[1], rows.device)
        if not torch.equal(got, want):
            bad += [i + int(d) for d in (got != want).any(dim=1).nonzero().flatten().tolist()]
    return bad


# -- processes, one per GPU, behind one barrier ----------------------------------------------------

@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` while a child is spawned (it inherits the environment)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class GpuWorkers:
    """One spawned process per GPU (each seeing only its GPU), kept for the whole run and
    stepped behind one barrier; `ask` sends every process one task and returns their answers.
    A context manager: leaving it ends the processes."""

    def __init__(self, gpus: list[int], device_type: str) -> None:
        self.gpus, self.device_type = gpus, device_type
        ctx = mp.get_context("spawn")
        # Held here for the run: the children's copies name the parent's semaphores.
        self._barrier = barrier = ctx.Barrier(len(gpus), timeout=_TIMEOUT_S)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        try:
            for rank, gpu in enumerate(gpus):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(rank, len(gpus), device_type, barrier,
                                                         theirs), daemon=True)
                env = {"CUDA_VISIBLE_DEVICES": visible_name(gpu)} if device_type == "cuda" else {}
                with _environment(env):
                    proc.start()
                theirs.close()  # the child's end: a child that dies gives EOF here
                self._procs.append(proc)
                self._conns.append(ours)
        except BaseException:
            self.close()
            raise

    def ask(self, task: tuple[Any, ...]) -> list[dict[str, Any]]:
        for conn in self._conns:
            conn.send(task)
        answers: list[Any] = []
        for rank, conn in enumerate(self._conns):
            try:
                if not conn.poll(_TIMEOUT_S * 4):
                    raise RuntimeError(f"process {rank} (GPU {self.gpus[rank]}) did not answer")
                answers.append(conn.recv())
            except (EOFError, OSError):
                raise RuntimeError(f"process {rank} (GPU {self.gpus[rank]}) died") from None
        errors = [f"GPU {self.gpus[r]}: {a}" for r, a in enumerate(answers) if isinstance(a, str)]
        if errors:  # the first is the cause; the others mostly broke on the barrier
            raise RuntimeError("; ".join(errors))
        return answers

    def close(self) -> None:
        for conn in self._conns:
            with suppress(OSError):
                conn.send(("exit",))
        deadline = time.monotonic() + 2  # they hold nothing by now: an exit needs no wait
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            proc.kill()
            proc.join(5)
        self._procs, self._conns = [], []

    def __enter__(self) -> GpuWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker(rank: int, num: int, device_type: str, barrier: Barrier, conn: Connection) -> None:
    """A process's loop: one task at a time until "exit"; a failure is answered as a string
    and breaks the barrier, so the others stop waiting for this one."""
    while True:
        task = conn.recv()
        if task[0] == "exit":
            break
        try:
            if task[0] == "ceilings":
                answer: dict[str, Any] | str = _copy_rounds(rank, barrier, num, device_type,
                                                            *task[1:])
            else:
                answer = _Engine(rank, barrier, task[1], num, device_type, task[2],
                                 task[3], task[5]).run(task[4])
        except BaseException as exc:  # every process's failure comes back as its answer
            barrier.abort()
            answer = f"error {type(exc).__name__}: {exc}"
        if device_type == "cuda":
            torch.cuda.empty_cache()  # the next task's buffers find room
        conn.send(answer)
    conn.close()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or "cpu"


# -- raw ceilings ---------------------------------------------------------------------------------

def _ceiling_phases(num: int) -> list[tuple[str, tuple[int, ...]]]:
    """(direction, ranks copying): every GPU alone in turn, then all of them."""
    return [(d, (r,)) for r in range(num) for d in DIRECTIONS] + \
           [(d, tuple(range(num))) for d in DIRECTIONS]


def _copy_rounds(rank: int, barrier: Barrier, num: int, device_type: str, size: int,
                 repeats: int) -> dict[str, Any]:
    """Every phase's rounds (first start, end) of this process (empty where it does not copy):
    copies as kvconnector.bench.ceilings takes them, on a buffer pair of this process's own."""
    device = torch.device(device_type)
    cuda = device.type == "cuda"
    host = torch.empty(2 * size, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(2 * size, dtype=torch.uint8, device=device)
    host.fill_(1)  # touched before any copy is timed
    dev.fill_(2)
    lanes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-ceiling")
    copies = raw_copies((dev[:size], dev[size:]), (host[:size], host[size:]), lanes)
    spans: list[list[tuple[float, float]]] = []
    try:
        for direction, ranks in _ceiling_phases(num):
            spans.append([])
            for _ in range(repeats + 1):  # the first round warms up
                barrier.wait()
                if rank in ranks:
                    t0 = time.time()
                    copies[direction]()
                    if cuda:
                        torch.cuda.synchronize(device)
                    spans[-1].append((t0, time.time()))
    finally:
        lanes.shutdown()
    return {"rank": rank, "device_name": _device_name(device), "spans": spans}


def measure_ceilings(workers: GpuWorkers, repeats: int) -> dict[str, Any]:
    """Raw pinned copies on every GPU, alone and all at once (GB/s, medians)."""
    gpus, size = workers.gpus, RAW_COPY_BYTES[workers.device_type]
    answers = workers.ask(("ceilings", size, repeats))
    alone: list[dict[str, float]] = [{} for _ in gpus]
    together: dict[str, float] = {}
    for i, (direction, ranks) in enumerate(_ceiling_phases(len(gpus))):
        factor = 2 if direction == "bidir" else 1
        rates = [factor * size * len(ranks) / _span([answers[r]["spans"][i][k] for r in ranks])
                 / 1e9 for k in range(1, repeats + 1)]
        if len(ranks) == 1:
            alone[ranks[0]][f"{direction}_gbps"] = statistics.median(rates)
        else:
            together[f"{direction}_gbps"] = statistics.median(rates)
    if len(gpus) == 1:
        together = dict(alone[0])
    summed = {key: sum(one[key] for one in alone) for key in alone[0]}
    return {"copy_bytes": size, "gpus": gpus,
            "device_names": [a["device_name"] for a in answers],
            "alone": alone, "aggregate": together, "sum_of_alone": summed,
            "aggregate_of_sum": {key: together[key] / summed[key] for key in summed},
            "method": f"one {size >> 20} MiB copy per GPU per round ({repeats} timed rounds after "
                      f"one warm-up, behind a barrier), the median; aggregate: every GPU's "
                      f"bytes over first start to last end"}


def _span(spans: Sequence[tuple[float, float]]) -> float:
    return max(end for _, end in spans) - min(start for start, _ in spans)


# -- engines ------------------------------------------------------------------------------------

def _namespace(block_bytes: int) -> Namespace:
    return Namespace("bench", "uint8", 1, f"{block_bytes} B")


def _numbers(batch: int, first: int, stop: int) -> list[int]:
    return [batch * _BATCH + i for i in range(first, stop)]


def load_sources(rank: int, num: int, n: int) -> list[int]:
    """The key numbers engine `rank` loads: a third of the common set (every engine loads it:
    the same prefixes across GPUs), a third of its own set, a third of the next engine's."""
    third = n // 3
    return (_numbers(_COMMON, 0, third) + _numbers(_OWN + rank, third, 2 * third)
            + _numbers(_OWN + (rank + 1) % num, 2 * third, n))


def load_blocks(engine: TransferEngine, job_id: int, slots: list[int], ids: list[int],
                expect: np.ndarray | None) -> None:
    """Load as a GPU engine's worker does (kvconnector.bench.shared_pool._load_summed): checked
    on the way by the blocks' row sums (`expect`; None: a plain copy); raises unless every block
    matched and landed."""
    engine.submit_load(job_id, slots, ids, expect=expect)
    engine.wait()
    (result,) = engine.get_finished()
    landed = len(ids) if result.good is None else result.good
    if not result.ok or landed != len(ids):
        raise RuntimeError(f"load {job_id}: {result}")


class _Engine:
    """One GPU's engine: a cache of 2n blocks (the first n the stores' sources, the last n the
    loads' destinations), one TransferEngine per direction, one connection to the pool."""

    def __init__(self, rank: int, barrier: Barrier, name: str, num: int, device_type: str,
                 block_bytes: int, n: int, raw_bytes: int) -> None:
        self.rank, self.barrier, self.num, self.n = rank, barrier, num, n
        self.device = torch.device(device_type)
        self.block_bytes = block_bytes
        self.namespace = _namespace(block_bytes)
        # Loads are checked by row sums: blocks committed by them are hits; no tier below: the
        # engines need no xxh3s.
        self.index = SharedIndex(name, self.namespace, block_bytes, row_sum_reader=True,
                                 needs_xxh3=False)
        self.index.pool_stats()  # its notice applied before any engine plans a store
        self.pool = HostPool.attach(self.index.segment, pinned=self.device.type == "cuda")
        self.cache: SlotBuffer = allocate_slots(2 * n, block_bytes, device=self.device)
        self.rows = self.cache.rows()
        self.storer = TransferEngine(self.pool.segments([self.rows]))
        self.loader = TransferEngine(self.pool.segments([self.rows]))
        self.checker = SlotChecker()
        self.raw = RawCopies(self.device, raw_bytes)  # the parent's size: it divides by it
        self.jobs = 0
        self.late_hash_s: list[float] = []  # each timed store: last commit to last xxh3
        self.hashed_stores = 0  # stores the pool asked to hash (a lease needed the xxh3s)
        self.counts = {"blocks_stored": 0, "blocks_loaded": 0, "load_bytes_compared": 0,
                       "store_bytes_compared": 0, "load_mismatches": 0, "store_mismatches": 0}

    def close(self) -> None:
        for engine in (self.storer, self.loader):
            engine.close()
        self.raw.close()
        self.checker.close()
        self.pool.close()
        self.cache.close()
        self.index.close()

    def run(self, repeats: int) -> dict[str, Any]:
        try:
            return self._run(repeats)
        finally:
            self.close()

    def _job_ids(self, count: int) -> int:
        self.jobs += count
        return self.jobs - count

    def _settle(self) -> None:
        """Wait for this process's own GPU work (poison, sources): a copy lane's stream does
        not wait for it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _keys(self, numbers: Sequence[int]) -> list[bytes]:
        return [self.namespace.key(number) for number in numbers]

    def _store(self, numbers: list[int]) -> tuple[list[bytes], list[int], list[int], bool]:
        """Plan a store of `numbers` (those the daemon hands this engine) and fill their sources;
        (keys, numbers, slots) placed, and whether their xxh3s are wanted."""
        keys = self._keys(numbers)
        plan = self.index.prepare_store(keys)
        if plan.evicted or plan.not_placed:
            raise RuntimeError(f"the pool is too small: {len(plan.evicted)} evicted, "
                               f"{len(plan.not_placed)} not placed")
        placed = dict(zip(keys, numbers, strict=True))
        numbers = [placed[key] for key in plan.keys]
        fill_blocks(self.rows, 0, numbers)
        self._settle()
        self.hashed_stores += plan.hash_later
        return plan.keys, numbers, plan.slots, plan.hash_later

    def _run(self, repeats: int) -> dict[str, Any]:
        n, rank = self.n, self.rank
        # Untimed: every engine stores its own set, and all race to store the common one.
        self.barrier.wait()
        common = self._store(_numbers(_COMMON, 0, n))
        self._commit_store(*common)
        own = self._store(_numbers(_OWN + rank, 0, n))
        if len(own[0]) != n:
            raise RuntimeError(f"only {len(own[0])} of engine {rank}'s {n} blocks were placed")
        self._commit_store(*own)
        self.index.pool_stats()  # committed before the others look
        self.barrier.wait()
        loads = load_sources(rank, self.num, n)
        load_ids = (n + torch.randperm(n)).tolist()
        spans: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for p, phase in enumerate(PHASES):
            spans[phase] = {"load": [], "store": [], "copied": [], "raw": []}
            for r in range(repeats + 1):  # the first round warms up
                stores = _numbers(_STORES + (p * (repeats + 1) + r) * self.num + rank, 0, n)
                self._round(phase, loads, load_ids, stores, spans[phase])
        return {"rank": rank, "device_name": _device_name(self.device), "blocks": n,
                "common_stored": len(common[0]), "own_stored": len(own[0]),
                "load_sources": {"common": n // 3, "own": n // 3, "next": n - 2 * (n // 3)},
                "hashed_stores": self.hashed_stores, "raw_copy_bytes": self.raw.size,
                "late_hash_s": statistics.median(self.late_hash_s) if self.late_hash_s
                else None, "spans": spans,
                **self.counts}

    def _commit_store(self, keys: list[bytes], numbers: list[int], slots: list[int],
                      hash_later: bool) -> None:
        if keys:
            store_blocks(self.storer, self.checker, self.pool, self.index, keys,
                         list(range(len(keys))), slots, self._job_ids(WRITER_JOBS),
                         hash_later=hash_later)
            self.counts["blocks_stored"] += len(keys)

    def _round(self, phase: str, loads: list[int], load_ids: list[int], stores: list[int],
               spans: dict[str, list[tuple[float, float]]]) -> None:
        """One timed round of `phase`, started behind the barrier, after a raw copy of its
        direction on every GPU at once (`RawCopies`); then every byte compared."""
        n = self.n
        self.barrier.wait()
        spans["raw"].append(self.raw.timed(_RAW_DIRECTION[phase]))
        load_keys = self._keys(loads)
        load_plan = store = None
        if phase in ("load", "both"):
            self.rows[n:].fill_(POISON)
            load_plan = self.index.prepare_load(load_keys)
            if load_plan is None:
                raise RuntimeError(f"engine {self.rank}: blocks to load are gone from the pool")
        if phase in ("store", "both"):
            store = self._store(stores)
            if len(store[0]) != n:
                raise RuntimeError(f"only {len(store[0])} of {n} new blocks were placed")
        self._settle()  # the poison and the sources are in place before any copy starts
        load_job, store_jobs = self._job_ids(1), self._job_ids(WRITER_JOBS)
        failures: list[BaseException] = []
        copied: list[float] = []  # when the host saw the store's last copy end

        def timed(direction: str, work: Callable[[Callable[[], None]], None]) -> None:
            """Runs work(done): the span ends at done() (a store: its commits applied, its
            xxh3s still to come), or when work returns."""
            ends: list[float] = []
            try:
                t0 = time.time()
                work(lambda: ends.append(time.time()))
                spans[direction].append((t0, ends[0] if ends else time.time()))
                if ends and store is not None and store[3]:  # its xxh3s were taken
                    self.late_hash_s.append(time.time() - ends[0])
            except BaseException as exc:
                failures.append(exc)

        threads = []
        if load_plan is not None:
            plan, expect = load_plan, expected_row_sums(load_plan)  # the job's metadata
            threads.append(threading.Thread(target=timed, args=("load", lambda _: load_blocks(
                self.loader, load_job, plan.slots, load_ids, expect))))
        if store is not None:
            keys, _, slots, hash_later = store
            threads.append(threading.Thread(target=timed, args=("store", lambda done: (
                store_blocks(self.storer, self.checker, self.pool, self.index, keys,
                             list(range(n)), slots, store_jobs, done, hash_later=hash_later,
                             copied=lambda: copied.append(time.time()))))))
        self.barrier.wait()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        if phase == "store":  # the stores alone: their copies against the wait for the commit
            spans["copied"].append((spans["store"][-1][0], copied[0]))
        if load_plan is not None:
            bad = mismatched_blocks(self.rows, load_ids, loads)
            self.counts["load_mismatches"] += len(bad)
            self.counts["load_bytes_compared"] += n * self.block_bytes
            self.counts["blocks_loaded"] += n
            self.index.complete_load(load_keys)
        if store is not None:
            keys, numbers, slots, _ = store
            self.counts["blocks_stored"] += n
            # Read back through a plain copy (the pool's bytes, not a check's verdict), then the
            # slots go back to the pool for the next round.
            self.rows[n:].fill_(POISON)
            self._settle()
            load_blocks(self.loader, self._job_ids(1), slots, load_ids, None)
            bad = mismatched_blocks(self.rows, load_ids, numbers)
            self.counts["store_mismatches"] += len(bad)
            self.counts["store_bytes_compared"] += n * self.block_bytes
            self.index.discard(keys)
            self.index.pool_stats()  # discarded before the next round's stores are placed


_RAW_DIRECTION = {"load": "h2d", "store": "d2h", "both": "bidir"}


def engine_blocks(block_bytes: int, num: int, device_type: str) -> int:
    """Blocks in one engine's set: SET_MAX_BYTES, fewer where /dev/shm cannot hold the pool (the
    common set, each engine's own set and each engine's stores of a round); 0: no room."""
    stride = slot_stride(block_bytes)
    fit = int(shm_free_bytes() * 0.8) // ((1 + 2 * num) * stride)
    return min(SET_MAX_BYTES[device_type] // block_bytes, fit, _BATCH - 1)


def measure_engines(workers: GpuWorkers, block_bytes: int, n: int,
                    repeats: int) -> dict[str, Any]:
    """One engine per GPU on one pool daemon; rates per engine and aggregate (GB/s)."""
    if block_bytes % 8:
        raise ValueError(f"a block of {block_bytes} B: whole 8-byte words only")
    if n < 3:
        raise ValueError(f"{n} blocks per set: the loads take three parts, at least 3 are needed")
    gpus, num = workers.gpus, len(workers.gpus)
    name = f"bench-{secrets.token_hex(4)}"
    capacity = (1 + 2 * num) * n * slot_stride(block_bytes)
    size = RAW_COPY_BYTES[workers.device_type]  # each engine's raw copy in turns
    with tempfile.TemporaryDirectory(prefix="kvconnector-bench-") as tmp, \
            PoolProcess(Path(tmp) / "pool.log", name, capacity=str(capacity),
                        slot_bytes=str(block_bytes)):
        answers = workers.ask(("engine", name, block_bytes, n, repeats, size))
    nbytes = n * block_bytes
    engines = []
    for gpu, answer in zip(gpus, answers, strict=True):
        spans = answer.pop("spans")
        rates = {f"{phase}_{direction}_gbps": statistics.median(
                     nbytes / (end - start) / 1e9 for start, end in spans[phase][direction][1:])
                 for phase in PHASES for direction in ("load", "store")
                 if spans[phase][direction]}
        engines.append({"gpu": gpu, **answer, **rates, "spans": spans})
    aggregate: dict[str, float] = {}
    for phase in PHASES:
        for direction in ("load", "store", "copied"):  # copied: the stores' copies, no commit
            if engines[0]["spans"][phase][direction]:
                aggregate[f"{phase}_{direction}_gbps"] = statistics.median(
                    num * nbytes / _span([e["spans"][phase][direction][k] for e in engines]) / 1e9
                    for k in range(1, repeats + 1))
    aggregate["both_gbps"] = statistics.median(
        2 * num * nbytes / _span([e["spans"]["both"][d][k] for e in engines
                                  for d in ("load", "store")]) / 1e9
        for k in range(1, repeats + 1))
    raw = {f"{_RAW_DIRECTION[phase]}_gbps": statistics.median(
               (2 if phase == "both" else 1) * num * size
               / _span([e["spans"][phase]["raw"][k] for e in engines]) / 1e9
               for k in range(1, repeats + 1)) for phase in PHASES}
    for engine in engines:
        del engine["spans"]
    return {"block_bytes": block_bytes, "blocks": n, "gpus": gpus, "engines": engines,
            "aggregate": aggregate, "raw": raw,
            "raw_method": f"one {size >> 20} MiB copy per GPU, every GPU at once, before each "
                          f"engine round of the phase (its direction; both: one each way), the "
                          f"median of the timed rounds"}


def blocks_per_set(sizes: Sequence[int], num: int, device_type: str) -> list[int]:
    """`engine_blocks` of each block size; ValueError, before anything runs, where /dev/shm
    cannot hold three blocks a set of one of them."""
    blocks = [engine_blocks(size, num, device_type) for size in sizes]
    for size, n in zip(sizes, blocks, strict=True):
        if size % 8:
            raise ValueError(f"a block of {size} B: whole 8-byte words only")
        if SET_MAX_BYTES[device_type] // size < 3:
            raise ValueError(f"blocks of {size} B: a set holds at most "
                             f"{SET_MAX_BYTES[device_type]} B here, under 3 blocks")
        if n < 3:
            raise ValueError(f"no room for 3 blocks of {size} B per set: {1 + 2 * num} sets in "
                             f"/dev/shm ({shm_free_bytes() >> 20} MiB free; docker: "
                             f"--shm-size)")
    return blocks


def measure_every_gpu(gpus: list[int], device_type: str, sizes: Sequence[int], repeats: int,
                      step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The raw ceilings of `gpus`, then one row per block size with its ratios (`add_ratios`);
    `step` is told before each measurement. `mismatched_blocks_in` counts what failed."""
    blocks = blocks_per_set(sizes, len(gpus), device_type)
    with GpuWorkers(gpus, device_type) as workers:
        step(f"{len(gpus)} GPUs: raw copies")
        ceilings = measure_ceilings(workers, repeats)
        rows = []
        for size, n in zip(sizes, blocks, strict=True):
            step(f"{len(gpus)} GPUs: shared pool, {size} B blocks")
            row = measure_engines(workers, size, n, repeats)
            add_ratios(row)
            rows.append(row)
    return {"gpus": gpus, "ceilings": ceilings, "rows": rows}


def mismatched_blocks_in(rows: Sequence[dict[str, Any]]) -> int:
    """Blocks that came back unlike what was stored, over every engine of every row."""
    return sum(e["load_mismatches"] + e["store_mismatches"] for row in rows
               for e in row["engines"])


def add_ratios(row: dict[str, Any]) -> None:
    """Each aggregate against the raw aggregate of its direction, taken in turns with its rounds
    (`measure_engines`)."""
    raw, agg = row["raw"], row["aggregate"]
    row["ratios"] = {"load": agg["load_load_gbps"] / raw["h2d_gbps"],
                     "store": agg["store_store_gbps"] / raw["d2h_gbps"],
                     "both": agg["both_gbps"] / raw["bidir_gbps"],
                     "both_load": agg["both_load_gbps"] / raw["h2d_gbps"],
                     "both_store": agg["both_store_gbps"] / raw["d2h_gbps"],
                     # the stores up to their last copy's end, without the wait for the last
                     # commit: what the copies reach, and what that wait costs the figure
                     "store_copies": agg["store_copied_gbps"] / raw["d2h_gbps"]}


def format_tables(ceilings: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The ceilings, then each block size's engines and aggregate, as plain-text tables."""
    out = [f"Raw pinned copies ({ceilings['copy_bytes'] >> 20} MiB per GPU), GB/s:",
           f"{'':>22} {'load h2d':>10} {'store d2h':>10} {'both':>10}"]
    for gpu, one in zip(ceilings["gpus"], ceilings["alone"], strict=True):
        out.append(f"{f'GPU {gpu} alone':>22} " + " ".join(
            f"{one[f'{d}_gbps']:>10.2f}" for d in DIRECTIONS))
    for label, key in (("sum of GPUs alone", "sum_of_alone"), ("all at once", "aggregate"),
                       ("all / sum", "aggregate_of_sum")):
        out.append(f"{label:>22} " + " ".join(f"{ceilings[key][f'{d}_gbps']:>10.2f}"
                                              for d in DIRECTIONS))
    for row in rows:
        agg, ratio = row["aggregate"], row["ratios"]
        out += ["", f"Shared pool, block {row['block_bytes'] >> 10} KiB, {row['blocks']} blocks "
                    f"per engine and set, {len(row['gpus'])} engines, GB/s:",
                f"{'':>22} {'load':>10} {'store':>10} {'both: load':>11} {'store':>8} "
                f"{'sum':>8}"]
        for e in row["engines"]:
            label = f"GPU {e['gpu']}"
            out.append(f"{label:>22} {e['load_load_gbps']:>10.2f} "
                       f"{e['store_store_gbps']:>10.2f} {e['both_load_gbps']:>11.2f} "
                       f"{e['both_store_gbps']:>8.2f} {'':>8}")
        out.append(f"{'aggregate':>22} {agg['load_load_gbps']:>10.2f} "
                   f"{agg['store_store_gbps']:>10.2f} {agg['both_load_gbps']:>11.2f} "
                   f"{agg['both_store_gbps']:>8.2f} {agg['both_gbps']:>8.2f}")
        raw = row["raw"]
        out.append(f"{'raw, in turns':>22} {raw['h2d_gbps']:>10.2f} {raw['d2h_gbps']:>10.2f} "
                   f"{'':>11} {'':>8} {raw['bidir_gbps']:>8.2f}")
        out.append(f"{'of the raw aggregate':>22} {ratio['load']:>10.3f} {ratio['store']:>10.3f} "
                   f"{ratio['both_load']:>11.3f} {ratio['both_store']:>8.3f} "
                   f"{ratio['both']:>8.3f}")
        out.append(f"{'stores to last copy':>22} {'':>10} {ratio['store_copies']:>10.3f}")
        checked = sum(e["load_bytes_compared"] + e["store_bytes_compared"] for e in row["engines"])
        out.append(f"{'bytes compared':>22} {checked}: {mismatched_blocks_in([row])} "
                   f"mismatched blocks")
    return "\n".join(out)
