"""redis_nodes: the config each cluster node runs with, free ports, and the node processes."""

from __future__ import annotations

import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnector.servers.redis_nodes import NodeProcesses, free_ports, node_config


def _config(**overrides: object) -> str:
    options: dict[str, object] = {"node_timeout_ms": 1500, "maxmemory": 64 << 20,
                                  "user": "alice", "password": "s3cret", "certs": None}
    options.update(overrides)
    return node_config(7001, 17001, Path("/tmp/n0"), **options)  # type: ignore[arg-type]


def test_plain_config_is_a_cluster_node_for_one_acl_user_without_persistence() -> None:
    assert _config().splitlines() == [
        "bind 127.0.0.1", "protected-mode yes", "daemonize no", "loglevel notice",
        "dir /tmp/n0", "cluster-enabled yes", "cluster-config-file nodes.conf",
        "cluster-port 17001", "cluster-node-timeout 1500",
        "cluster-require-full-coverage no", "cluster-allow-reads-when-down no",
        'save ""', "appendonly no", f"maxmemory {64 << 20}", "maxmemory-policy allkeys-lru",
        "user default off", "user alice on >s3cret ~* &* +@all",
        "masteruser alice", "masterauth s3cret",
        "repl-diskless-sync-delay 0", "repl-ping-replica-period 1", "port 7001",
    ]


def test_no_maxmemory_means_unbounded() -> None:
    assert "maxmemory 0" in _config(maxmemory=None).splitlines()


def test_tls_config_listens_on_tls_only() -> None:
    certs = (Path("/c/ca.crt"), Path("/c/node.crt"), Path("/c/node.key"))
    lines = _config(certs=certs).splitlines()
    assert lines[:-8] == _config().splitlines()[:-1]  # the rest as without TLS
    assert lines[-8:] == ["port 0", "tls-port 7001", "tls-cert-file /c/node.crt",
                          "tls-key-file /c/node.key", "tls-ca-cert-file /c/ca.crt",
                          "tls-cluster yes", "tls-replication yes", "tls-auth-clients no"]


def test_free_ports_are_distinct_loopback_ports() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= port <= 65535 for port in ports)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeProcesses]:
    # Python stands in for redis-server (both run the config file they are given): what is
    # checked is the handling of the processes, their files and their logs
    (tmp_path / "root").mkdir()
    processes = NodeProcesses(sys.executable, 3, tmp_path / "root")
    yield processes
    processes.stop()  # no child left behind when an assertion failed (stop is idempotent)


def test_processes_spawn_from_a_private_config_log_and_are_killed_and_stopped(
        nodes: NodeProcesses) -> None:
    assert len(nodes) == 3 and nodes.live() == [] and nodes.log_tail(0) == "(no log)"
    with pytest.raises(RuntimeError, match="node 2 was never started"):
        nodes.pid(2)
    forever = "import time\nprint('node up', flush=True)\ntime.sleep(600)\n"
    nodes.spawn(0, forever)
    nodes.spawn(1, forever)
    nodes.spawn(2, "raise SystemExit('bad config')\n")
    config = nodes.node_dir(0) / "redis.conf"
    assert config.read_text() == forever
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(nodes.node_dir(0).stat().st_mode) & 0o077 == 0
    deadline = time.monotonic() + 30
    while (nodes.running(2) or "node up" not in nodes.log_tail(1)) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert nodes.live() == [0, 1]
    assert "bad config" in nodes.log_tail(2)
    pid = nodes.pid(1)
    nodes.kill(1)
    assert nodes.live() == [0] and nodes.procs[1] is not None
    assert nodes.procs[1].returncode == -signal.SIGKILL and nodes.pid(1) == pid
    nodes.kill(1)  # already down: nothing happens
    nodes.stop()
    assert nodes.live() == [] and nodes.procs[0] is not None
    assert nodes.procs[0].returncode == -signal.SIGTERM
    assert not nodes.root.exists()
