"""The redis-server processes behind LocalRedisCluster: their ports, config files and lives.

Each node runs in its own 0700 directory under the cluster's temp dir, from a 0600 config file
that holds the ACL password (never a command line), and logs to redis.log there. NodeProcesses
is also the state the cluster's exit-time finalizer stops, so it holds no reference back to the
cluster.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0


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


class NodeProcesses:
    """`count` redis-server processes, by node index; a killed or unstarted node is None or
    exited."""

    def __init__(self, server: str, count: int, root: Path) -> None:
        self.server = server
        self.root = root
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count

    def __len__(self) -> int:
        return len(self.procs)

    def node_dir(self, index: int) -> Path:
        return self.root / f"node{index}"

    def spawn(self, index: int, config: str) -> None:
        """Write the node's config and start it (no wait: the caller pings it)."""
        node_dir = self.node_dir(index)
        node_dir.mkdir(mode=0o700, exist_ok=True)
        config_file = node_dir / "redis.conf"
        config_file.touch(mode=0o600)  # holds the password
        config_file.write_text(config)
        with (node_dir / "redis.log").open("ab") as log:
            # only the config path on the command line: the password stays in the 0600 file
            self.procs[index] = subprocess.Popen(
                [self.server, str(config_file)], cwd=node_dir, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT)

    def running(self, index: int) -> bool:
        proc = self.procs[index]
        return proc is not None and proc.poll() is None

    def live(self) -> list[int]:
        return [i for i in range(len(self.procs)) if self.running(i)]

    def pid(self, index: int) -> int:
        proc = self.procs[index]
        if proc is None:
            raise RuntimeError(f"node {index} was never started")
        return proc.pid

    def kill(self, index: int) -> None:
        """SIGKILL one node and wait for the process to be gone (no-op if already down)."""
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)

    def log_tail(self, index: int, lines: int = 30) -> str:
        try:
            text = (self.node_dir(index) / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM every running node, SIGKILL what outlives STOP_TIMEOUT_S, remove the dir."""
        running = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
        shutil.rmtree(self.root, ignore_errors=True)
