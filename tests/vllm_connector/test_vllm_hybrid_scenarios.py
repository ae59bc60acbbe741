"""CrossLayerOffloadConnector inside vLLM 0.32 and 0.33 with its hybrid manager on, the scenarios
of a group type (vllm_variants.py's hybrid and state variants; the harness as in
test_vllm_scenarios.py): a store of sliding window blocks ends before vLLM frees them, and a
state group resumes a shared prefix only where a state was kept.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm_harness import (  # noqa: E402
    make_engine,
    make_prompt,
    poison_gpu,
    run_to_completion,
    total_stats,
)
from vllm_variants import VARIANTS, use_variant  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE

@pytest.fixture  # always parametrized indirectly, by group type
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> h.Variant:
    return use_variant(request.param, monkeypatch)


@pytest.mark.parametrize("variant", [p for p in VARIANTS if "hybrid" in p.id], indirect=True)
def test_a_store_of_sliding_blocks_ends_before_vllm_frees_them(model_dir: str,
                                                                variant: h.Variant) -> None:
    # a's prompt store (job 0) is held on the copy thread; once a has computed past the window
    # of its first sliding block, vLLM frees that block and may hand it out in the same step:
    # that step's flush releases the held copy and must wait for it.
    gates = [h.HeldGate(hold={0: threading.Event()}) for _ in range(variant.ranks)]
    engine = make_engine(model_dir, variant, gates=gates)
    flushes: list[tuple[int, bool]] = []  # (rank, store 0 still in flight) per flush of it
    for worker in engine.workers:
        core = worker.connector._worker
        original = core.flush

        def flush(step, core=core, original=original, rank=worker.rank):
            if 0 in step.flush:
                flushes.append((rank, not core.engine.wait([0], timeout=0)))
                gates[rank].hold[0].set()  # the copy may run now; flush must wait for it
            original(step)
            if 0 in step.flush:
                assert core.engine.wait([0], timeout=0), "flush returned before the store ended"

        core.flush = flush
    prompt = make_prompt(31, 4 * BS + 6)
    engine.drain_when_idle = False  # the held copy would block a quiet step's drain
    engine.add("a", prompt, max_tokens=4)
    engine.step()
    job = engine.connector._scheduler._jobs[0]
    assert (job.req_id, job.is_store, len(job.keys)) == ("a", True, 8)  # 4 blocks, 2 groups
    engine.run(until=lambda: bool(flushes), max_steps=100)
    engine.drain_when_idle = True
    run_to_completion(engine, {"a": (prompt, 4)})
    assert flushes == [(w.rank, True) for w in engine.workers]
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {"b": (prompt, 4)})
    assert all(w.starts["b"] == [4 * BS] for w in engine.workers)  # the held copy's bytes


@pytest.mark.parametrize("variant", [p for p in VARIANTS if "state" in p.id], indirect=True)
def test_a_state_group_resumes_a_shared_prefix_where_a_state_was_kept(
        model_dir: str, variant: h.Variant) -> None:
    # a's prefill keeps the state after 64 tokens (vLLM's align mode ends its first chunk on
    # the last block boundary before its last token) and decode the ones after 80 and 96; c
    # shares a's first 64 + 1 tokens, so it resumes at 64 from the state there and the
    # attention blocks before it, each compared in its first forward; the state after 32,
    # never kept, cannot serve d, which shares 32 + 5; e, a's next turn, resumes at 96.
    engine = make_engine(model_dir, variant)
    prompt = make_prompt(41, 4 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2 * BS)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    c = prompt[:4 * BS + 1] + make_prompt(42, 2 * BS)
    d = prompt[:2 * BS + 5] + make_prompt(43, 2 * BS)
    turn = prompt + engine.finished["a"]  # 6 blocks and 3 tokens
    run_to_completion(engine, {"c": (c, 2), "d": (d, 2), "e": (turn, 2)})
    for worker in engine.workers:
        assert worker.starts["c"] == [4 * BS]
        assert worker.starts["d"] == [0]
        assert worker.starts["e"] == [6 * BS]
    stats = total_stats(engine)
    block_bytes = sum(worker.connector._worker.block_bytes for worker in engine.workers)
    assert stats.data["hit_tokens"] == 10 * BS
    assert stats.data["load_bytes"] == (4 + 1 + 6 + 1) * block_bytes  # attention + a state each
