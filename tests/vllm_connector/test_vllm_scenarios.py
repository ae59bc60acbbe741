"""CrossLayerOffloadConnector inside vLLM 0.32 and 0.33, the acceptance scenarios: its Scheduler
and AsyncScheduler, its cache allocation and worker-side driver, with a fake model forward
(vllm_connector/vllm_harness.py).

Every scenario runs in each of VARIANTS: block-major (the connector's own BLNHC request) and the
per-layer fallback (VLLM_KV_CACHE_LAYOUT=LBNHC), at TP 1 and TP 2 (two workers merged by vLLM's
KVOutputAggregator), each under Scheduler and AsyncScheduler; with two pipeline stages (PP 2 at
TP 1 and 2, Scheduler: each stage's workers hold and move their own layers; earlier stages
return only connector output, merged at the last stage's rank as vLLM's executor does); with
speculative decoding (vLLM's n-gram config, the harness's drafts: 3 a step, some rejected, whose
KV stays in the cache until a later step rewrites it; under AsyncScheduler the workers draft);
with MLA caches (vLLM's MLA specs, one latent head a rank, TRITON_MLA the configured backend);
on vLLM 0.33 in a speculator's step order (transfer results taken before the stores, a
drafter layer written in between); and with vLLM's hybrid manager on, full attention with a
sliding window group or an align-mode state group (VARIANTS: vllm_variants.py; the scenarios
of one group type: test_vllm_hybrid_scenarios.py). When a request (re)starts with computed
tokens, its first forward compares every byte of them with what the fake model writes there
(vllm_connector/vllm_fake_worker.py); the GPU caches are poisoned before loads.
"""

from __future__ import annotations

import random
import threading

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm_harness as h  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_fake_worker import chain, kv_rows  # noqa: E402
from vllm_harness import (  # noqa: E402
    make_engine,
    make_prompt,
    poison_gpu,
    run_to_completion,
    stored_tokens,
    total_stats,
)
from vllm_variants import VARIANTS, skip_one_group_pool, use_variant  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
V = h.Variant

@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> h.Variant:
    return use_variant(request.param, monkeypatch)


# -- the acceptance scenarios, in every variant ------------------------------------------------
def test_identical_request_loads_every_stored_byte(model_dir: str, variant: h.Variant) -> None:
    engine = make_engine(model_dir, variant)
    prompt = make_prompt(1, 4 * BS + 6)
    run_to_completion(engine, {"a": (prompt, 3)})
    assert stored_tokens(engine, prompt) == 4 * BS  # every full block, the partial one not
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=3)
    engine.step()
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    checked = [w.prefix_checks for w in engine.workers]
    run_to_completion(engine, {"b": (prompt, 3)})
    for worker, before in zip(engine.workers, checked, strict=True):
        assert worker.starts["b"] == [4 * BS]  # resumed after the load with 64 tokens computed
        assert worker.prefix_checks - before == 4 * BS  # every loaded byte compared
    stats = total_stats(engine)
    block_bytes = sum(worker.connector._worker.block_bytes for worker in engine.workers)
    assert (stats.data["hit_tokens"], stats.data["failed_loads"]) == (4 * BS, 0)
    # every rank's bytes of 4 blocks of each group (a sliding window group: its window's)
    assert stats.data["load_bytes"] == h.reload_blocks(engine, 4) * block_bytes
    # stored in one step, none freed yet; a state group's prefill step keeps one block, at
    # its end (the others are its null block)
    stored = sum(1 if group.state else 4 for group in engine.connector._scheduler.groups)
    assert stats.data["store_bytes"] == stored * block_bytes


