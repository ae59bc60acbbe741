"""PoolProcess: a pool daemon in a child process (start, SIGKILL, restart).

It runs `kvconnector pool serve` (as `python -m kvconnector.cli.pool pool serve`) with the
child's log in a file, and waits for its "serving at" line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvconnector.servers.child import ChildServer
from transfer.shared.protocol import socket_path


class PoolProcess(ChildServer):
    """One daemon process for pool `name`; the name (and socket) stay across kill/start."""

    label = "pool daemon"
    ready_line = re.compile(r"serving at")
    start_timeout_s = 60.0

    def __init__(self, log_path: str | Path, name: str, capacity: str = "16MiB",
                 slot_bytes: str = "64KiB", eviction: str = "lru") -> None:
        super().__init__(log_path)
        self.name = name
        self.args = ["--name", name, "--capacity", capacity, "--slot-bytes", slot_bytes,
                     "--eviction", eviction]
        self.path = socket_path(name)

    def command(self) -> list[str]:
        """What runs the daemon (a subclass may run it otherwise)."""
        return [sys.executable, "-m", "kvconnector.cli.pool", "pool", "serve", *self.args]
