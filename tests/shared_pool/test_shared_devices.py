"""The shared pool on a GPU: two processes, each its own GPU cache, one pool between them,
through the connector's cores (the worker's DMA path: its default copy backend, a pinned
mapping). Blocks stored by one load bit-exact in the other; a slot flipped after its commit is
refused before it is copied (the cache keeps its poison from it on), and vLLM's recompute is
asked from that block on; a load in many chunks (each copied once checked) is byte-exact, and
one with a flipped block copies only the blocks before it. The same tests run on CPU caches
(thread copies) everywhere, the GPU cases under the `gpu` marker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pool_sides import (
    NS,
    POISON,
    Child,
    Side,
    fill,
    flip,
    gpu_writer_child,
    hashes,
    row_sums_writer_child,
    writer_child,
)

from kvconnector.offload import checked_loads, pool_checks
from kvconnector.servers.pool import PoolProcess
from transfer.checksums import block_checksum
from transfer.copy import base
from transfer.copy.row_sums import row_sums, to_unsigned
from transfer.pool import HostPool
from transfer.slot_checker import SlotChecker

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[
               pytest.mark.gpu,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", f"g{uuid.uuid4().hex[:10]}", capacity="64KiB",
                     slot_bytes="4KiB") as process:
        yield process


@pytest.mark.parametrize("device", DEVICES)
def test_caches_share_the_pool_and_a_flipped_slot_is_refused(pool: PoolProcess,
                                                             device: str) -> None:
    writer = Child(gpu_writer_child if device == "cuda" else writer_child, pool.name)
    reader = Side(pool.name, device=device)
    try:
        assert writer.ask(("store", "g", 4, 21)) == "stored"
        want = fill(torch.empty(4, reader.rows.shape[1], dtype=torch.uint8), [0, 1, 2, 3], 21)
        blocks = [13, 2, 7, 5]
        reader.rows.fill_(POISON)
        hits, events = reader.load("r", hashes("g", 4), blocks)
        assert hits == 4 and events.finished_loads == {"r"} and not events.failed_loads
        for block, data in zip(blocks, want, strict=True):
            assert torch.equal(reader.rows[block].cpu(), data), f"block {block} differs"
        assert bool((reader.rows[[0, 1, 3]] == POISON).all())  # untouched
        assert reader.worker.pool.pinned == torch.cuda.is_available()  # the default

        # One bit of the second block's slot flipped through the segment, after its commit.
        keys = NS.keys(hashes("g", 4))
        plan = reader.index.prepare_load(keys[1:2])
        reader.index.complete_load(keys[1:2])
        segment = HostPool.attach(reader.index.segment, pinned=False)
        segment.slots[plan.slots[0], 5] ^= 0x10
        segment.close()
        hits, events = reader.load("s", hashes("g", 4), blocks)
        assert hits == 4
        assert events.finished_loads == events.failed_loads == {"s"}
        assert events.failed_block_ids == {2, 7, 5}  # recomputed from the flipped block on
        assert torch.equal(reader.rows[13].cpu(), want[0])
        assert bool((reader.rows[[2, 7, 5]] == POISON).all())  # checked first: never copied
        counters = reader.core.take_counters()
        assert (counters.checksum_failures, counters.failed_loads) == (1, 1)
        writer.exit()
    finally:
        writer.kill()
        reader.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checks", ["row sums", "xxh3"])
def test_loads_in_chunks_copy_only_checked_blocks(pool: PoolProcess, device: str, checks: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Both checks a load may take: row sums (the writer took them, as GPU workers do) checked
    on the way by the copy engine, through staging buffers of 2 blocks (CPU workers too, here);
    or, where its blocks lack row sums (a CPU writer's), xxh3 on the checker threads, in chunks
    of 2 blocks (the first of a block per checker thread, at most 2): 6 or 7 chunks."""
    if checks == "row sums":  # the copy engine checks them: the checker threads never do
        monkeypatch.setattr(pool_checks, "ROW_SUMS_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(SlotChecker, "verify", _never)
    writer = Child(row_sums_writer_child if checks == "row sums" else writer_child, pool.name)
    reader = Side(pool.name, device=device)
    try:
        row = reader.rows.shape[1]
        monkeypatch.setattr(base, "STAGE_BYTES", 2 * row)
        monkeypatch.setattr(checked_loads, "CHUNK_BYTES", 2 * row)
        assert writer.ask(("store", "m", 12, 31)) == "stored"
        want = fill(torch.empty(12, row, dtype=torch.uint8), list(range(12)), 31)
        blocks = [15, 0, 14, 1, 13, 2, 12, 3, 11, 4, 10, 5]
        hits, events = reader.load("a", hashes("m", 12), blocks)
        assert hits == 12 and events.finished_loads == {"a"} and not events.failed_loads
        assert torch.equal(reader.rows[blocks].cpu(), torch.stack(want))
        counters = reader.core.take_counters()
        assert (counters.load_bytes, counters.checksum_failures) == (12 * row, 0)
        # The commit: each block's xxh3 (bound to its key), then its row sum where taken.
        keys = NS.keys(hashes("m", 12))
        assert reader.index.checksums(keys) == [
            [block_checksum(w.numpy(), k)] + to_unsigned(row_sums(w[None])) * (checks == "row sums")
            for w, k in zip(want, keys, strict=True)]
        # Block 5 flipped (mid-chunk, or a chunk's first with one checker thread): 0-4 load,
        # 5-11 keep the poison.
        flip(reader, NS.keys(hashes("m", 12))[5], row - 1)
        blocks.reverse()
        hits, events = reader.load("b", hashes("m", 12), blocks)
        assert hits == 12
        assert events.finished_loads == events.failed_loads == {"b"}
        assert events.failed_block_ids == set(blocks[5:])
        assert torch.equal(reader.rows[blocks[:5]].cpu(), torch.stack(want[:5]))
        assert bool((reader.rows[blocks[5:]] == POISON).all())
        counters = reader.core.take_counters()
        assert (counters.checksum_failures, counters.failed_loads) == (1, 1)
        assert counters.load_bytes == 5 * row
        assert reader.core.lookup("q", hashes("m", 12), 0, 100) == 0  # the keys left the pool
        writer.exit()
    finally:
        writer.kill()
        reader.close()


def _never(*args: object) -> None:
    raise AssertionError("a load with row sums was checked by xxh3")