def test_request_sharing_a_prefix_gets_exactly_that_prefix(model_dir: str,
                                                           variant: h.Variant) -> None:
    engine = make_engine(model_dir, variant)
    prompt = make_prompt(2, 5 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    shares_two = prompt[:2 * BS + 5] + make_prompt(3, 2 * BS)
    shares_none = [prompt[0] + 1] + prompt[1:]
    run_to_completion(engine, {"c": (shares_two, 2), "d": (shares_none, 2)})
    # A state group keeps the states where a's steps ended (64 tokens, then decode), none after
    # 32: vLLM's own prefix cache could not resume c there either.
    for worker in engine.workers:
        assert worker.starts["c"] == [0 if variant.state else 2 * BS]
        assert worker.starts["d"] == [0]


def test_decoded_blocks_are_stored_and_a_follow_up_turn_loads_them_bit_exact(
        model_dir: str, variant: h.Variant) -> None:
    # A chat's next turn starts with the previous turn's prompt and answer. Every full block is
    # stored: those of each prefill chunk, and those filled while decoding, each once its hash
    # exists (under async scheduling and with drafts the scheduled tokens run ahead of the
    # tokens with hashes: vLLM #36052 lost such blocks).
    engine = make_engine(model_dir, variant, max_num_batched_tokens=120)
    prompt = make_prompt(15, 9 * BS + 5)  # two prefill chunks: block 7 is split between them
    run_to_completion(engine, {"a": (prompt, 4 * BS + 3)})
    turn = prompt + engine.finished["a"]  # 13 full blocks and 8 tokens
    assert stored_tokens(engine, turn) == 13 * BS
    if variant.drafts:  # drafts were scheduled, and some of their KV was that of rejected ones
        drafted, accepted = engine.spec_counts
        assert 0 < accepted < drafted
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    checked = [w.prefix_checks for w in engine.workers]
    run_to_completion(engine, {"b": (turn + make_prompt(16, 5), 3)})
    for worker, before in zip(engine.workers, checked, strict=True):
        assert worker.starts["b"] == [13 * BS]
        assert worker.prefix_checks - before == 13 * BS  # every loaded byte compared


def test_a_request_ending_on_a_block_boundary_never_stores_its_last_block(
        model_dir: str, variant: h.Variant) -> None:
    # The last sampled token's KV is never computed: its slot holds stale bytes, or with drafts
    # the KV of the draft rejected there, which looks valid. Storing that block under the hash
    # of its tokens poisons every later request that shares them (vLLM #54193). Every draft is
    # rejected here, so the slot always holds a rejected draft's KV.
    engine = make_engine(model_dir, variant, draft_acceptance=(0,))
    prompt = make_prompt(17, 3 * BS + 6)
    engine.add("a", prompt, max_tokens=BS - 6)
    engine.run(until=lambda: "a" in engine.finished)
    if variant.drafts:
        worker, last = engine.workers[0], 4 * BS - 1
        truth = worker.states["a"].sequence  # the true continuation
        rejected = chain(truth.hash_at(last - 1), truth.drafts(last, 1, accepted=0)[0])
        held = worker.slot("a", last)
        assert torch.equal(held, kv_rows(torch.tensor([rejected]), 0, 0, held.numel())[0])
    run_to_completion(engine, {"a": (prompt, BS - 6)})
    turn = prompt + engine.finished["a"]
    assert len(turn) == 4 * BS
    assert stored_tokens(engine, turn) == 3 * BS
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {"b": (turn + make_prompt(18, 5), 2)})  # the check reads 4 blocks
    for worker in engine.workers:
        assert worker.starts["b"] == [3 * BS]


