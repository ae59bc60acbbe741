"""StoreProcess: a store server in a child process (start, SIGKILL, restart on the same port).

It runs `python -m kvconnector.cli.store store serve ...` (the `kvconnector store serve` command
without the torch import) on a free loopback port, its log in a file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvconnector.servers.child import ChildServer

_LIMITED_FDS = ("import resource, runpy, sys; "
                "resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
                "sys.argv[:2] = [sys.argv[1]]; "
                "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


class StoreProcess(ChildServer):
    """One store server process; `url` stays the same across `kill()` and `start()`."""

    label = "store server"
    ready_line = re.compile(r"listening on (tcp://\S+)")
    start_timeout_s = 120.0  # the CLI imports torch: on a loaded 2-core machine that took 30 s

    def __init__(self, log_path: str | Path, capacity: str = "256MiB",
                 security_args: tuple[str, ...] = ("--security", "none"),
                 extra_args: tuple[str, ...] = (), fd_limit: int | None = None) -> None:
        super().__init__(log_path)
        self.fd_limit = fd_limit  # the child's RLIMIT_NOFILE, soft and hard (None: inherited)
        self.capacity = capacity
        self.security_args = tuple(security_args)
        self.extra_args = tuple(extra_args)
        self.url: str | None = None

    def command(self) -> list[str]:
        listen = self.url or "tcp://127.0.0.1:*"  # after a kill: the same port again
        command = [sys.executable, "-m", "kvconnector.cli.store", "store", "serve", "--listen",
                   listen, "--capacity", self.capacity, *self.security_args, *self.extra_args]
        if self.fd_limit:  # the same module, run after lowering the descriptor limit
            command[1:3] = ["-c", _LIMITED_FDS.format(limit=self.fd_limit),
                            "kvconnector.cli.store"]
        return command

    def start(self) -> str:
        """Start the server (on the same port as before, after a kill); returns its URL."""
        match = super().start()
        assert match is not None  # a ready line was asked for
        self.url = match.group(1)
        return self.url
