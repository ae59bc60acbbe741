"""The disk tier below the host pool, through vLLM's real Scheduler and AsyncScheduler
(vllm_connector/vllm_harness.py; the fake worker compares every byte a request starts from).

A pool too small for two prompts sends the evicted blocks to disk and serves them back; a new
engine on the same directory (a restart) finds every rank's blocks and loads as many as its
pool holds; a block flipped on disk is caught by its checksum and recomputed. With remote_only
(the pool only stages blocks for a real store process) the disk, written through, is the local
tier in front of the store. With vLLM's hybrid manager on (full attention with a sliding window
or an align-mode state group) a restarted engine reads every group's blocks from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import make_prompt, poison_gpu, run_to_completion, total_stats  # noqa: E402

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up  # noqa: E402
from kvconnector.servers.store import StoreProcess  # noqa: E402
from kvconnector.vllm.options import ConnectorOptions  # noqa: E402
from transfer.disk.slab import slab_path  # noqa: E402
from transfer.remote.store.client import StoreClient  # noqa: E402
from transfer.remote.store.security import Security  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE


def make_engine(model_dir: str, disk: Path, cpu_slots: int, write_policy: str,
                async_scheduling: bool = False, tp: int = 1, pp: int = 1,
                mla: bool = False, window: int | None = None, state: bool = False,
                **extra: object) -> h.Engine:
    # A slot holds the largest stage's layers (hybrid: of one of the two groups sharing the
    # tensors), as the connector sizes it.
    layers = max(map(len, h.stage_layers(pp))) // (2 if window or state else 1)
    slot = round_up(layers * h.page_bytes(tp, mla), HOST_ALIGNMENT)
    config = {"cpu_bytes": cpu_slots * slot, "disk_path": str(disk),
              "disk_bytes": 64 * (slot + 4096), "disk_write_policy": write_policy, **extra}
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp, mla=mla,
                                  sliding_window=window, state=state, extra_config=config))


def hit_sources(engine: h.Engine, req_id: str, prompt: list[int], max_tokens: int,
                tokens: int) -> dict:
    """Where the connector plans `req_id`'s first load from (added and stepped to its load)."""
    request = engine.add(req_id, prompt, max_tokens)
    engine.run(until=lambda: request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    return engine.connector.get_external_cache_hit_sources(request, tokens)


@pytest.mark.parametrize(("async_scheduling", "tp", "pp", "mla"), [
    pytest.param(False, 1, 1, False, id="Scheduler-tp1"),
    pytest.param(True, 2, 1, False, id="AsyncScheduler-tp2"),
    pytest.param(False, 1, 2, True, id="Scheduler-pp2-mla")])
def test_evicted_blocks_come_back_from_disk_bit_exact(
        model_dir: str, tmp_path: Path, async_scheduling: bool, tp: int, pp: int,
        mla: bool) -> None:
    engine = make_engine(model_dir, tmp_path / "disk", 8, "evict", async_scheduling, tp, pp, mla)
    a, b = make_prompt(1, 6 * BS + 5), make_prompt(2, 6 * BS + 3)
    run_to_completion(engine, {"a": (a, 2)})
    run_to_completion(engine, {"b": (b, 2)})  # 6 blocks in 8 slots: a's tail 4 go to disk
    assert total_stats(engine).data["disk_write_bytes"] == 4 * tp * h.block_bytes(tp, mla)
    poison_gpu(engine)
    assert engine.scheduler.reset_prefix_cache()  # vLLM's GPU prefix cache, not the tiers
    assert hit_sources(engine, "a2", a, 2, 6 * BS) == {"host": 2 * BS, "disk": 4 * BS}
    run_to_completion(engine, {"a2": (a, 2)})
    for worker in engine.workers:
        assert worker.starts["a2"] == [6 * BS]
        assert worker.prefix_checks >= 6 * BS  # every loaded byte compared
    stats = total_stats(engine).data
    assert (stats["disk_hit_tokens"], stats["disk_failed_reads"]) == (4 * BS, 0)
    assert stats["disk_read_bytes"] == 4 * tp * h.block_bytes(tp, mla)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_restarted_engine_with_a_small_pool_loads_its_blocks_from_disk(
        model_dir: str, tmp_path: Path, async_scheduling: bool) -> None:
    first = make_engine(model_dir, tmp_path / "disk", 16, "through", async_scheduling, tp=2)
    prompt = make_prompt(3, 6 * BS + 7)
    run_to_completion(first, {"a": (prompt, 3)})
    h.Engine.shutdown_all()  # the workers close their slabs
    second = make_engine(model_dir, tmp_path / "disk", 4, "through", async_scheduling, tp=2)
    assert len(second.connector._scheduler.tier("disk").index) == 6
    poison_gpu(second)
    # A pool of 4 slots takes 4 of the 6 blocks on disk now; vLLM computes the rest.
    assert hit_sources(second, "b", prompt, 3, 4 * BS) == {"disk": 4 * BS}
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [4 * BS] and worker.prefix_checks >= 4 * BS
    assert total_stats(second).data["disk_hit_tokens"] == 4 * BS


@pytest.mark.parametrize(("window", "state", "async_scheduling", "tp", "on_disk"), [
    # 6 full and 6 sliding window blocks stored (one prefill step); a reload reads the 6 full
    # and the 3 sliding ones inside the window before its end
    pytest.param(40, False, False, 1, 12, id="sliding-window-Scheduler-tp1"),
    # 6 full blocks and the state after 96 tokens (vLLM's align mode ends a chunk there)
    pytest.param(None, True, True, 2, 7, id="state-AsyncScheduler-tp2")])
def test_a_restarted_hybrid_engine_loads_every_group_from_disk(
        model_dir: str, tmp_path: Path, window: int | None, state: bool, async_scheduling: bool,
        tp: int, on_disk: int) -> None:
    # vLLM's hybrid manager on: each group's blocks under its own keys in the slab, found
    # again by a restarted engine and read into the pool for every group that needs them.
    first = make_engine(model_dir, tmp_path / "disk", 16, "through", async_scheduling, tp,
                        window=window, state=state)
    prompt = make_prompt(4, 6 * BS + 7)
    run_to_completion(first, {"a": (prompt, 3)})
    h.Engine.shutdown_all()
    second = make_engine(model_dir, tmp_path / "disk", 16, "through", async_scheduling, tp,
                         window=window, state=state)
    assert len(second.kv_cache_config.kv_cache_groups) == 2
    assert len(second.connector._scheduler.tier("disk").index) == on_disk
    poison_gpu(second)
    assert hit_sources(second, "b", prompt, 3, 6 * BS) == {"disk": 6 * BS}
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [6 * BS] and worker.prefix_checks >= 6 * BS
    stats = total_stats(second).data
    assert (stats["disk_hit_tokens"], stats["disk_failed_reads"]) == (6 * BS, 0)
    reads = h.reload_blocks(second, 6)  # 6 + 3 sliding, or 6 + 1 state
    assert stats["disk_read_bytes"] == reads * tp * h.block_bytes(tp) // 2


def test_a_flipped_block_on_disk_is_recomputed(model_dir: str, tmp_path: Path) -> None:
    first = make_engine(model_dir, tmp_path / "disk", 16, "through")
    prompt = make_prompt(5, 5 * BS + 1)
    run_to_completion(first, {"a": (prompt, 2)})
    h.Engine.shutdown_all()
    second = make_engine(model_dir, tmp_path / "disk", 16, "through")
    disk = second.connector._scheduler.tier("disk")
    key = h.prompt_keys(second, prompt)[2]
    slot = disk.index.prepare_load([key]).slots[0]
    disk.index.complete_load([key])
    slab = second.workers[0].connector._worker.tiers["disk"].io.slab
    with slab_path(tmp_path / "disk", slab.digest).open("r+b") as f:
        f.seek(slab.offset(slot) + 1000)
        byte = f.read(1)[0]
        f.seek(slab.offset(slot) + 1000)
        f.write(bytes([byte ^ 0x80]))
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 2)})  # tokens checked: recomputed from block 2
    worker = second.workers[0]
    assert worker.starts["b"] == [2 * BS]  # blocks 0 and 1 loaded, 2 on recomputed
    stats = total_stats(second).data
    assert (stats["disk_failed_reads"], stats["failed_loads"]) == (1, 1)
    # The recomputed block was stored in the pool and written to disk again.
    assert second.connector._scheduler.index.contains(key) and disk.index.contains(key)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_remote_only_writes_through_to_disk_and_reloads_from_it_before_the_store(
        model_dir: str, tmp_path: Path, async_scheduling: bool) -> None:
    with StoreProcess(tmp_path / "store.log", capacity="64MiB") as store:
        remote = {"remote_url": store.url, "remote_only": True, "remote_security": "none",
                  "remote_lookup_deadline_s": 30.0, "remote_timeout_s": 30.0}
        first = make_engine(model_dir, tmp_path / "disk", 8, "through", async_scheduling,
                            **remote)
        prompt = make_prompt(6, 6 * BS + 2)
        run_to_completion(first, {"a": (prompt, 2)})
        core = first.connector._scheduler
        assert (len(core.index), len(core.tier("disk").index)) == (0, 6)  # staged, then on disk
        with StoreClient(store.url, Security.none()) as client:
            assert client.stats()["put_blocks"] == 6  # and in the store
        assert first.scheduler.reset_prefix_cache()
        poison_gpu(first)
        run_to_completion(first, {"a2": (prompt, 2)})
        assert first.workers[0].starts["a2"] == [6 * BS]  # every byte compared
        stats = total_stats(first).data
        assert (stats["disk_hit_tokens"], stats["remote_hit_tokens"]) == (6 * BS, 0)
        assert stats["disk_read_bytes"] == 6 * h.block_bytes(1)
        assert len(core.index) == 0  # read through staging slots, not kept
        with StoreClient(store.url, Security.none()) as client:
            assert client.stats()["get_blocks"] == 0  # the disk answered first
        # An engine on another disk finds them in the store.
        second = make_engine(model_dir, tmp_path / "disk2", 8, "through", async_scheduling,
                             **remote)
        poison_gpu(second)
        run_to_completion(second, {"b": (prompt, 2)})
        assert second.workers[0].starts["b"] == [6 * BS]
        assert total_stats(second).data["remote_hit_tokens"] == 6 * BS
        # Fetched blocks are not written to disk (the store holds them), nor kept in the pool.
        assert (len(second.connector._scheduler.index),
                len(second.connector._scheduler.tier("disk").index)) == (0, 0)


