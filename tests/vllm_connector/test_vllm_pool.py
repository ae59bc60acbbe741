"""The host's shared pool in place of the private one (`"pool": NAME`), through vLLM's real
Scheduler and AsyncScheduler (tests/vllm_connector/vllm_harness.py), against a real
`kvconnector pool serve` process.

Two engines naming one pool share a prefix bit-exact (the harness compares every byte a request
starts from, after poisoning the caches); a daemon killed between a lookup and its load makes
the load fail and vLLM recompute, and the engines carry on with a restarted daemon; the remote
store composes below the pool; with vLLM's hybrid manager on (full attention with a sliding
window or an align-mode state group) two engines share every group's blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm_harness import make_prompt, poison_gpu, run_to_completion  # noqa: E402

from kvconnector.servers.pool import PoolProcess  # noqa: E402
from kvconnector.servers.store import StoreProcess  # noqa: E402
from transfer.shared import protocol  # noqa: E402
from transfer.shared.client import PoolClient  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolProcess]:
    with PoolProcess(tmp_path / "pool.log", f"v{uuid.uuid4().hex[:10]}", capacity="4MiB",
                     slot_bytes="16KiB") as process:
        yield process


def make_engine(model_dir: str, pool: str, async_scheduling: bool = False, tp: int = 1,
                pp: int = 1, window: int | None = None, state: bool = False,
                **extra: object) -> h.Engine:
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  num_gpu_blocks=64, sliding_window=window, state=state,
                                  extra_config={"pool": pool, **extra}))


def pool_stats(name: str) -> dict:
    client = PoolClient(name, [bytes(16)], 1)
    try:
        return client.request(protocol.STATS)
    finally:
        client.close()


@pytest.mark.parametrize(("async_scheduling", "tp", "pp"), [
    pytest.param(False, 1, 1, id="Scheduler-tp1"),
    pytest.param(True, 1, 1, id="AsyncScheduler-tp1"),
    pytest.param(True, 2, 1, id="AsyncScheduler-tp2"),
    pytest.param(False, 2, 2, id="Scheduler-tp2-pp2")])
def test_two_engines_sharing_a_pool_share_a_prefix_bit_exact(
        model_dir: str, pool: PoolProcess, async_scheduling: bool, tp: int, pp: int) -> None:
    first = make_engine(model_dir, pool.name, async_scheduling, tp, pp)
    prompt = make_prompt(1, 4 * BS + 6)
    run_to_completion(first, {"a": (prompt, 3)})
    # One slot per block holds every rank's part of it.
    assert pool_stats(pool.name)["stored"] == 4
    assert first.connector._scheduler.index.lookup_prefix(h.prompt_keys(first, prompt)) == 4

    second = make_engine(model_dir, pool.name, async_scheduling, tp, pp)
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [4 * BS]  # resumed after the load from the pool
        assert worker.prefix_checks == 4 * BS  # every loaded byte compared
        assert worker.connector._worker.pool.shared_name == pool_stats(pool.name)["segment"]
    stats = h.total_stats(second)
    assert stats.data["hit_tokens"] == 4 * BS and stats.data["failed_loads"] == 0
    # The first engine, restarted (a new one in its place), finds its prefix in the pool.
    first.connector.shutdown()
    restarted = make_engine(model_dir, pool.name, async_scheduling, tp, pp)
    poison_gpu(restarted)
    run_to_completion(restarted, {"c": (prompt, 2)})
    assert all(w.starts["c"] == [4 * BS] for w in restarted.workers)
    assert pool_stats(pool.name)["pinned"] == pool_stats(pool.name)["storing"] == 0


@pytest.mark.parametrize(("window", "state", "async_scheduling", "tp", "stored", "loaded"), [
    # 4 full and 4 sliding window blocks stored; a load takes the 4 full and the 3 sliding ones
    # inside the window (40 tokens) before the prefix end
    pytest.param(40, False, False, 1, 8, 7, id="sliding-window-Scheduler-tp1"),
    # 4 full blocks and the state after 64 tokens (vLLM's align mode ends a chunk there)
    pytest.param(None, True, True, 2, 5, 5, id="state-AsyncScheduler-tp2")])
def test_two_hybrid_engines_sharing_a_pool_share_every_group_bit_exact(
        model_dir: str, pool: PoolProcess, window: int | None, state: bool,
        async_scheduling: bool, tp: int, stored: int, loaded: int) -> None:
    # vLLM's hybrid manager on: each group's blocks under its own keys in the pool; the second
    # engine's lookup asks the daemon about every group's blocks at once.
    first = make_engine(model_dir, pool.name, async_scheduling, tp, window=window, state=state)
    prompt = make_prompt(5, 4 * BS + 6)
    run_to_completion(first, {"a": (prompt, 3)})
    assert pool_stats(pool.name)["stored"] == stored
    second = make_engine(model_dir, pool.name, async_scheduling, tp, window=window, state=state)
    assert len(second.kv_cache_config.kv_cache_groups) == 2
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [4 * BS] and worker.prefix_checks == 4 * BS
    stats = h.total_stats(second).data
    assert (stats["hit_tokens"], stats["failed_loads"], stats["checksum_failures"]) == \
        (4 * BS, 0, 0)
    block_bytes = sum(w.connector._worker.block_bytes for w in second.workers)
    assert stats["load_bytes"] == loaded * block_bytes
    assert pool_stats(pool.name)["pinned"] == pool_stats(pool.name)["storing"] == 0


def test_a_state_block_evicted_between_a_hybrid_lookup_and_its_load_is_recomputed(
        model_dir: str, pool: PoolProcess) -> None:
    # The daemon answered the lookup for every group's blocks; another engine then drops the
    # state block before the load pins it: the load fails whole and vLLM recomputes, never
    # reading poison, and the recomputed blocks are stored again.
    first = make_engine(model_dir, pool.name, state=True)
    prompt = make_prompt(6, 4 * BS + 6)
    run_to_completion(first, {"a": (prompt, 2)})
    second = make_engine(model_dir, pool.name, state=True)
    poison_gpu(second)
    core = second.connector._scheduler
    lookup = core.lookup
    dropped: list[bytes] = []

    def lookup_then_drop(req_id: str, block_hashes: list[bytes], *args: object) -> int:
        hits = lookup(req_id, block_hashes, *args)
        if hits and not dropped:
            (state,) = [g for g in core.groups if g.state]
            dropped.extend(core._keys(state, [block_hashes[hits // BS - 1]]))
            first.connector._scheduler.index.discard(dropped)
        return hits

    core.lookup = lookup_then_drop
    run_to_completion(second, {"b": (prompt, 2)})
    assert dropped
    assert all(w.starts["b"] == [0] for w in second.workers)  # recomputed whole
    assert h.total_stats(second).data["failed_loads"] == 1
    assert first.connector._scheduler.index.present(dropped) == [True]  # stored again


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_daemon_killed_between_lookup_and_load_recomputes_then_reconnects(
        model_dir: str, pool: PoolProcess, async_scheduling: bool) -> None:
    first = make_engine(model_dir, pool.name, async_scheduling)
    prompt = make_prompt(4, 3 * BS + 5)
    run_to_completion(first, {"a": (prompt, 2)})
    second = make_engine(model_dir, pool.name, async_scheduling)
    poison_gpu(second)
    core = second.connector._scheduler
    lookup = core.lookup
    killed = []

    def lookup_then_kill(*args: object) -> int:
        hits = lookup(*args)
        if hits and not killed:
            pool.kill()  # the lookup said yes; the load will find no daemon
            killed.append(True)
        return hits

    core.lookup = lookup_then_kill
    run_to_completion(second, {"b": (prompt, 2)})
    assert killed
    assert second.workers[0].starts["b"] == [0]  # recomputed, never read poison
    assert h.total_stats(second).data["failed_loads"] == 1
    # A restarted daemon: both engines reconnect on their next call, into a new, empty pool.
    pool.start()
    run_to_completion(first, {"a2": (prompt, 2)})  # stores the prefix again
    assert second.scheduler.reset_prefix_cache()  # b's blocks: not from vLLM's own cache
    poison_gpu(second)
    run_to_completion(second, {"b2": (prompt, 2)})
    assert second.workers[0].starts["b2"] == [3 * BS]


def test_the_remote_store_composes_below_the_pool(model_dir: str, pool: PoolProcess,
                                                  tmp_path: Path) -> None:
    with StoreProcess(tmp_path / "store.log", capacity="64MiB") as store, \
            PoolProcess(tmp_path / "pool2.log", f"w{uuid.uuid4().hex[:10]}", capacity="4MiB",
                        slot_bytes="16KiB") as other_host:
        # A live store's answers are waited for: a busy runner must not turn a hit into a miss.
        remote = {"remote_url": store.url, "remote_lookup_deadline_s": 30.0,
                  "remote_timeout_s": 30.0}
        first = make_engine(model_dir, pool.name, **remote)
        prompt = make_prompt(7, 4 * BS + 2)
        run_to_completion(first, {"a": (prompt, 2)})  # into the pool, written through
        # An engine on another host (another pool): fetched from the store into its pool.
        second = make_engine(model_dir, other_host.name, **remote)
        poison_gpu(second)
        run_to_completion(second, {"b": (prompt, 2)})
        assert second.workers[0].starts["b"] == [4 * BS]
        stats = h.total_stats(second).data
        assert (stats["hit_tokens"], stats["remote_hit_tokens"]) == (4 * BS, 4 * BS)
        assert pool_stats(other_host.name)["stored"] == 4  # the fetched blocks stay in its pool


@pytest.mark.parametrize(("async_scheduling", "mla"), [
    pytest.param(False, False, id="Scheduler"),
    pytest.param(True, True, id="AsyncScheduler-mla")])
def test_the_disk_tier_below_the_pool_serves_a_restart_with_an_empty_pool(
        model_dir: str, pool: PoolProcess, tmp_path: Path, async_scheduling: bool,
        mla: bool) -> None:
    """TP 2 over the shared pool with a disk tier written through: each rank writes its part
    of the shared slots to its own slab (MLA: 6 KiB a rank in 8 KiB of each slot, read back in
    whole pages). The engines and the daemon restarted (the pool empty), a new engine on the
    same disk_path loads the prefix from disk, every byte compared."""
    def engine() -> h.Engine:
        return h.Engine(h.EngineSetup(
            model_dir=model_dir, async_scheduling=async_scheduling, tensor_parallel_size=2,
            mla=mla, num_gpu_blocks=64, extra_config={
                "pool": pool.name, "disk_path": str(tmp_path / "disk"),
                "disk_bytes": 64 << 20, "disk_write_policy": "through"}))

    first = engine()
    prompt = make_prompt(9, 4 * BS + 3)
    run_to_completion(first, {"a": (prompt, 2)})
    assert h.total_stats(first).data["disk_write_bytes"] > 0
    assert len(list((tmp_path / "disk").glob("*.slab"))) == 2  # one slab per rank
    h.Engine.shutdown_all()  # the workers close their slabs
    pool.kill()
    pool.start()
    restarted = engine()
    poison_gpu(restarted)
    run_to_completion(restarted, {"b": (prompt, 2)})
    assert all(w.starts["b"] == [4 * BS] for w in restarted.workers)
    stats = h.total_stats(restarted).data
    assert (stats["hit_tokens"], stats["disk_hit_tokens"]) == (4 * BS, 4 * BS)
    assert stats["failed_loads"] == 0
    assert pool_stats(pool.name)["stored"] == 4  # read into the pool, committed there
