"""The shared host pool: another process's blocks loaded into this process's cache.

A `kvconnector pool serve` daemon (a child process) owns the pool; a writer engine (a spawned
process with its own cache, its own mapping of the pool and its own connection) stores n random
blocks into it by DMA; this process looks them up, pins them and loads them into its own cache
by DMA, straight from the shared slots, each block only once its checksum matched, as an engine
does: by its row sums, checked on the way by the copy engine (transfer/copy/row_sums.py: staged,
summed and copied on by the GPU; `load_gbps`), and, as for blocks that carry no row sums, by
xxh3 on the checker threads (kvconnector/offload/checked_loads.py; `xxh3_load_gbps`). The writer
stores as an engine does (`store_blocks`): WRITER_JOBS jobs per set (an engine stores one job
per request), each summed by its copy engine and committed by those row sums as soon as it is
copied, while the next ones copy; a store's time runs until every block is committed
(`store_gbps`: the median of `repeats` rounds of n new blocks placed beforehand, after one
warm-up). Its xxh3s are taken from each commit on, as an engine's worker takes them (off the
store's path, each slot checked against its committed row sums first:
SlotChecker.hash_checked) and attached (`add_sums`), since this process also loads by xxh3 (its
lease needs them; the writer's, a GPU engine's without a tier below, would not): `late_hash_s`
is how long after the last commit the last xxh3 was attached, `late_hash_gbps` the set's bytes
over the time from the store's start to then.
Rates are held against raw copies taken in turns with the rounds (kvconnector.bench.ceilings
.RawCopies): before each round, one raw copy of its direction (host -> device before a load,
device -> host in the writer before a store, one each way at once before both directions at
once: the writer storing a second set while this process loads the first, by row sums), of a
set's bytes up to RAW_COPY_BYTES; a figure's ratio is its median over the median of those
copies, which span the same minutes (a machine's other tenants can move the host's limit while a
bench runs). The ratios against the ceilings taken before (`ceiling_ratios`) stay in the row.
Metadata cost per block: lookup + pin + unpin (a load's round trips), and allocate + commit (a
store's), from the client's side, per block of a batch of n.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvconnector.bench.ceilings import RAW_COPY_BYTES, RawCopies
from kvconnector.layout.allocator import SlotBuffer, allocate_slots, shm_free_bytes, slot_stride
from kvconnector.layout.descriptor import HOST_ALIGNMENT
from kvconnector.offload.checked_loads import CheckedLoads
from kvconnector.offload.jobs import ROW_SUM_DTYPE, TransferJob, pack_row_sums
from kvconnector.servers.pool import PoolProcess
from transfer.block_index import LoadPlan, StorePlan
from transfer.checksums import hashed
from transfer.engine import TransferEngine
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.shared.client import SharedIndex
from transfer.slot_checker import SlotChecker

SHARED_MAX_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}  # per set of blocks
WRITER_JOBS = 8  # the writer's store of a set, as jobs (an engine stores one per request)
_ROUNDS = 10  # key batches of the writer's timed store rounds: 10, 11, ...
_BOTH_ROUNDS = 1000  # and of its stores while the reader loads: 1000, 1001, ...
_TIMEOUT_S = 300.0


def shared_steps(num_cases: int) -> int:
    return num_cases


def pool_block_bytes(case: Any) -> int:
    """The bytes a case's block takes in a pool: an engine's slot is its block rounded up to
    whole 4 KiB pages (kvconnector/vllm/tiers.py), and a pool's --slot-bytes is whole pages."""
    return -(-case.layout.block_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


def measure_shared(plan: list[Any], ceilings: Any, device: torch.device, repeats: int,
                   step: Callable[[str], None]) -> dict[str, Any]:
    """One row per case; {"skipped": why} where no pool fits in /dev/shm."""
    rows = []
    for case, blocks, _ in plan:
        step(f"{case.name}: shared pool")
        block_bytes = pool_block_bytes(case)
        stride = slot_stride(block_bytes)
        fit = int(shm_free_bytes() * 0.8) // (3 * stride)
        n = min(blocks, SHARED_MAX_BYTES[device.type] // block_bytes, fit)
        if n < 1:
            rows.append({"case": case.name, "error": "no room for the pool in /dev/shm"})
            continue
        try:
            row = measure_one(block_bytes, n, device, repeats)
        except Exception as exc:  # a finding: the other cases still run
            row = {"error": f"{type(exc).__name__}: {exc}"}
        row["case"] = case.name
        if "load_gbps" in row:
            add_ratios(row, ceilings)
        rows.append(row)
    return {"rows": rows}


def add_ratios(row: dict[str, Any], ceilings: Any) -> None:
    """A row's rates against the raw copies taken in turns with its rounds (`raw`): loads one
    way, the writer's stores the other, both at once against both ways at once; and against the
    same run's ceilings taken before (`ceiling_ratios`)."""
    def against(h2d: float, d2h: float, bidir: float) -> dict[str, float]:
        return {"load": row["load_gbps"] / h2d, "xxh3_load": row["xxh3_load_gbps"] / h2d,
                "store": row["store_gbps"] / d2h, "both": row["bidir_gbps"] / bidir}

    raw = against(row["raw"]["h2d_gbps"], row["raw"]["d2h_gbps"], row["raw"]["bidir_gbps"])
    row["load_ratio"], row["xxh3_load_ratio"] = raw["load"], raw["xxh3_load"]
    row["store_ratio"], row["bidir_ratio"] = raw["store"], raw["both"]
    row["ceiling_ratios"] = against(ceilings.h2d_gbps, ceilings.d2h_gbps, ceilings.bidir_gbps)


def measure_one(block_bytes: int, n: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """Store n blocks from a writer process, load them here; figures of one block size."""
    name = f"bench-{secrets.token_hex(4)}"
    stride = slot_stride(block_bytes)
    namespace = Namespace("bench", "uint8", 1, f"{block_bytes} B")
    ctx = mp.get_context("spawn")
    # the raw copies in turns: a set's bytes, up to RAW_COPY_BYTES (each process holds two of
    # them pinned and two on its device while it runs)
    raw_bytes = min(RAW_COPY_BYTES[device.type], n * block_bytes)
    with tempfile.TemporaryDirectory(prefix="kvconnector-bench-") as tmp, \
            PoolProcess(Path(tmp) / "pool.log", name, capacity=str(3 * n * stride),
                        slot_bytes=str(block_bytes)):
        # it loads by row sums, and by xxh3 (its lease needs them: it exists before the writer
        # plans a store, so every store is asked to hash)
        index = SharedIndex(name, namespace, block_bytes, row_sum_reader=True)
        ours, theirs = ctx.Pipe()
        writer = ctx.Process(target=_writer, args=(name, block_bytes, n, str(device), repeats,
                                                   raw_bytes, theirs), daemon=True)
        writer.start()
        checker = SlotChecker()
        pool = cache = engine = raw = None
        try:
            # set 0 stored, its rounds timed (each after a raw device -> host copy of the writer's)
            store_s, late_s, hashed_s, raw_d2h = _answer(ours)
            raw = RawCopies(device, raw_bytes)
            keys = [_key(namespace, 0, i) for i in range(n)]
            pool = HostPool.attach(index.segment, pinned=device.type == "cuda")
            cache = allocate_slots(n, block_bytes, device=device)
            cache.raw.fill_(0xA5)
            engine = TransferEngine(pool.segments([cache.rows()]))
            loads = CheckedLoads(checker, 0)
            ids = torch.randperm(n).tolist()
            meta_load, load_s, xxh3_s, slots, raw_h2d = [], [], [], [], []
            for r in range(repeats + 1):  # the first round warms up
                raw_h2d.append(raw.gbps("h2d"))
                t0 = time.perf_counter()
                hits = index.lookup_prefix(keys)
                plan = index.prepare_load(keys)
                expect = expected_row_sums(plan)
                t1 = time.perf_counter()
                if hits != n or plan is None:
                    raise RuntimeError(f"the writer's blocks are not all in the pool: {hits}/{n}")
                slots = plan.slots
                if not all(hashed(s) for s in plan.sums):
                    raise RuntimeError("the writer's blocks lack their xxh3s")
                _load_summed(engine, 2 * r, ids, slots, expect)
                t2 = time.perf_counter()
                index.complete_load(keys)
                meta_load.append(t1 - t0 + time.perf_counter() - t2)
                load_s.append(t2 - t1)
                cache.raw.fill_(0xA5)
                t3 = time.perf_counter()
                _load(loads, engine, pool.slots, _job(2 * r + 1, ids, slots, keys, plan.sums))
                xxh3_s.append(time.perf_counter() - t3)
            # Every byte: this process's cache holds what the writer put in the slots.
            loaded = cache.rows()[ids]
            if not torch.equal(loaded.cpu(), pool.slots[slots]):
                raise RuntimeError("loaded blocks differ from the writer's")
            cache.raw.fill_(0xA5)
            _load_summed(engine, 2 * repeats + 2, ids, slots, expected_row_sums(plan))
            if not torch.equal(cache.rows()[ids].cpu(), pool.slots[slots]):
                raise RuntimeError("blocks loaded by row sums differ from the writer's")
            meta_store = _store_metadata(index, namespace, n, repeats)
            # Both directions: the writer stores a new set while this process loads set 0, in
            # rounds (the first warms up): one round's figure moved by 5-10% between runs.
            both_s, raw_bidir = [], []
            for r in range(repeats + 1):
                if _answer(ours) != "ready":
                    raise RuntimeError("the writer is not ready for a round of both directions")
                plan = index.prepare_load(keys)
                expect = expected_row_sums(plan)
                raw_bidir.append(raw.gbps("bidir"))
                ours.send("go")
                t0 = time.time()
                _load_summed(engine, 2 * repeats + 3 + r, ids, plan.slots, expect)
                t1 = time.time()
                index.complete_load(keys)
                w0, w1 = _answer(ours)
                both_s.append(max(t1, w1) - min(t0, w0))
            ours.send("exit")
            writer.join(_TIMEOUT_S)
        finally:
            writer.kill()
            for closing in (engine, pool, raw):
                if closing is not None:
                    closing.close()
            if cache is not None:
                cache.close()
            checker.close()
            index.close()
    nbytes = n * block_bytes
    return {"block_bytes": block_bytes, "blocks": n,
            "store_gbps": nbytes / store_s / 1e9,
            "late_hash_s": late_s, "late_hash_gbps": nbytes / hashed_s / 1e9,
            "load_gbps": nbytes / statistics.median(load_s[1:]) / 1e9,
            "xxh3_load_gbps": nbytes / statistics.median(xxh3_s[1:]) / 1e9,
            "bidir_gbps": 2 * nbytes / statistics.median(both_s[1:]) / 1e9,
            "load_meta_us": statistics.median(meta_load[1:]) / n * 1e6,
            "store_meta_us": meta_store / n * 1e6, "check_threads": checker.threads,
            "raw": {"h2d_gbps": statistics.median(raw_h2d[1:]), "d2h_gbps": raw_d2h,
                    "bidir_gbps": statistics.median(raw_bidir[1:])},
            "raw_method": f"one copy of {raw_bytes} B in the phase's direction before each "
                          f"round (both: one each way at once), the median over the timed "
                          f"rounds"}


def _job(job_id: int, ids: list[int], slots: list[int], keys: list[bytes],
         sums: list[list[int]]) -> TransferJob:
    return TransferJob(job_id, "bench", tuple(ids), tuple(slots), checked=tuple(keys),
                       sums=tuple(tuple(s) for s in sums))


def _load(loads: CheckedLoads, engine: TransferEngine, rows: torch.Tensor,
          job: TransferJob) -> None:
    """Load `job` as a worker does, each chunk copied once checked; raises unless all of it
    passed and copied."""
    loads.start(job, len(job.slots), rows, engine)
    loads.submit_all(engine)
    engine.wait()
    for result in engine.get_finished():
        loads.copied(result)
    (result,) = loads.settled(engine)
    good = loads.take_good(job.job_id)
    if good is not None:
        raise RuntimeError(f"block {good} of the writer's failed its checksum")
    if not result.ok or result.nbytes != len(job.slots) * engine.block_bytes:
        raise RuntimeError(f"load {job.job_id} failed: {result}")


def expected_row_sums(plan: LoadPlan | None) -> np.ndarray:
    """A one-rank plan's row sums ([xxh3, row sum] per block) as the scheduler hands them to
    a worker: packed (kvconnector.offload.jobs.pack_row_sums), part of the load's metadata."""
    if plan is None:
        raise RuntimeError("the blocks to load are not all in the pool")
    packed = pack_row_sums([s[1:] for s in plan.sums or []], 1)
    if not packed:
        raise RuntimeError("a block to load carries no row sum")
    return np.frombuffer(packed[0], dtype=ROW_SUM_DTYPE)


def _load_summed(engine: TransferEngine, job_id: int, ids: list[int], slots: list[int],
                 sums: np.ndarray) -> None:
    """Load as a GPU engine's worker does: checked on the way by the blocks' row sums; raises
    unless every block matched and landed."""
    engine.submit_load(job_id, slots, ids, expect=sums)
    engine.wait()
    (result,) = engine.get_finished()
    if not result.ok or result.good != len(ids):
        raise RuntimeError(f"load {job_id} by row sums: {result}")


def _store_metadata(index: SharedIndex, namespace: Namespace, n: int, repeats: int) -> float:
    """Median seconds of allocate + commit for n new keys (commits failed: nothing is hashed
    or kept, so the pool stays as it was)."""
    samples = []
    for r in range(repeats + 1):
        keys = [_key(namespace, 100 + r, i) for i in range(n)]
        t0 = time.perf_counter()
        plan = index.prepare_store(keys)
        index.complete_store(plan.keys, False)
        samples.append(time.perf_counter() - t0)
        if len(plan.keys) != n:
            raise RuntimeError(f"only {len(plan.keys)} of {n} keys found a slot")
    index.pool_stats()  # the commits are applied before we go on
    return statistics.median(samples[1:])


def store_blocks(engine: TransferEngine, checker: SlotChecker, pool: HostPool,
                 index: SharedIndex, keys: list[bytes], ids: list[int], slots: list[int],
                 job_base: int, committed: Callable[[], None] = lambda: None, *,
                 hash_later: bool = True, copied: Callable[[], None] = lambda: None) -> None:
    """Store as an engine's worker does: WRITER_JOBS jobs (an engine stores one per request),
    each committed by its row sums as soon as it is copied, while the next ones copy;
    `copied()` once the host sees the last job's copies end, `committed()` once every commit is
    applied (readable); with `hash_later` (the store's plan
    says a lease needs them), each job's xxh3s, taken off the store's path from its commit on
    (each slot checked against its committed row sums first: SlotChecker.hash_checked), are
    attached after."""
    step = -(-len(keys) // WRITER_JOBS)
    parts = [slice(i, i + step) for i in range(0, len(keys), step)]
    for j, part in enumerate(parts):
        engine.submit_store(job_base + j, ids[part], slots[part], sums=True)
    later, sums_of_rows, finished = [], [], {}
    for j, part in enumerate(parts):
        engine.wait([job_base + j])
        if j == len(parts) - 1:
            copied()
        finished.update((res.job_id, res) for res in engine.get_finished())
        result = finished.pop(job_base + j)
        if not result.ok or len(result.sums) != len(keys[part]):
            raise RuntimeError(f"store job {result.job_id} failed: {result}")
        index.complete_store(keys[part], True, [[None, r] for r in result.sums])
        if hash_later:
            sums_of_rows.append(result.sums)
            later.append(checker.hash_checked(pool.slots, slots[part], keys[part],
                                              result.sums))
    # Every commit applied (readable): a client's requests are answered in order, so its
    # lookup of the last key comes back after every commit it sent (a lookup, not `stats`,
    # which also sums every lease's pins).
    if index.lookup_prefix(keys[-1:]) != 1:
        raise RuntimeError("the last block stored is not readable")
    committed()
    if not hash_later:
        return
    for part, future, rows in zip(parts, later, sums_of_rows, strict=True):
        xxh3s = future.result()
        if None in xxh3s:
            raise RuntimeError("a slot changed between its commit and its hash")
        attached = index.add_sums(keys[part], [[x, r] for x, r in zip(xxh3s, rows, strict=True)],
                                  slots[part])
        if not all(attached):
            raise RuntimeError("the pool refused a block's xxh3")


def _key(namespace: Namespace, batch: int, i: int) -> bytes:
    return namespace.key(batch * 1_000_000 + i)


def _answer(conn: Connection) -> Any:
    if not conn.poll(_TIMEOUT_S):
        raise RuntimeError("the writer process did not answer")
    answer = conn.recv()
    if isinstance(answer, str) and answer.startswith("error"):
        raise RuntimeError(f"writer: {answer}")
    return answer


def _writer(name: str, block_bytes: int, n: int, device: str, repeats: int, raw_bytes: int,
            conn: Connection) -> None:
    """Another engine: store set 0 (untimed: the loads' blocks), then `repeats` + 1 rounds of n
    new blocks, each after a raw device -> host copy and dropped once stored (the first round
    warms up), and answer their medians (`_store_rounds`); then, a round per "go" until another
    word comes, store a new set (answer when it began and was committed; its xxh3s follow),
    drop it and say "ready"."""
    try:
        namespace = Namespace("bench", "uint8", 1, f"{block_bytes} B")
        # a GPU engine with no tier below: the reader's lease is what wants the xxh3s
        index = SharedIndex(name, namespace, block_bytes, row_sum_reader=True, needs_xxh3=False)
        index.pool_stats()  # its notice applied before the first store is planned
        pool = HostPool.attach(index.segment, pinned=device.startswith("cuda"))
        cache: SlotBuffer = allocate_slots(n, block_bytes, device=device)
        g = torch.Generator(device=device).manual_seed(1)
        cache.raw.copy_(torch.randint(0, 256, cache.raw.shape, dtype=torch.uint8,
                                      device=device, generator=g))
        engine = TransferEngine(pool.segments([cache.rows()]))
        checker = SlotChecker()
        raw = RawCopies(torch.device(device), raw_bytes)
        ids = torch.randperm(n).tolist()

        def prepared(batch: int) -> StorePlan:
            plan = index.prepare_store([_key(namespace, batch, i) for i in range(n)])
            if len(plan.keys) != n:
                raise RuntimeError(f"only {len(plan.keys)} of {n} blocks found a slot")
            return plan

        def store(plan: StorePlan, job_base: int,
                  committed: Callable[[], None] = lambda: None) -> None:
            if not plan.hash_later:
                raise RuntimeError("the reader's lease needs xxh3s: the pool must ask for them")
            store_blocks(engine, checker, pool, index, plan.keys, ids, plan.slots, job_base,
                         committed)

        store(prepared(0), 0)
        conn.send(_store_rounds(prepared, store, index, repeats, raw))
        raw.close()
        for r in itertools.count():  # a round of both directions at once per "go"
            plan = prepared(_BOTH_ROUNDS + r)
            conn.send("ready")  # the last round's blocks dropped, this one's placed
            if conn.recv() != "go":
                break
            w0 = time.time()
            store(plan, WRITER_JOBS, lambda w0=w0: conn.send((w0, time.time())))
            index.discard(plan.keys)
            index.pool_stats()  # dropped before the next round's slots are placed
        checker.close()
        engine.close()
        pool.close()
        cache.close()
        index.close()
    except Exception as exc:
        conn.send(f"error {type(exc).__name__}: {exc}")


def _store_rounds(prepared: Callable[[int], StorePlan],
                  store: Callable[[StorePlan, int, Callable[[], None]], None],
                  index: SharedIndex, repeats: int,
                  raw: RawCopies) -> tuple[float, float, float, float]:
    """Median seconds of a store's timed rounds (after one warm-up), each of n new keys placed
    beforehand (their metadata is `store_meta_us`): to commit every block, from the last commit
    to the last xxh3 attached, and from the store's start to then; and the median GB/s of the
    raw device -> host copy taken before each. Each round's blocks are dropped after it, so the
    next one stores into the same slots."""
    samples = []
    for r in range(repeats + 1):
        plan = prepared(_ROUNDS + r)
        raw_gbps = raw.gbps("d2h")
        marks: list[float] = []
        t0 = time.perf_counter()
        store(plan, (2 + r) * WRITER_JOBS, lambda into=marks: into.append(time.perf_counter()))
        t2 = time.perf_counter()
        samples.append((marks[0] - t0, t2 - marks[0], t2 - t0, raw_gbps))
        index.discard(plan.keys)
        index.pool_stats()  # dropped before the next round's slots are placed
    return tuple(statistics.median(s[i] for s in samples[1:])  # type: ignore[return-value]
                 for i in range(4))
