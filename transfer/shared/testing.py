"""Test helper: a pool daemon in a child process (start, SIGKILL, restart).

PoolProcess runs `kvconnector pool serve` (as `python -m kvconnector.cli.pool pool serve`) with
the child's log in a file, and waits for its "serving" line.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from transfer.shared.protocol import socket_path
from transfer.testing import ChildServer

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
START_TIMEOUT_S = 60.0


class PoolProcess(ChildServer):
    """One daemon process for pool `name`; the name (and socket) stay across kill/start."""

    def __init__(self, log_path: str | Path, name: str, capacity: str = "16MiB",
                 slot_bytes: str = "64KiB", eviction: str = "lru") -> None:
        self.log_path = Path(log_path)
        self.name = name
        self.args = ["--name", name, "--capacity", capacity, "--slot-bytes", slot_bytes,
                     "--eviction", eviction]
        self.path = socket_path(name)
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """What runs the daemon (a subclass may run it otherwise)."""
        return [sys.executable, "-m", "kvconnector.cli.pool", "pool", "serve", *self.args]

    def start(self) -> None:
        if self.process is not None:
            self.process.stdout.close()  # the previous run's pipe
        command = self.command()
        path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log,
                                            env={**os.environ, "PYTHONPATH": path,
                                                 "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.process.stdout], [], [], 0.2)
            if readable and b"serving at" in self.process.stdout.readline():
                return
            if self.process.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"pool daemon did not start: {' '.join(command)}; log:\n"
                           f"{self.log_path.read_text(errors='replace')[-4000:]}")
