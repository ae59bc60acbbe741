"""A Redis Cluster as the connector's remote tier, through vLLM's real Scheduler (0.32 and 0.33) and
AsyncScheduler (vllm_harness.py), against a real 3-master cluster (tests/conftest.py).

Two engines sharing the cluster behave as engines sharing a prefix, bit-exact (the harness
compares every byte a request starts from); a master killed after the lookup makes the blocks it
held fail to load and vLLM recompute them, while the blocks on the surviving masters still hit;
a wrong password costs nothing but the remote tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

import vllm_harness as h  # noqa: E402
from vllm_harness import make_prompt, on_planned_load, poison_gpu, run_to_completion  # noqa: E402

from kvconnector.servers.redis_cluster import LocalRedisCluster  # noqa: E402
from kvconnector.vllm.connector import ConnectorOptions  # noqa: E402
from transfer.remote.redis.backend import RedisClusterBackend  # noqa: E402
from transfer.remote.redis.values import RedisAuth, redis_key  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
SCHEDULERS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]


def make_engine(model_dir: str, cluster: LocalRedisCluster, async_scheduling: bool = False,
                tp: int = 1, password_file: Path | None = None) -> h.Engine:
    config = {"cpu_bytes": 64 * h.block_bytes(tp), "remote_url": cluster.url,
              "remote_redis_password_file": str(password_file or cluster.password_file),
              # A new engine's first lookup waits for its client to read the slot map: on a
              # busy 2-core runner that took 0.65 s once, against 0.1-0.2 s usually. A dead
              # master or a wrong password fails at once, so no test waits these out.
              "remote_lookup_deadline_s": 10.0, "remote_timeout_s": 10.0}
    return h.Engine(h.EngineSetup(model_dir=model_dir, async_scheduling=async_scheduling,
                                  tensor_parallel_size=tp, extra_config=config))


def cluster_keys(cluster: LocalRedisCluster) -> int:
    admin = cluster.admin()
    try:
        return sum(1 for _ in admin.scan_iter(match=b"kvc:*", target_nodes=admin.ALL_NODES))
    finally:
        admin.close()


def remote_failures(engine: h.Engine) -> int:
    return sum(w.connector._worker.failures["remote"] for w in engine.workers)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("tp", [1, 2])
def test_two_engines_share_a_prefix_through_the_cluster_bit_exact(
        model_dir: str, redis_cluster_factory, async_scheduling: bool, tp: int) -> None:
    cluster = redis_cluster_factory()
    first = make_engine(model_dir, cluster, async_scheduling, tp)
    prompt = make_prompt(1, 6 * BS + 3)
    run_to_completion(first, {"a": (prompt, 3)})
    assert cluster_keys(cluster) == 6 * tp  # write-through: every full block of every rank

    second = make_engine(model_dir, cluster, async_scheduling, tp)
    poison_gpu(second)
    run_to_completion(second, {"b": (prompt, 3)})
    for worker in second.workers:
        assert worker.starts["b"] == [6 * BS]  # resumed after the remote load
        assert worker.prefix_checks == 6 * BS  # every fetched byte compared
    assert remote_failures(second) == 0
    assert second.connector._scheduler.tier("remote").lookups.failures == 0


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_master_killed_after_lookup_recomputes_its_blocks_and_survivors_still_hit(
        model_dir: str, redis_cluster_factory, async_scheduling: bool) -> None:
    cluster = redis_cluster_factory()
    first = make_engine(model_dir, cluster, async_scheduling)
    prompt = make_prompt(4, 8 * BS + 5)
    run_to_completion(first, {"a": (prompt, 2)})
    masters = [cluster.master_index_for_key(redis_key(k)) for k in h.prompt_keys(first, prompt)]
    # The victim: the master of the first block that is not on block 0's master.
    lost = next(i for i, m in enumerate(masters) if m != masters[0])
    victim = masters[lost]

    second = make_engine(model_dir, cluster, async_scheduling)
    poison_gpu(second)
    # The lookup found all 8; the get will lose the victim's.
    on_planned_load(second, lambda: cluster.kill(victim))
    run_to_completion(second, {"b": (prompt, 2)})
    # Blocks before the first lost one came from the surviving masters (bytes compared); vLLM
    # recomputed from there, never reading poison.
    assert second.workers[0].starts["b"] == [lost * BS]
    assert second.workers[0].prefix_checks == lost * BS
    assert remote_failures(second) >= 1
    # Another engine still finds the surviving prefix.
    third = make_engine(model_dir, cluster, async_scheduling)
    poison_gpu(third)
    run_to_completion(third, {"c": (prompt, 2)})
    assert third.workers[0].starts["c"] == [lost * BS]


def test_a_wrong_password_recomputes_and_stores_nothing(model_dir: str, redis_cluster_factory,
                                                        tmp_path: Path) -> None:
    cluster = redis_cluster_factory()
    (tmp_path / "wrong").write_text("not-the-password\n")
    intruder = make_engine(model_dir, cluster, password_file=tmp_path / "wrong")
    prompt = make_prompt(9, 3 * BS + 1)
    run_to_completion(intruder, {"a": (prompt, 2)})
    assert intruder.workers[0].starts["a"] == [0]
    assert remote_failures(intruder) >= 1  # its write-through put was refused
    assert cluster_keys(cluster) == 0
    honest = RedisClusterBackend(cluster.url, RedisAuth.from_sources(None, cluster.password_file),
                                 namespace=intruder.connector._scheduler.namespace)
    with honest:
        assert honest.lookup(h.prompt_keys(intruder, prompt)) == 0


@pytest.mark.parametrize(("extra", "message"), [
    ({"remote_url": "redis://127.0.0.1:7000", "remote_security": "secret"},
     "are for tcp:// stores"),
    ({"remote_url": "redis://127.0.0.1:7000", "remote_secret_file": "/x"},
     "are for tcp:// stores"),
    ({"remote_url": "tcp://127.0.0.1:7000", "remote_redis_user": "kv"}, "are for redis:// URLs"),
    ({"remote_url": "redis://10.1.2.3:7000"}, "allowed only on loopback"),
    ({"remote_url": "redis://127.0.0.1:7000", "remote_redis_password_file": "/no/such/file"},
     "does not exist"),
    ({"remote_url": "redis://127.0.0.1:7000", "remote_redis_ca_file": "/etc/hostname"},
     "for rediss:// \\(TLS\\) URLs"),
    ({"remote_url": "redis://kv:pw@127.0.0.1:7000"}, "never in the URL"),
])
def test_redis_options_refuse_bad_values(extra: dict, message: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCONNECTOR_REDIS_PASSWORD", raising=False)
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.parse({"cpu_bytes": 1, **extra})
