"""Two real engines sharing one `kvconnector store serve` process (a child process on loopback):
the second engine's first request is served from the store, bit-identical to the first engine's;
then the store (every worker process of it) is killed between a lookup and its load, and vLLM
recomputes (policy "recompute"; the store is back, empty, its workers on new ports, for the new
lookup): identical output, the failure counted, nothing corrupt left in any tier.

Both engines are in-process TP 1 engines of the same configuration, run one after the other:
their outputs are compared exactly, as within one engine.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from engine_checks import expect_corruption_seen, reload
from engine_support import (
    Generation,
    block_bytes,
    counted,
    counters,
    forget_everything,
    generate,
    record_finished_hashes,
    running_llm,
    scheduler_connector,
    settle,
)
from process_memory import flip_in_process
from tiny_llama import prompt_ids

if TYPE_CHECKING:
    from vllm import LLM

    from kvconnector.servers.store import StoreProcess

pytestmark = pytest.mark.engine

SHARED = prompt_ids(21, 200)  # 6 full blocks: 192 tokens go through the store
LOST = prompt_ids(22, 200)
DAMAGED = prompt_ids(23, 200)
STORED_TOKENS = 192
# Generous for a loopback round trip on a busy machine (a late lookup quietly answers "not in the
# store", a late get fails the load); the killed store's get waits it out in full.
REMOTE_DEADLINE_S = 30.0


def _extra(url: str) -> dict[str, Any]:
    return {"cpu_bytes": 64 * block_bytes(), "remote_url": url, "remote_security": "none",
            "remote_lookup_deadline_s": REMOTE_DEADLINE_S, "remote_timeout_s": REMOTE_DEADLINE_S}


def _store_workers(store: StoreProcess) -> list[int]:
    """The store's worker processes (a store runs a process per worker: by default half the
    cores, so 8 on 16 and 1 on 2)."""
    parent = store.process.pid
    workers = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError):
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                workers.append(int(entry))
    return workers


def _kill_whole_store(store: StoreProcess) -> None:
    """SIGKILL the store and its worker processes at once: SIGKILL to the first alone leaves the
    others serving until they notice it gone, and a get sent meanwhile may bring back the blocks
    they hold (checksummed, so good ones, and vLLM recomputes the request whole anyway)."""
    for pid in _store_workers(store):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    store.kill()


@pytest.fixture(scope="module")
def first_engine_outputs(tiny_model: str, store: StoreProcess) -> dict[str, Generation]:
    """The first engine computes both prompts (stored in its CPU tier and put to the store),
    serves each again from vLLM's own prefix cache ("NAME reused": what a load is compared with,
    engine_checks.compute_then_reload says why), waits for every put, and shuts down."""
    with running_llm(tiny_model, _extra(store.url)) as llm:
        outputs = {"shared": generate(llm, SHARED), "lost": generate(llm, LOST)}
        assert all(out.num_cached_tokens == 0 for out in outputs.values()), outputs
        for name, prompt in (("shared", SHARED), ("lost", LOST)):
            outputs[f"{name} reused"] = generate(llm, prompt)
            assert outputs[f"{name} reused"].num_cached_tokens == STORED_TOKENS, outputs
        settle(llm)
    return outputs


@pytest.fixture(scope="module")
def second_engine(tiny_model: str, store: StoreProcess,
                  first_engine_outputs: dict[str, Generation]) -> Iterator[LLM]:
    with running_llm(tiny_model, _extra(store.url)) as llm:
        yield llm


def test_the_second_engine_serves_its_first_request_from_the_store(
        second_engine: LLM, first_engine_outputs: dict[str, Generation]) -> None:
    llm, reference = second_engine, first_engine_outputs["shared reused"]
    before = counters(llm)
    got = generate(llm, SHARED)
    gained = counted(llm, before)
    assert got.same_output(reference), (reference, got)
    assert got.num_cached_tokens == STORED_TOKENS, got
    assert gained["external_prefix_cache_hits"] == STORED_TOKENS, gained
    assert gained["kvconnector_remote_hit_tokens"] == STORED_TOKENS, gained
    assert gained["kvconnector_load_bytes"] == STORED_TOKENS // 32 * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    # a good fetch stays in the CPU tier: zero it there, the reload must change
    expect_corruption_seen(llm, SHARED, reference, STORED_TOKENS)


def test_the_store_killed_between_lookup_and_load_recomputes_identically(
        second_engine: LLM, store: StoreProcess, first_engine_outputs: dict[str, Generation],
        monkeypatch: pytest.MonkeyPatch) -> None:
    llm, reference = second_engine, first_engine_outputs["lost"]
    forget_everything(llm)  # this engine's CPU tier is empty: the blocks are in the store only
    connector = scheduler_connector(llm)
    allocated, looked_up = connector.update_state_after_alloc, connector.get_num_new_matched_tokens
    killed: list[int] = []

    def kill_then_allocate(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens and not killed:  # the lookup found them; no get has started
            _kill_whole_store(store)
            killed.append(num_external_tokens)
        allocated(request, blocks, num_external_tokens)

    def restart_then_look_up(request: Any, num_computed_tokens: int) -> Any:
        # After the failed load vLLM looks the request up again (the failed keys are refused,
        # answered at once): the store is back, empty, its workers on new ports, for the puts
        # of the recomputed blocks that follow
        if killed and store.process.poll() is not None:
            store.start()
        return looked_up(request, num_computed_tokens)

    monkeypatch.setattr(connector, "update_state_after_alloc", kill_then_allocate)
    monkeypatch.setattr(connector, "get_num_new_matched_tokens", restart_then_look_up)
    before = counters(llm)
    got = generate(llm, LOST)
    gained = counted(llm, before)
    assert killed == [STORED_TOKENS]
    assert got.same_output(reference), (reference, got)
    # vLLM reports the count of the request's first schedule: 0 where the failed load was handled
    # before it (CPU), the failed tokens where the GPU engine's async scheduler had counted them.
    # No byte was loaded (below), and the output is identical: recomputed.
    assert got.num_cached_tokens in (0, STORED_TOKENS), got
    assert gained["kvconnector_failed_loads"] == 1, gained  # the request's one load job
    # every worker died before the get: nothing to load (the get waits out its deadline)
    assert gained["kvconnector_load_bytes"] == 0, gained
    # the new lookup answered from the refused keys, without a round trip: no miss for a
    # failure (nor a store counted down for 10 lookup deadlines)
    assert gained["kvconnector_remote_lookup_failures"] == 0, gained
    assert gained["kvconnector_hit_tokens"] == STORED_TOKENS, gained  # the first lookup only
    assert gained["kvconnector_miss_tokens"] == STORED_TOKENS, gained  # the one after the failure
    # vLLM counts the tokens whose load then failed as external hits: only the two above tell
    assert gained["external_prefix_cache_hits"] == STORED_TOKENS, gained
    assert store.process.poll() is None  # restarted for the new lookup
    monkeypatch.undo()

    # nothing corrupt was kept: the recomputed blocks reload from the CPU tier identically
    reused = first_engine_outputs["lost reused"]
    again, gained = reload(llm, LOST, reused)
    assert again.num_cached_tokens == STORED_TOKENS, again
    assert gained["kvconnector_load_bytes"] == STORED_TOKENS // 32 * block_bytes(), gained
    expect_corruption_seen(llm, LOST, reused, STORED_TOKENS)


def _slot_bytes(worker: Any, slot: int) -> bytes:  # runs on each worker (collective_rpc)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.pool.slots[slot].numpy().tobytes()


def test_a_block_damaged_in_the_store_is_recomputed_once_then_stored_anew(
        second_engine: LLM, store: StoreProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bit flipped in the store's RAM in the third of a prompt's six blocks: the load that
    fetches it fails, the request loads the two blocks before it and computes the rest (its
    keys refused from then on, and the store drops the damaged block), output identical; the
    recomputed block is put anew, and the prompt then loads whole from the store."""
    llm = second_engine
    connector = scheduler_connector(llm)
    seen = record_finished_hashes(llm, monkeypatch)
    forget_everything(llm)
    first = generate(llm, DAMAGED)
    assert first.num_cached_tokens == 0, first
    settle(llm)  # stored here and put to the store
    core = connector._core()
    (key,) = core._keys(core.groups[0], [seen[0][2]])
    (block,) = set(llm.collective_rpc(_slot_bytes, args=(core.index.slot_of(key),)))
    changed = 0
    for pid in [store.process.pid, *_store_workers(store)]:
        try:
            changed += flip_in_process(pid, block)
        except PermissionError as exc:
            pytest.skip(f"cannot write the store process's memory here: {exc}")
    assert changed >= 1, "the block's bytes are not in the store"
    forget_everything(llm)  # the blocks are in the store only
    before = counters(llm)
    got = generate(llm, DAMAGED)
    gained = counted(llm, before)
    assert got.same_output(first), (first, got)
    assert gained["kvconnector_failed_loads"] == 1, gained  # once: never fetched again
    # the two blocks before it: the failed load's good head, then the load after it
    assert gained["kvconnector_load_bytes"] == 2 * 2 * block_bytes(), gained
    assert gained["kvconnector_hit_tokens"] == STORED_TOKENS + 2 * STORED_TOKENS // 6, gained
    monkeypatch.undo()
    # Put anew (the store dropped the damaged one): from the store whole, as vLLM's own cache
    # serves it. Negative control: the same load from zeroed slots changes the output.
    reused = generate(llm, DAMAGED)  # from vLLM's own prefix cache
    assert reused.num_cached_tokens == STORED_TOKENS, reused
    forget_everything(llm)
    again, gained = reload(llm, DAMAGED, reused)
    assert again.num_cached_tokens == STORED_TOKENS, again
    assert gained["kvconnector_remote_hit_tokens"] == STORED_TOKENS, gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    expect_corruption_seen(llm, DAMAGED, reused, STORED_TOKENS)
