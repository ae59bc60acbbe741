"""The disk tier below a shared pool in vLLM's real CPU engine (TP 1, in process): a real
`kvconnector pool serve` process of 4 slots, smaller than a 6-block prompt, and a slab below it
(policy "through": every block the engine stores goes to disk too, with the checksum it was
committed with).

Prompt A (200 tokens: 6 full blocks) is computed and its first 4 blocks stored in the pool and
on disk; prompt B's 4 blocks then take every slot. After vLLM's prefix cache is emptied, A's 4
blocks come back from disk through slots of the shared pool: tokens and logprobs identical,
counted as disk hits by the connector and by vLLM. Control: the blocks on disk replaced by zeros
under footers that match them load, and the output changes (the disk served the reload).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
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
from test_engine_disk import DISK_SLOTS, cached_by_source, rewrite_on_disk
from tiny_llama import prompt_ids

from kvconnector.servers.pool import PoolProcess
from transfer.disk.slab import slot_bytes

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine

POOL_SLOTS = 4
ON_DISK = POOL_SLOTS * BLOCK_SIZE  # A's tokens that come back from disk: 128


@pytest.fixture(scope="module")
def engine(tiny_model: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[LLM, Path]]:
    folder = tmp_path_factory.mktemp("pool-disk")
    disk = folder / "disk"
    disk.mkdir()
    with PoolProcess(folder / "pool.log", f"disk-{uuid.uuid4().hex[:8]}",
                     capacity=str(POOL_SLOTS * block_bytes()),
                     slot_bytes=str(block_bytes())) as pool:
        extra = {"pool": pool.name, "disk_path": str(disk),
                 "disk_bytes": DISK_SLOTS * slot_bytes(block_bytes()),
                 "disk_write_policy": "through"}
        with running_llm(tiny_model, extra) as llm:
            yield llm, disk


def a_on_disk_only(llm: LLM, a: list[int], b: list[int]) -> Generation:
    """Every tier emptied, A computed and written through, B's stores take every slot of the
    pool; A's computed output is returned."""
    forget_everything(llm)
    before = counters(llm)
    computed = generate(llm, a)
    assert computed.num_cached_tokens == 0, computed
    settle(llm)
    generate(llm, b)
    settle(llm)
    gained = counted(llm, before)
    assert gained["kvconnector_disk_write_bytes"] == 2 * POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_disk_failed_writes"] == 0, gained
    return computed


def reload_from_disk(llm: LLM, a: list[int]) -> Generation:
    """A again: its 4 blocks come from disk (and nothing from vLLM's cache or the pool)."""
    before, by_source = counters(llm), cached_by_source(llm)
    got = generate(llm, a)
    gained = counted(llm, before)
    assert got.num_cached_tokens == ON_DISK, got
    assert gained["prefix_cache_hits"] == 0, gained
    assert gained["kvconnector_disk_hit_tokens"] == ON_DISK, gained
    assert gained["kvconnector_disk_read_bytes"] == POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_load_bytes"] == POOL_SLOTS * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    now = cached_by_source(llm)
    assert now.get("disk", 0) - by_source.get("disk", 0) == ON_DISK, (by_source, now)
    return got


def test_a_shared_pool_too_small_for_the_prompt_reloads_it_from_disk_identically(
        engine: tuple[LLM, Path]) -> None:
    llm, disk = engine
    a, b = prompt_ids(41, 200), prompt_ids(42, 200)
    computed = a_on_disk_only(llm, a, b)
    again = reload_from_disk(llm, a)
    assert again.same_output(computed), (computed, again)

    # Control: the blocks on disk replaced by zeros under sound footers load, and the output
    # changes: what the reload used came from the slab.
    computed = a_on_disk_only(llm, a, b)
    assert rewrite_on_disk(disk, "zero") == 2 * POOL_SLOTS
    zeroed = reload_from_disk(llm, a)
    assert zeroed.logprobs != computed.logprobs, "zeroed blocks on disk changed no logprob"
    forget_everything(llm)
