"""`kvconnector bench --redis-url`: the Redis tier against a real local cluster, at tiny sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvconnector.cli import main

pytest.importorskip("redis")

from transfer.remote.redis_local import LocalRedisCluster  # noqa: E402

pytestmark = pytest.mark.redis

# One small preset (640 KiB blocks), few blocks, one repeat: seconds, not minutes.
TINY = ["bench", "--preset", "llama-3.1-70b-tp8", "--blocks", "8", "--budget", "64M",
        "--prefix-tokens", "64", "--repeats", "1"]


def _redis_args(cluster: LocalRedisCluster) -> list[str]:
    return ["--redis-url", cluster.url, "--redis-user", cluster.user,
            "--redis-password-file", str(cluster.password_file)]


def _kvc_keys(cluster: LocalRedisCluster) -> list[bytes]:
    with cluster.admin() as admin:
        return [key for node in admin.get_primaries()
                for key in admin.get_redis_connection(node).scan_iter(match="kvc:*")]


def test_redis_rows_present_positive_and_cluster_left_clean(
        redis_cluster: LocalRedisCluster, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "bench.json"
    assert main([*TINY, *_redis_args(redis_cluster), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "redis tier: Redis Cluster" in out
    assert redis_cluster.password not in out

    record = json.loads(js.read_text())
    redis = record["redis"]
    zmq_blocks = {row["case"]: row["blocks"] for row in record["remote"]["rows"]}
    assert [row["case"] for row in redis["rows"]] == ["llama-3.1-70b-tp8 bf16"]
    for row in redis["rows"]:
        assert "error" not in row, row["error"]
        assert row["blocks"] == zmq_blocks[row["case"]]  # the zmq rows' blocks, same sizes
        assert row["block_bytes"] == 640 << 10
        for op in ("put", "get"):
            assert row[op]["gbps"] > 0 and len(row[op]["seconds"]) == 1
        if shutil.which("redis-benchmark"):
            assert "baseline_unavailable" not in row, row["baseline_unavailable"]
            assert row["baseline_put_gbps"] > 0 and row["baseline_get_gbps"] > 0
            assert row["put"]["ratio"] > 0 and row["get"]["ratio"] > 0
        else:
            assert row["baseline_unavailable"]
    assert "--redis-url" in record["meta"]["command"]
    assert redis_cluster.password not in js.read_text()
    assert _kvc_keys(redis_cluster) == []
    with redis_cluster.admin() as admin:  # redis-benchmark's keys are gone too
        assert [k for node in admin.get_primaries()
                for k in admin.get_redis_connection(node).scan_iter(match="key:*")] == []


def test_without_redis_url_there_is_no_redis_record(tmp_path: Path) -> None:
    js = tmp_path / "bench.json"
    assert main([*TINY, "--json", str(js)]) == 0
    assert "redis" not in json.loads(js.read_text())


def test_redis_flags_need_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--redis-user", "someone"]) == 2
    assert "need --redis-url" in capsys.readouterr().err