def test_requests_arriving_together_load_a_shared_prefix_at_once(
        model_dir: str, variant: h.Variant) -> None:
    # Neither waits for the other's load (vLLM #44294 serialised such requests behind one load):
    # both are waiting for their own loads of the same blocks after the first step.
    engine = make_engine(model_dir, variant)
    prefix = make_prompt(23, 5 * BS)
    run_to_completion(engine, {"a": (prefix + [7], 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    requests = {"b": (prefix + make_prompt(24, 9), 2), "c": (prefix + make_prompt(25, 3), 2)}
    for req_id, (prompt, max_tokens) in requests.items():
        engine.add(req_id, prompt, max_tokens)
    engine.step()
    assert all(engine.scheduler.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
               for r in requests)
    run_to_completion(engine, requests)
    for worker in engine.workers:
        assert worker.starts["b"] == worker.starts["c"] == [5 * BS]  # both loaded, compared
    assert total_stats(engine).data["hit_tokens"] == 2 * 5 * BS


def test_a_block_aligned_prompt_recomputes_its_last_block(model_dir: str) -> None:
    # As vLLM's own prefix cache: the block holding the last token is never a hit, so vLLM
    # computes it prefill-shaped (a full hit left it one token, decode-shaped, whose logprobs
    # differed in the real engine), although it is stored.
    engine = make_engine(model_dir, V("BLNHC"))
    prompt = make_prompt(4, 3 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert stored_tokens(engine, prompt) == 3 * BS
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=2)
    run_to_completion(engine, {"b": (prompt, 2)})
    assert engine.workers[0].starts["b"] == [2 * BS]
    assert total_stats(engine).data["hit_tokens"] == 2 * BS


def test_failed_load_is_recomputed(model_dir: str, variant: h.Variant) -> None:
    gates = [h.HeldGate() for _ in range(variant.ranks)]
    engine = make_engine(model_dir, variant, gates=gates)
    prompt = make_prompt(5, 3 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    load_job = engine.connector._scheduler._next_job_id  # the next job is b's load
    for gate in gates:
        gate.fail.add(load_job)
    engine.add("b", prompt, max_tokens=2)
    run_to_completion(engine, {"b": (prompt, 2)})
    assert all(gate.seen.count(load_job) == 1 for gate in gates)  # it ran, and failed, everywhere
    for worker in engine.workers:
        assert worker.starts["b"] == [0]  # recomputed from scratch, never read poison
    stats = total_stats(engine)
    assert (stats.data["failed_loads"], stats.data["hit_tokens"]) == (1, 3 * BS)
    assert stored_tokens(engine, prompt) == 3 * BS  # the recomputed blocks are stored again


def test_failed_load_fails_the_request_under_the_fail_policy(model_dir: str,
                                                             variant: h.Variant) -> None:
    gates = [h.HeldGate() for _ in range(variant.ranks)]
    engine = make_engine(model_dir, variant, gates=gates, kv_load_failure_policy="fail")
    prompt = make_prompt(13, 2 * BS + 3)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    for gate in gates:
        gate.fail.add(engine.connector._scheduler._next_job_id)
    engine.add("b", prompt, max_tokens=2)
    engine.run()
    assert engine.finished["b"] == []  # finished with an error, never served poisoned KV
    assert all("b" not in w.starts for w in engine.workers)
    engine.assert_no_leaks()


def test_reset_connector_cache_empties_the_tier(model_dir: str) -> None:
    engine = make_engine(model_dir, V("BLNHC", async_scheduling=True))
    prompt = make_prompt(14, 3 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    assert stored_tokens(engine, prompt) == 3 * BS
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert stored_tokens(engine, prompt) == 0
    run_to_completion(engine, {"b": (prompt, 2)})
    assert engine.workers[0].starts["b"] == [0]
    assert stored_tokens(engine, prompt) == 3 * BS


def test_finished_request_keeps_its_blocks_while_its_store_is_in_flight(
        model_dir: str, variant: h.Variant) -> None:
    skip_one_group_pool(variant)
    # a's store held
    gates = [h.HeldGate(hold={0: threading.Event()}) for _ in range(variant.ranks)]
    engine = make_engine(model_dir, variant, gates=gates, num_gpu_blocks=10)
    prompt, other = make_prompt(6, 4 * BS + 6), make_prompt(7, 5 * BS + 10)
    engine.drain_when_idle = False
    engine.add("a", prompt, max_tokens=3)
    engine.step()
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    assert len(a_blocks) == 5
    engine.run(until=lambda: "a" in engine.finished)
    engine.add("e", other, max_tokens=2)  # needs 6 of the 9 blocks: only 4 are free
    for _ in range(6):
        engine.step()
    assert "a" in engine.scheduler.requests  # finished, blocks held for the store
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt > 0 for b in a_blocks)
    assert not any(a_blocks & set(w.states["e"].block_ids[0])
                   for w in engine.workers if "e" in w.states)
    assert "e" not in engine.finished
    for gate in gates:
        gate.hold[0].set()
    engine.drain_when_idle = True
    run_to_completion(engine, {"a": (prompt, 3), "e": (other, 2)})
    # The store read a's bytes, not e's: load them into a poisoned cache and compare.
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    engine.add("b", prompt, max_tokens=3)
    run_to_completion(engine, {"b": (prompt, 3)})
    assert all(w.starts["b"] == [4 * BS] for w in engine.workers)


def test_preempted_request_store_finishes_before_its_blocks_are_rewritten(
        model_dir: str, variant: h.Variant) -> None:
    skip_one_group_pool(variant)
    # e and a fill the pool; when e needs one more block, vLLM preempts a (the newest) and hands
    # its blocks to e while a's store (job 1) is held in flight on the copy thread. The flush
    # before that step's forward releases it and must wait for it.
    gates = [h.HeldGate(hold={1: threading.Event()}) for _ in range(variant.ranks)]
    engine = make_engine(model_dir, variant, gates=gates, num_gpu_blocks=10)
    flushes: list[tuple[int, bool]] = []  # (rank, store 1 still in flight) per flush of it
    for worker in engine.workers:
        core = worker.connector._worker
        original = core.flush

        def flush(step, core=core, original=original, rank=worker.rank):
            if 1 in step.flush:
                flushes.append((rank, not core.engine.wait([1], timeout=0)))
                gates[rank].hold[1].set()  # the copy may run now; flush must wait for it
            original(step)
            if 1 in step.flush:
                assert core.engine.wait([1], timeout=0), "flush returned before the store ended"

        core.flush = flush
    e, a = make_prompt(8, 4 * BS - 4), make_prompt(9, 4 * BS + 6)
    engine.drain_when_idle = False  # the held copy would block a quiet step's drain
    engine.add("e", e, max_tokens=30)
    engine.add("a", a, max_tokens=30)
    engine.step()
    jobs = engine.connector._scheduler._jobs
    assert (jobs[1].req_id, jobs[1].is_store, len(jobs[1].keys)) == ("a", True, 4)
    a_blocks = set(engine.scheduler.kv_cache_manager.get_block_ids("a")[0])
    engine.run(until=lambda: bool(flushes), max_steps=100)
    engine.drain_when_idle = True
    run_to_completion(engine, {"e": (e, 30), "a": (a, 30)})
    assert engine.preemptions == 1
    assert flushes == [(w.rank, True) for w in engine.workers]
    for worker in engine.workers:
        assert a_blocks & worker.block_history["e"], "e never got any of a's freed blocks"
        # a resumed by loading what the held store copied: a's bytes, not e's (compared).
        assert worker.starts["a"] == [0, 4 * BS]


def test_aborted_requests_store_only_what_was_computed_and_leak_nothing(
        model_dir: str, variant: h.Variant) -> None:
    engine = make_engine(model_dir, variant)
    engine.add("queued", make_prompt(19, 3 * BS), max_tokens=2)
    engine.abort("queued")  # never scheduled: no blocks, nothing to store (vLLM #49118)
    assert stored_tokens(engine, make_prompt(19, 3 * BS)) == 0
    prompt = make_prompt(20, 12 * BS)  # two prefill chunks: at most 128 tokens a step
    engine.add("p", prompt, max_tokens=2)
    engine.step()
    computed = engine.scheduler.requests["p"].num_computed_tokens
    assert computed == 8 * BS  # the first chunk
    engine.abort("p")  # mid-prefill
    engine.run()
    engine.assert_no_leaks()
    assert stored_tokens(engine, prompt) == computed
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {"b": (prompt, 2)})
    for worker in engine.workers:
        assert worker.starts["b"] == [computed]  # loaded, every byte compared


def test_a_request_aborted_while_its_load_is_in_flight_keeps_its_blocks_until_the_load_ends(
        model_dir: str, variant: h.Variant) -> None:
    # The copy still writes into the aborted request's blocks: handing them to another request
    # before it ends would let it overwrite that request's KV. vLLM holds them until the
    # connector reports the load; the connector must report it when the copy ends, not before
    # (and not never: that leaks the blocks and stalls c).
    gates = [h.HeldGate() for _ in range(variant.ranks)]
    # hybrid: b's load takes 4 full + 3 sliding blocks, c's prefill 6 + 6 of the 15
    engine = make_engine(model_dir, variant, gates=gates,
                         num_gpu_blocks=16 if variant.window else 10)
    prompt = make_prompt(21, 4 * BS + 6)
    run_to_completion(engine, {"a": (prompt, 3)})
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    load, release = engine.connector._scheduler._next_job_id, threading.Event()
    for gate in gates:
        gate.hold[load] = release
    engine.drain_when_idle = False  # the held copy would block a quiet step's drain
    engine.add("b", prompt, max_tokens=3)
    engine.step()
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(engine.scheduler.kv_cache_manager.get_block_ids("b")[0]) == 4  # being loaded
    assert all(gate.reached(load) for gate in gates)  # the copy is running, held
    other = make_prompt(22, 5 * BS + 10)  # needs 6 of the 9 blocks: only 5 are free (hybrid:
    # 6 + 6 of the 15, 8 free)
    h.abort_while_loading(engine, "b", ("c", other), steps=6)
    release.set()
    engine.drain_when_idle = True
    run_to_completion(engine, {"c": (other, 2)})  # then c gets the blocks; no leaks
    assert all(w.starts["c"] == [0] for w in engine.workers)


def test_small_pool_many_requests_leaks_nothing(model_dir: str, variant: h.Variant) -> None:
    engine = make_engine(model_dir, variant, cpu_slots=12, num_gpu_blocks=16, max_num_seqs=6)
    rng = random.Random(10)
    families = [make_prompt(20 + i, 3 * BS) for i in range(4)]
    requests = {}
    for i in range(16):
        prompt = families[i % 4][:rng.randrange(BS + 1, 3 * BS)] + make_prompt(40 + i,
                                                                               rng.randrange(30))
        requests[f"r{i}"] = (prompt, rng.randrange(4, 30))
    run_to_completion(engine, requests)
    assert engine.preemptions > 0
    # Second wave, GPU prefix cache dropped: the CPU tier serves what it kept.
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    run_to_completion(engine, {f"again-{k}": v for k, v in requests.items()})
    stats = total_stats(engine)
    assert stats.data["hit_tokens"] > 0 and stats.data["evictions"] > 0
    assert stats.data["failed_loads"] == stats.data["failed_stores"] == 0
    assert sum(len(w.starts) for w in engine.workers) == len(engine.workers) * 32
