"""Engines sharing one host pool (`"pool": NAME`) served by a real `kvconnector pool serve`
process: engine A (in this process) computes a prompt; engine B, started while A runs, in a
process of its own (its own mapping of the pool, its own connection; on the machine's second GPU
where it has two, else beside A), serves its first request for that prompt from the pool,
bit-identical to A's own prefix-cache reuse of it (which computes what a load leaves to
compute); B's own prompt is then served to A the same way; A is restarted (shut down, a new
engine, the same pool) and served from the pool. Ends with the negative control: one byte of
every slot flipped through the shared segment; each block carries the checksum its writer took,
so the load is refused, counted, and recomputed with output identical to A's first run (and the
recomputed blocks, stored again, load).

Prompts of 200 tokens: 6 full blocks (192 tokens) go through the pool, under either lookup rule
(a lookup stopping one token short of the prompt reaches (200 - 1) // 32 = 6 blocks too).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from engine_support import (
    BLOCK_SIZE,
    Generation,
    block_bytes,
    counted,
    counters,
    generate,
    on_gpu,
    running_llm,
    settle,
)
from tiny_llama import prompt_ids

from kvconnector.servers.pool import PoolProcess
from transfer.keys import Namespace
from transfer.pool import HostPool
from transfer.shared import protocol
from transfer.shared.client import PoolClient

pytestmark = pytest.mark.engine

FIRST = prompt_ids(31, 200)  # computed by engine A
SECOND = prompt_ids(32, 200)  # computed by engine B
STORED_TOKENS = 192
STORED_BLOCKS = STORED_TOKENS // BLOCK_SIZE
CHILD_TIMEOUT_S = 900.0  # an engine start and two requests on a busy 2-core machine


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    log = tmp_path_factory.mktemp("pool") / "pool.log"
    with PoolProcess(log, f"engine-{uuid.uuid4().hex[:8]}", capacity=str(64 * block_bytes()),
                     slot_bytes=str(block_bytes())) as process:
        yield process


def pool_stats(pool: PoolProcess) -> dict[str, Any]:
    """The daemon's counters, through a connection of its own (any namespace will do)."""
    client = PoolClient(pool.name, [Namespace("probe", "uint8", 1, "")], 1)
    try:
        return client.request(protocol.STATS)
    finally:
        client.close()


def expect_loaded(got: Generation, gained: dict[str, float]) -> None:
    """STORED_TOKENS came from the pool: vLLM's counters and the connector's (what they
    `gained` over the request) agree."""
    assert got.num_cached_tokens == STORED_TOKENS, got
    assert gained["prefix_cache_hits"] == 0, gained  # vLLM's own cache was emptied (or new)
    assert gained["external_prefix_cache_hits"] == STORED_TOKENS, gained
    assert gained["kvconnector_hit_tokens"] == STORED_TOKENS, gained
    assert gained["kvconnector_load_bytes"] == STORED_BLOCKS * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained


def corrupt_slots(pool: PoolProcess) -> int:
    """Flip one byte of every slot through the shared segment (the daemon's index still lists
    the blocks); returns the slots written."""
    segment = pool_stats(pool)["segment"]
    shm = HostPool.attach(segment, pinned=False)
    try:
        shm.slots[:, 7] ^= 0x5A
        return int(shm.slots.shape[0])
    finally:
        shm.close()


def second_gpu() -> str | None:
    """The GPU engine B runs on: the second where the machine has two (A runs on the first), so
    the pool is shared across GPUs; None: beside A (one GPU, or the CPU build)."""
    import torch

    if not on_gpu() or torch.cuda.device_count() < 2:
        return None
    from kvconnector.bench.shared_pool_gpus import visible_name

    return visible_name(1)  # in CUDA_VISIBLE_DEVICES' terms, as B sets it


def second_engine(model_dir: str, pool_name: str, gpu: str | None, conn: Connection) -> None:
    """Engine B, in its own process: FIRST (expected from the pool), then SECOND (computed and
    stored); answers (FIRST's generation, what its counters gained, SECOND's generation)."""
    if gpu is not None:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        with running_llm(model_dir, {"pool": pool_name}) as llm:
            before = counters(llm)
            got = generate(llm, FIRST)
            gained = counted(llm, before)
            own = generate(llm, SECOND)
            assert own.num_cached_tokens == 0, own
            own = generate(llm, SECOND)  # from vLLM's own prefix cache: what a load computes
            settle(llm)  # stored in the pool before this engine goes
        conn.send((got, gained, own))
    except BaseException as exc:
        conn.send(f"engine B failed: {type(exc).__name__}: {exc}")
        raise


def run_second_engine(model_dir: str, pool_name: str) -> tuple[Generation, dict[str, float],
                                                                Generation]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=second_engine, args=(model_dir, pool_name, second_gpu(), theirs))
    child.start()
    try:
        assert ours.poll(CHILD_TIMEOUT_S), "engine B did not answer"
        answer = ours.recv()
        assert not isinstance(answer, str), answer
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0, child.exitcode
        return answer
    finally:
        if child.is_alive():
            child.kill()
            child.join()


def test_engines_share_the_pool_and_a_restarted_engine_is_served_from_it(
        tiny_model: str, pool: PoolProcess) -> None:
    extra = {"pool": pool.name}
    with running_llm(tiny_model, extra) as first:
        computed = generate(first, FIRST)
        assert computed.num_cached_tokens == 0, computed
        # A load is compared with vLLM's own prefix-cache reuse (engine_checks.compute_then_reload
        # says why), a recompute with the first run
        reference = generate(first, FIRST)
        assert reference.num_cached_tokens == STORED_TOKENS, reference
        settle(first)  # stored in the pool; A's own prefix cache emptied
        assert pool_stats(pool)["stored"] == STORED_BLOCKS
        got, gained, own = run_second_engine(tiny_model, pool.name)  # while A runs
        assert got.same_output(reference), (reference, got)
        expect_loaded(got, gained)
        assert own.num_cached_tokens == STORED_TOKENS, own  # B's reuse of its own prompt
        # B's blocks, served to A
        before = counters(first)
        served = generate(first, SECOND)
        assert served.same_output(own), (own, served)
        expect_loaded(served, counted(first, before))
        settle(first)
    assert pool_stats(pool)["stored"] == 2 * STORED_BLOCKS
    with running_llm(tiny_model, extra) as restarted:
        before = counters(restarted)
        again = generate(restarted, FIRST)
        assert again.same_output(reference), (reference, again)
        expect_loaded(again, counted(restarted, before))
        settle(restarted)

        # Negative control: one byte of every slot flipped after its commit. Each block's
        # checksum no longer matches: the load is refused and vLLM recomputes, identically.
        assert corrupt_slots(pool) > 0
        before = counters(restarted)
        refused = generate(restarted, FIRST)
        gained = counted(restarted, before)
        assert refused.same_output(computed), (computed, refused)
        assert refused.num_cached_tokens == 0, refused  # recomputed
        assert gained["kvconnector_checksum_failures"] == 1, gained  # the request's one load
        assert gained["kvconnector_failed_loads"] == 1, gained
        assert gained["kvconnector_load_bytes"] == 0, gained  # the first block was bad
        # vLLM counts the tokens whose load then failed as external hits
        assert gained["external_prefix_cache_hits"] == STORED_TOKENS, gained
        settle(restarted)

        # The refused blocks left the pool; the recomputed ones were stored again and load
        before = counters(restarted)
        again = generate(restarted, FIRST)
        assert again.same_output(reference), (reference, again)
        expect_loaded(again, counted(restarted, before))
