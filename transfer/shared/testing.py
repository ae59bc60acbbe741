"""Test helper: a pool daemon in a child process (start, SIGKILL, restart).

PoolProcess runs `kvconnector pool serve` (as `python -m kvconnector.cli.pool pool serve`) with
the child's log in a file, and waits for its "serving" line.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from transfer.shared.protocol import socket_path

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class PoolProcess:
    """One daemon process for pool `name`; the name (and socket) stay across kill/start."""

    def __init__(self, log_path: str | Path, name: str, capacity: str = "16MiB",
                 slot_bytes: str = "64KiB", eviction: str = "lru") -> None:
        self.log_path = Path(log_path)
        self.name = name
        self.args = ["--name", name, "--capacity", capacity, "--slot-bytes", slot_bytes,
                     "--eviction", eviction]
        self.path = socket_path(name)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.process is not None:
            self.process.stdout.close()  # the previous run's pipe
        command = [sys.executable, "-m", "kvconnector.cli.pool", "pool", "serve", *self.args]
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

    def kill(self) -> None:
        """SIGKILL: no cleanup (the socket file and the segment stay behind)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it lingers); returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process.stdout.close()
        return self.process.returncode

    def __enter__(self) -> PoolProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
