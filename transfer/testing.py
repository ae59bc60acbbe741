"""Test helper: a server in a child process (the block store, the pool daemon) stopped on exit.

Subclasses start the child (setting `process`, its stdout a pipe) in `start`.
"""

from __future__ import annotations

import signal
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Python 3.11's typing; annotations are not evaluated at run time
    from typing import Self

STOP_TIMEOUT_S = 10.0


class ChildServer:
    """kill / stop / context manager over `process`, the child a subclass's `start` made."""

    process: subprocess.Popen[bytes] | None = None

    def start(self) -> object:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye to the clients."""
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

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