@pytest.mark.parametrize(("extra", "message"), [
    ({"disk_bytes": 1 << 30}, r"\['disk_bytes'\] given without disk_path"),
    ({"disk_write_policy": "through"}, "without disk_path"),
    ({"disk_path": "/tmp/x"}, "needs disk_bytes"),
    ({"disk_path": "/tmp/x", "disk_bytes": 0}, "needs disk_bytes.*got 0"),
    ({"disk_path": "", "disk_bytes": 1}, "disk_path must be a directory"),
    ({"disk_path": "/tmp/x", "disk_bytes": 1, "disk_write_policy": "back"},
     "disk_write_policy must be one of"),
    ({"disk_path": "/tmp/x", "disk_bytes": 1, "remote_url": "tcp://127.0.0.1:1",
      "remote_security": "none", "remote_only": True},
     "remote_only with disk_path needs disk_write_policy 'through'.*got 'evict'"),
])
def test_disk_options_refuse_bad_values(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.parse({"cpu_bytes": 1, **extra})


def test_disk_bytes_without_room_for_a_block_is_refused(model_dir: str, tmp_path: Path) -> None:
    slot = h.block_bytes(1)  # a multiple of 4 KiB: a disk slot is one more 4 KiB
    extra = {"cpu_bytes": 4 * slot, "disk_path": str(tmp_path), "disk_bytes": slot}
    with pytest.raises(ValueError, match=f"disk_bytes {slot} holds no block"):
        h.Engine(h.EngineSetup(model_dir=model_dir, extra_config=extra))
    assert not list(tmp_path.iterdir())  # nothing written
