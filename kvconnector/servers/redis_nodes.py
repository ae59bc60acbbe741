"""The redis-server processes behind LocalRedisCluster: their ports, config files and lives.

Each node runs in its own 0700 directory under the cluster's temp dir, from a 0600 config file
that holds the ACL password (never a command line), and logs to redis.log there. NodeProcesses
is also the state the cluster's exit-time finalizer stops, so it holds no reference back to the
cluster.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from kvconnector.servers.child import ChildServer

HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so none is handed out twice)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def node_config(port: int, bus_port: int, node_dir: Path, *, node_timeout_ms: int,
                maxmemory: int | None, user: str, password: str,
                certs: tuple[Path, Path, Path] | None) -> str:
    """redis.conf for one cluster node; `certs` (CA, cert, key) makes it listen on TLS only."""
    lines = [
        f"bind {HOST}", "protected-mode yes", "daemonize no", "loglevel notice",
        f"dir {node_dir}",
        "cluster-enabled yes", "cluster-config-file nodes.conf",
        f"cluster-port {bus_port}",  # explicit bus port: port+10000 may be taken or > 65535
        f"cluster-node-timeout {node_timeout_ms}",
        # survivors keep serving their slots while a master is down (our requirement)
        "cluster-require-full-coverage no", "cluster-allow-reads-when-down no",
        'save ""', "appendonly no",
        f"maxmemory {maxmemory or 0}", "maxmemory-policy allkeys-lru",
        "user default off",
        f"user {user} on >{password} ~* &* +@all",
        # a replica syncs from its master as the same ACL user
        f"masteruser {user}", f"masterauth {password}",
        # first sync at once, not after 5 s; a replica is listed in CLUSTER SLOTS once its
        # offset moves, which the master's pings (every 10 s by default) make happen
        "repl-diskless-sync-delay 0", "repl-ping-replica-period 1",
    ]
    if certs:
        ca, cert, key = certs
        lines += ["port 0", f"tls-port {port}", f"tls-cert-file {cert}",
                  f"tls-key-file {key}", f"tls-ca-cert-file {ca}", "tls-cluster yes",
                  "tls-replication yes", "tls-auth-clients no"]
    else:
        lines.append(f"port {port}")
    return "\n".join(lines) + "\n"


class RedisNode(ChildServer):
    """One redis-server process, run from the config file in its own directory; the cluster
    says when it is ready (it answers PING)."""

    start_timeout_s = START_TIMEOUT_S

    def __init__(self, server: str, index: int, node_dir: Path) -> None:
        super().__init__(node_dir / "redis.log", cwd=node_dir)
        self.label = f"redis-server node {index}"
        self.server = server
        self.config_file = node_dir / "redis.conf"

    def command(self) -> list[str]:
        # only the config path on the command line: the password stays in the 0600 file
        return [self.server, str(self.config_file)]


class NodeProcesses:
    """`count` redis-server processes, by node index; a killed or unstarted node is not
    running."""

    def __init__(self, server: str, count: int, root: Path) -> None:
        self.server = server
        self.root = root
        self.nodes = [RedisNode(server, index, self.node_dir(index)) for index in range(count)]

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def procs(self) -> list[subprocess.Popen[bytes] | None]:
        """Each node's latest process (None: never started)."""
        return [node.process for node in self.nodes]

    def node_dir(self, index: int) -> Path:
        return self.root / f"node{index}"

    def spawn(self, index: int, config: str) -> None:
        """Write the node's config and start it (no wait: see `wait_ready`)."""
        node_dir = self.node_dir(index)
        node_dir.mkdir(mode=0o700, exist_ok=True)
        config_file = node_dir / "redis.conf"
        config_file.touch(mode=0o600)  # holds the password
        config_file.write_text(config)
        self.nodes[index].launch()

    def wait_ready(self, index: int, answers: Callable[[], bool]) -> None:
        """Wait until `answers()` (the node's PING); RuntimeError with its log if it exits
        first or takes over START_TIMEOUT_S (the node is killed)."""
        self.nodes[index].wait_ready(answers)

    def running(self, index: int) -> bool:
        return self.nodes[index].running()

    def live(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.running(i)]

    def pid(self, index: int) -> int:
        return self.nodes[index].pid

    def kill(self, index: int) -> None:
        """SIGKILL one node and wait for the process to be gone (no-op if already down)."""
        self.nodes[index].kill()

    def log_tail(self, index: int, lines: int = 30) -> str:
        return self.nodes[index].log_tail(lines)

    def stop(self) -> None:
        """SIGTERM every running node, SIGKILL what outlives its stop timeout, remove the dir."""
        for node in self.nodes:
            node.terminate()  # all at once: they shut down side by side
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
