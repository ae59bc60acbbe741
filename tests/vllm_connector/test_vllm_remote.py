"""The remote store as the connector's second tier, through vLLM's real Scheduler and
AsyncScheduler (0.32 and 0.33; vllm_connector/vllm_harness.py), against a real store server process.

Two engines (two scheduler/worker sets) sharing one store behave as engines sharing a prefix,
bit-exact (the harness compares every byte a request starts from); a store killed between lookup
and load makes the load fail and vLLM recompute; a store down at lookup costs at most the
lookup deadline: requests are served from the CPU tier or recomputed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from process_memory import flip_in_process  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import make_prompt, on_planned_load, poison_gpu, run_to_completion  # noqa: E402

from kvconnector.servers.store import StoreProcess  # noqa: E402
from kvconnector.vllm.connector import (  # noqa: E402
    ConnectorOptions,
    CrossLayerOffloadConnector,
)
from kvconnector.vllm.stats import OffloadStats  # noqa: E402
from transfer.remote.store.client import StoreClient  # noqa: E402
from transfer.remote.store.security import Security  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
MAX_STEPS = h.REMOTE_MAX_STEPS
# A live store: only its answer ends a lookup or a get, so a busy 2-core runner cannot turn a hit
# into a miss. A dead, stopped or refusing store: short bounds, which the tests wait out.
LIVE_DEADLINE_S = LIVE_TIMEOUT_S = 30.0
DOWN_DEADLINE_S, DOWN_TIMEOUT_S = 0.2, 1.0
DOWN = {"remote_lookup_deadline_s": DOWN_DEADLINE_S, "remote_timeout_s": DOWN_TIMEOUT_S}
SCHEDULERS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity="64MiB") as process:
        yield process


def make_engine(model_dir: str, url: str, async_scheduling: bool = False, tp: int = 1,
                cpu_slots: int = 64, pp: int = 1, num_gpu_blocks: int = 64, mla: bool = False,
                **extra: object) -> h.Engine:
    config = {"cpu_bytes": cpu_slots * h.block_bytes(tp, mla), "remote_url": url,
              "remote_lookup_deadline_s": LIVE_DEADLINE_S, "remote_timeout_s": LIVE_TIMEOUT_S,
              **extra}
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  num_gpu_blocks=num_gpu_blocks, mla=mla, extra_config=config))


def store_stats(url: str) -> dict:
    with StoreClient(url, Security.none()) as client:
        return client.stats()


def remote_failures(engine: h.Engine) -> int:
    return sum(w.connector._worker.failures["remote"] for w in engine.workers)


@pytest.mark.parametrize(("async_scheduling", "tp", "pp", "mla"), [
    pytest.param(False, 1, 1, False, id="Scheduler-tp1"),
    pytest.param(True, 1, 1, False, id="AsyncScheduler-tp1"),
    pytest.param(False, 2, 1, False, id="Scheduler-tp2"),
    pytest.param(True, 2, 1, False, id="AsyncScheduler-tp2"),
    # Each stage's ranks put their own layers under keys of their own (the stage in the salt).
    pytest.param(False, 1, 2, False, id="Scheduler-pp2"),
    # MLA's latent is the same on every TP rank: one copy in the store, read by every rank.
    pytest.param(True, 2, 1, True, id="AsyncScheduler-tp2-mla"),
    pytest.param(False, 2, 2, True, id="Scheduler-tp2-pp2-mla")])
def test_two_engines_sharing_a_store_share_a_prefix_bit_exact(
        model_dir: str, store: StoreProcess, async_scheduling: bool, tp: int, pp: int,
        mla: bool) -> None:
    first = make_engine(model_dir, store.url, async_scheduling, tp, pp=pp, mla=mla)
    prompt = make_prompt(1, 4 * BS + 6)
    run_to_completion(first, {"a": (prompt, 3)})
    stats = store_stats(store.url)
    # Write-through: every full block of every rank, once (of every stage under MLA, and
    # nothing put twice); the stages' layers add up to a block.
    copies = 1 if mla else tp
    block_bytes = h.block_bytes(tp, mla)
    assert (stats["blocks"], stats["put_bytes"], stats["put_existing"]) == \
        (4 * copies * pp, 4 * copies * block_bytes, 0)

    second = make_engine(model_dir, store.url, async_scheduling, tp, pp=pp, mla=mla)
    poison_gpu(second)
    request = second.add("b", prompt, max_tokens=3)
    second.run(until=lambda: second.scheduler.requests["b"].status
               == RequestStatus.WAITING_FOR_REMOTE_KVS, max_steps=MAX_STEPS)
    # The lookup ran while vLLM was told to ask again; the plan says where the hits come from.
    assert second.connector.get_external_cache_hit_sources(request, 4 * BS) == \
        {"external_unspecified": 4 * BS}
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [4 * BS]  # resumed after the remote load
        assert worker.prefix_checks == 4 * BS  # every fetched byte compared
    stats = store_stats(store.url)
    assert (stats["get_blocks"], stats["get_bytes"]) == (4 * tp * pp, 4 * tp * block_bytes)
    assert remote_failures(second) == 0
    # The fetched blocks now live in the second engine's CPU tier too: a third request sharing
    # two blocks is served from the host pool without asking the store for them.
    assert second.scheduler.reset_prefix_cache()
    poison_gpu(second)
    shares_two = prompt[:2 * BS + 3] + make_prompt(2, BS)
    request = second.add("c", shares_two, max_tokens=2)
    second.run(until=lambda: second.scheduler.requests["c"].status
               == RequestStatus.WAITING_FOR_REMOTE_KVS, max_steps=MAX_STEPS)
    assert second.connector.get_external_cache_hit_sources(request, 2 * BS) == {"host": 2 * BS}
    run_to_completion(second, {"c": (shares_two, 2)})
    assert all(w.starts["c"] == [2 * BS] for w in second.workers)
    assert store_stats(store.url)["get_blocks"] == 4 * tp * pp
    stats = OffloadStats()
    for data in second.stats:
        stats.aggregate(CrossLayerOffloadConnector.build_kv_connector_stats(data))
    assert (stats.data["hit_tokens"], stats.data["remote_hit_tokens"]) == (6 * BS, 4 * BS)
    assert stats.data["remote_lookup_failures"] == stats.data["failed_loads"] == 0


def test_remote_only_engines_share_through_the_store(model_dir: str,
                                                     store: StoreProcess) -> None:
    first = make_engine(model_dir, store.url, remote_only=True, cpu_slots=8)
    prompt = make_prompt(3, 3 * BS + 2)
    run_to_completion(first, {"a": (prompt, 2)})
    assert len(first.connector._scheduler.index) == 0  # the pool only staged the blocks
    assert first.scheduler.reset_prefix_cache()
    poison_gpu(first)
    run_to_completion(first, {"a2": (prompt, 2)})  # its own blocks, back from the store
    second = make_engine(model_dir, store.url, remote_only=True, cpu_slots=8)
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 2)})
    assert first.workers[0].starts["a2"] == [3 * BS]
    assert second.workers[0].starts["b"] == [3 * BS]
    assert len(second.connector._scheduler.index) == 0
    assert store_stats(store.url)["get_blocks"] == 6


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("tp", [1, 2])
def test_store_killed_between_lookup_and_load_recomputes(
        model_dir: str, store: StoreProcess, async_scheduling: bool, tp: int) -> None:
    first = make_engine(model_dir, store.url, async_scheduling, tp)
    prompt = make_prompt(4, 3 * BS + 5)
    run_to_completion(first, {"a": (prompt, 2)})
    second = make_engine(model_dir, store.url, async_scheduling, tp,
                         remote_timeout_s=DOWN_TIMEOUT_S)  # the lookup waits for its answer
    poison_gpu(second)
    core = second.connector._scheduler
    on_planned_load(second, store.kill)  # the lookup said yes; the get will find no store
    run_to_completion(second, {"b": (prompt, 2)})
    assert store.process.poll() is not None  # it was killed
    assert all(w.starts["b"] == [0] for w in second.workers)  # recomputed, never read poison
    assert remote_failures(second) >= tp  # every rank's get failed
    # The failed fetch left nothing in the CPU tier that was not recomputed and stored again.
    assert all(core.index.contains(k) for k in h.prompt_keys(second, prompt))


def test_a_block_damaged_in_the_store_is_recomputed_once_then_stored_anew(
        model_dir: str, store: StoreProcess) -> None:
    """A block whose bytes changed in the store (a bit flip in its RAM) fails the load that
    fetches it: the request recomputes from it, never loads it again (it looped on that failed
    fetch before), and the store drops it, so the recomputed block is put anew and serves the
    next engine bit-exact."""
    first = make_engine(model_dir, store.url)
    prompt = make_prompt(5, 3 * BS + 5)
    run_to_completion(first, {"a": (prompt, 2)})
    keys = h.prompt_keys(first, prompt)
    slot = first.connector._scheduler.index.slot_of(keys[1])
    block = first.workers[0].connector._worker.pool.slots[slot].numpy().tobytes()
    try:
        changed = flip_in_process(store.process.pid, block)
    except PermissionError as exc:
        pytest.skip(f"cannot write the store process's memory here: {exc}")
    assert changed >= 1, "the block's bytes are not in the store process"
    second = make_engine(model_dir, store.url)
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 2)})
    # One load of the three blocks failed at the second; block 0 was then loaded, the rest
    # computed: tokens and logprobs as computed from scratch.
    assert second.workers[0].starts["b"] == [BS]
    assert remote_failures(second) == 1
    third = make_engine(model_dir, store.url)
    poison_gpu(third)
    run_to_completion(third, {"c": (prompt, 2)})
    assert third.workers[0].starts["c"] == [3 * BS]  # every block from the store, good bytes
    # Negative control: the same engine's load with its first block's bytes flipped in the
    # store is refused too: it recomputes, so the store's bytes are what the loads used.
    first_block = third.workers[0].connector._worker.pool.slots[
        third.connector._scheduler.index.slot_of(keys[0])].numpy().tobytes()
    assert flip_in_process(store.process.pid, first_block) >= 1
    fourth = make_engine(model_dir, store.url)
    poison_gpu(fourth)
    run_to_completion(fourth, {"d": (prompt, 2)})
    assert fourth.workers[0].starts["d"] == [0] and remote_failures(fourth) == 1


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_request_aborted_while_its_fetch_hangs_keeps_its_blocks_until_the_fetch_ends(
        model_dir: str, store: StoreProcess, async_scheduling: bool) -> None:
    # The fetch, then the copy into the request's GPU blocks, still run after the abort: the
    # blocks must not go to another request before the load is reported, failed or not.
    first = make_engine(model_dir, store.url, async_scheduling)
    prompt = make_prompt(11, 4 * BS + 6)
    run_to_completion(first, {"a": (prompt, 3)})
    # No deadline can pass: the lookup must find the blocks, and only the test ends the hang.
    second = make_engine(model_dir, store.url, async_scheduling, num_gpu_blocks=10,
                         remote_lookup_deadline_s=30.0, remote_timeout_s=60.0)
    poison_gpu(second)
    on_planned_load(second, lambda: store.process.send_signal(signal.SIGSTOP))
    second.drain_when_idle = False  # a quiet step's drain would wait for the fetch
    try:
        second.add("b", prompt, max_tokens=3)
        second.run(until=lambda: second.scheduler.requests["b"].status
                   == RequestStatus.WAITING_FOR_REMOTE_KVS, max_steps=MAX_STEPS)
        assert len(second.scheduler.kv_cache_manager.get_block_ids("b")[0]) == 4
        other = make_prompt(12, 5 * BS + 10)  # needs 6 of the 9 blocks: only 5 are free
        h.abort_while_loading(second, "b", ("c", other), steps=20)
    finally:
        store.process.send_signal(signal.SIGCONT)
    second.drain_when_idle = True
    run_to_completion(second, {"c": (other, 2)})  # then c gets the blocks; no leaks
    assert second.workers[0].starts["c"] == [0]
    assert store_stats(store.url)["get_blocks"] == 4  # the fetch was answered after all


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_block_evicted_between_lookup_and_load_keeps_the_head(
        model_dir: str, store: StoreProcess, async_scheduling: bool) -> None:
    first = make_engine(model_dir, store.url, async_scheduling)
    prompt = make_prompt(10, 4 * BS + 3)
    run_to_completion(first, {"a": (prompt, 2)})
    second = make_engine(model_dir, store.url, async_scheduling)
    poison_gpu(second)
    core = second.connector._scheduler
    third = h.prompt_keys(second, prompt)[2]
    deleted: list[bool] = []

    def delete_block_2() -> None:  # the fetch is planned: the store drops block 2, once
        if not deleted:
            with StoreClient(store.url, Security.none(), namespace=core.namespace) as client:
                deleted.extend(client.delete([third]))

    on_planned_load(second, delete_block_2)
    run_to_completion(second, {"b": (prompt, 2)})
    assert deleted == [True]
    # Blocks 0-1 came from the store (bytes compared), block 2 was missing: vLLM dropped the
    # request's load, asked again (blocks 0-1 fetched again) and computed from block 2 on.
    assert second.workers[0].starts["b"] == [2 * BS]
    assert second.workers[0].prefix_checks == 2 * BS
    assert remote_failures(second) == 1
    stats = store_stats(store.url)
    assert (stats["get_blocks"], stats["get_missing"]) == (3 + 2, 1)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_store_down_at_lookup_serves_from_the_cpu_tier_without_stalling(
        model_dir: str, store: StoreProcess, async_scheduling: bool) -> None:
    engine = make_engine(model_dir, store.url, async_scheduling,
                         remote_timeout_s=DOWN_TIMEOUT_S)  # its puts will find no store
    prompt = make_prompt(5, 4 * BS)
    run_to_completion(engine, {"a": (prompt, 2)})
    store.kill()
    assert engine.scheduler.reset_prefix_cache()
    poison_gpu(engine)
    lookups = engine.connector._scheduler.tier("remote").lookups
    lookups.deadline_s = DOWN_DEADLINE_S  # the first request's lookup waited for a live store
    shares_two = prompt[:2 * BS] + make_prompt(6, 2 * BS)
    fresh = make_prompt(7, 3 * BS)
    lookups.backoff_s = 60.0  # once down, the store stays "down" for the rest of the test
    started = time.monotonic()
    run_to_completion(engine, {"b": (shares_two, 2), "c": (fresh, 2)})
    elapsed = time.monotonic() - started
    assert engine.workers[0].starts["b"] == [2 * BS]  # the CPU tier's part, then computed
    assert engine.workers[0].starts["c"] == [0]  # recomputed
    assert lookups.failures == 2  # b and c asked in the same step; both waited the deadline
    # One lookup deadline (then the store counts as down), plus puts bounded by their timeout
    # (a bound generous for a busy 2-core runner: a stall would wait out nothing short).
    assert elapsed < 10 * (DOWN_DEADLINE_S + 2 * DOWN_TIMEOUT_S) + 10.0, elapsed
    # A request arriving while the store is known down is not delayed at all.
    request = engine.add("d", make_prompt(8, 2 * BS), max_tokens=1)
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    engine.run(max_steps=MAX_STEPS)


def test_shared_secret_store_admits_the_engine_and_a_wrong_secret_recomputes(
        model_dir: str, tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("correct horse battery staple\n")
    (tmp_path / "wrong").write_text("correct horse battery stapler\n")
    args = ("--security", "secret", "--secret-file", str(tmp_path / "secret"))
    with StoreProcess(tmp_path / "store.log", capacity="16MiB", security_args=args) as store:
        prompt = make_prompt(9, 2 * BS + 1)
        first = make_engine(model_dir, store.url, remote_security="secret",
                            remote_secret_file=str(tmp_path / "secret"))
        run_to_completion(first, {"a": (prompt, 2)})
        second = make_engine(model_dir, store.url, remote_security="secret",
                             remote_secret_file=str(tmp_path / "secret"))
        poison_gpu(second)
        run_to_completion(second, {"b": (prompt, 2)})
        assert second.workers[0].starts["b"] == [2 * BS]
        # A wrong secret is refused: nothing found, nothing stored, the request recomputed.
        intruder = make_engine(model_dir, store.url, remote_security="secret",
                               remote_secret_file=str(tmp_path / "wrong"), **DOWN)
        run_to_completion(intruder, {"c": (prompt, 2)})
        assert intruder.workers[0].starts["c"] == [0]
        assert intruder.connector._scheduler.tier("remote").lookups.failures == 1
        assert remote_failures(intruder) == 1  # its write-through put was refused
        with StoreClient(store.url, Security.shared_secret(tmp_path / "secret")) as client:
            stats = client.stats()
        assert (stats["blocks"], stats["get_blocks"]) == (2, 2)


@pytest.mark.parametrize(("extra", "message"), [
    ({"remote_only": True}, "without remote_url"),
    ({"remote_only": False, "remote_security": "none"}, "without remote_url"),  # defaults too
    ({"remote_url": "tcp://127.0.0.1:1", "remote_security": "secret"},
     "needs remote_secret_file"),
    ({"remote_url": "tcp://127.0.0.1:1", "remote_security": "curve"}, "remote_curve_key_pair"),
    ({"remote_url": "tcp://127.0.0.1:1", "remote_security": "plain"}, "must be one of"),
    ({"remote_url": "tcp://127.0.0.1:1", "remote_lookup_deadline_s": 0}, "positive number"),
    ({"remote_url": "tcp://10.1.2.3:7000"}, "allowed only on loopback"),
    ({"remote_url": "http://127.0.0.1:1"}, "expected an address tcp://"),
])
def test_remote_options_refuse_bad_values(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.parse({"cpu_bytes": 1, **extra})
