"""The disk tier in vLLM's real CPU engine (TP 1, in process): a host pool of 4 slots, smaller
than a 6-block prompt, with a slab below it (policy "evict").

Prompt A (200 tokens: 6 full blocks) is computed and its first 4 blocks stored in the pool (the
last 2 find no slot); prompt B's 4 blocks then evict A's to disk. After vLLM's prefix cache is
emptied, A's first 4 blocks come back from disk (through pool slots): tokens and logprobs
identical, the tokens counted as disk hits by the connector and by vLLM. Controls on the slab
file itself: bytes flipped under the engine are caught by the checksum (the load fails, vLLM
recomputes: identical output, the failure counted), and blocks replaced by zeros with footers
that match them are loaded and change the output (so the disk is what served the reload). A new
engine on the same disk_path (a restart) finds the blocks and loads them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from engine_checks import expect_corruption_seen, reload
from engine_support import (
    BLOCK_SIZE,
    Generation,
    block_bytes,
    counted,
    counters,
    forget_everything,
    generate,
    running_llm,
    settle,
)
from tiny_llama import prompt_ids

from transfer.checksums import block_checksum
from transfer.disk.slab import ALIGN, aligned_buffer, scan, seal_footer, slot_bytes

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

POOL_SLOTS = 4
DISK_SLOTS = 64
ON_DISK = POOL_SLOTS * BLOCK_SIZE  # A's tokens that B's stores evict to disk: 128


def _extra(disk: Path) -> dict[str, Any]:
    return {"cpu_bytes": POOL_SLOTS * block_bytes(), "disk_path": str(disk),
            "disk_bytes": DISK_SLOTS * slot_bytes(block_bytes()), "disk_write_policy": "evict"}


class FirstEngine:
    """The first engine, stopped by the restart test (or at the module's end)."""

    def __init__(self, model: str, disk: Path) -> None:
        self.disk = disk
        self._stack = ExitStack()
        self.llm: LLM = self._stack.enter_context(running_llm(model, _extra(disk)))

    def stop(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def first(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstEngine]:
    engine = FirstEngine(tiny_model, tmp_path_factory.mktemp("disk"))
    try:
        yield engine
    finally:
        engine.stop()


def cached_by_source(llm: LLM) -> dict[str, float]:
    """vLLM's prompt_tokens_cached_by_source counter, by its `source` label."""
    from vllm.v1.metrics.reader import Counter

    return {m.labels["source"]: m.value for m in llm.get_metrics()
            if isinstance(m, Counter) and m.name == "vllm:prompt_tokens_cached_by_source"}


def a_on_disk_only(llm: LLM, a: list[int], b: list[int]) -> Generation:
    """Every tier emptied, A computed, B's stores evict A's 4 pooled blocks to disk; A's
    computed output is returned."""
    forget_everything(llm)
    before = counters(llm)
    computed = generate(llm, a)
    assert computed.num_cached_tokens == 0, computed
    settle(llm)
    generate(llm, b)
    settle(llm)  # the evicted blocks' writes included
    gained = counted(llm, before)
    assert gained["kvconnector_disk_write_bytes"] == POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_disk_failed_writes"] == 0, gained
    return computed


def slab_blocks(disk: Path) -> tuple[Path, dict[int, bytes]]:
    """The engine's slab file and slot -> key of every block in it (sound footers)."""
    (path,) = disk.glob("*.slab")
    return path, scan(disk, bytes.fromhex(path.stem), DISK_SLOTS)


def rewrite_on_disk(disk: Path, change: str) -> int:
    """Under the running engine, change every block in its slab: "flip" one byte of each block
    (its footer then names the old checksum), or "zero" each block and seal a footer that
    matches the zeros. Buffered writes, synced: the engine's O_DIRECT reads see them."""
    path, blocks = slab_blocks(disk)
    size = block_bytes()
    stride = slot_bytes(size)
    with path.open("r+b") as f:
        for slot, key in blocks.items():
            offset = ALIGN + slot * stride
            if change == "flip":
                f.seek(offset + 4321)
                byte = f.read(1)[0]
                f.seek(offset + 4321)
                f.write(bytes([byte ^ 0x40]))
            else:
                zeros = bytes(size)
                footer = aligned_buffer(stride - size)
                seal_footer(footer, slot, size, key, block_checksum(zeros, key))
                f.seek(offset)
                f.write(zeros + bytes(footer))
        f.flush()
        os.fsync(f.fileno())
    return len(blocks)


def expect_disk_load(llm: LLM, gained: dict[str, float], by_source: dict[str, float],
                     got: Generation) -> None:
    """`got` loaded A's ON_DISK tokens from disk: the counters' gains and vLLM's count by source
    since `by_source` (a `cached_by_source` snapshot)."""
    assert got.num_cached_tokens == ON_DISK, got
    assert gained["prefix_cache_hits"] == 0, gained
    assert gained["external_prefix_cache_hits"] == ON_DISK, gained
    assert gained["kvconnector_hit_tokens"] == ON_DISK, gained
    assert gained["kvconnector_disk_hit_tokens"] == ON_DISK, gained
    assert gained["kvconnector_disk_read_bytes"] == POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_load_bytes"] == POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    assert gained["kvconnector_disk_failed_reads"] == 0, gained
    now = cached_by_source(llm)
    assert now.get("disk", 0) - by_source.get("disk", 0) == ON_DISK, (by_source, now)
    assert now.get("host", 0) == by_source.get("host", 0), (by_source, now)


def test_blocks_evicted_from_a_small_pool_come_back_from_disk_identically(
        first: FirstEngine) -> None:
    llm, a, b = first.llm, prompt_ids(31, 200), prompt_ids(32, 200)
    computed = a_on_disk_only(llm, a, b)
    assert len(slab_blocks(first.disk)[1]) == POOL_SLOTS
    by_source = cached_by_source(llm)
    again, gained = reload(llm, a, computed)
    expect_disk_load(llm, gained, by_source, again)

    # Control: the same blocks on disk replaced by zeros under sound footers load, and the
    # output changes: what the reload used came from the slab.
    computed = a_on_disk_only(llm, a, b)
    assert rewrite_on_disk(first.disk, "zero") == POOL_SLOTS
    before, by_source = counters(llm), cached_by_source(llm)
    zeroed = generate(llm, a)
    expect_disk_load(llm, counted(llm, before), by_source, zeroed)
    assert zeroed.logprobs != computed.logprobs, "zeroed blocks on disk changed no logprob"
    forget_everything(llm)


def test_bytes_flipped_on_disk_fail_the_load_and_vllm_recomputes_identically(
        first: FirstEngine) -> None:
    llm, a, b = first.llm, prompt_ids(33, 200), prompt_ids(34, 200)
    computed = a_on_disk_only(llm, a, b)
    assert rewrite_on_disk(first.disk, "flip") == POOL_SLOTS
    before = counters(llm)
    got = generate(llm, a)
    gained = counted(llm, before)
    assert got.same_output(computed), (computed, got)
    assert got.num_cached_tokens == 0, got  # recomputed from the first block on
    assert gained["kvconnector_disk_failed_reads"] == POOL_SLOTS, gained
    assert gained["kvconnector_failed_loads"] == 1, gained  # the request's one load job
    assert gained["kvconnector_disk_read_bytes"] == 0, gained
    assert gained["kvconnector_load_bytes"] == 0, gained
    # nothing corrupt was kept: the failed blocks left the disk index, the recomputed ones
    # were stored again and reload identically
    again, gained = reload(llm, a, computed)
    assert again.num_cached_tokens == ON_DISK, again
    assert gained["kvconnector_failed_loads"] == 0, gained
    forget_everything(llm)


def test_a_new_engine_on_the_same_disk_path_loads_the_blocks_it_finds(
        first: FirstEngine, tiny_model: str) -> None:
    a, b = prompt_ids(35, 200), prompt_ids(36, 200)
    computed = a_on_disk_only(first.llm, a, b)
    first.stop()  # the slab is closed; A's 4 blocks stay in it
    with running_llm(tiny_model, _extra(first.disk)) as llm:
        by_source = cached_by_source(llm)
        got, gained = reload(llm, a, computed)
        expect_disk_load(llm, gained, by_source, got)
        # read into pool slots, they stay there: zeroed, the reload must change
        expect_corruption_seen(llm, a, computed, ON_DISK)
