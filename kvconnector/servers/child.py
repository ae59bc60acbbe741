"""ChildServer: one server in a child process, started, waited for, stopped, killed.

The store server, the raw baseline server, the pool daemon and each Redis Cluster node run
through it. A start is a launch (the command, its output appended to a log file) then a wait
until the child serves: a line it prints on stdout, or a check the caller polls (a PING, a
connect). A child that exits first or does not serve in time is killed, and the error quotes
its log. A stop is SIGTERM, then SIGKILL for a child that lingers.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Python 3.11's typing; annotations are not evaluated at run time
    from typing import Self

# Python children import this very tree (kvconnector, transfer), wherever the parent found it.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 40
_POLL_S = 0.05
_READ_WAIT_S = 0.2


class ChildServer:
    """A server run as `command()` in a child process; subclasses say what and how it is ready.

    `ready_line`: a pattern the child prints on stdout once it serves; stdout is then a pipe and
    `start` returns the match. Without one, stdout goes to the log with stderr, and the caller
    waits with a check of its own (`launch`, then `wait_ready(check)`). `log_path` None leaves
    the child's output on the parent's. `start` after `kill` runs the command again.
    """

    label = "server"  # names the child in errors
    ready_line: re.Pattern[str] | None = None
    start_timeout_s = 60.0

    def __init__(self, log_path: str | Path | None, *, cwd: Path | None = None) -> None:
        self.log_path = None if log_path is None else Path(log_path)
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None
        self._terminating = False  # SIGTERM sent to this process already (sent once)

    def command(self) -> list[str]:
        """What runs the server (argv)."""
        raise NotImplementedError

    def start(self) -> re.Match[str] | None:
        """Launch and wait for `ready_line`; returns its match (None without a ready line)."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Run the command without waiting (a previous run's pipe is closed)."""
        self._close_pipe()
        python_path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        # PYTHONSAFEPATH (Python >= 3.11): `python -m` puts no working directory ahead of that,
        # so a copy of the tree there (a checkout beside the one running) is never imported
        env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1",
               "PYTHONSAFEPATH": "1"}
        log = None if self.log_path is None else self.log_path.open("ab")
        try:
            stdout = subprocess.PIPE if self.ready_line is not None else log
            self.process = subprocess.Popen(self.command(), cwd=self.cwd,
                                            stdin=subprocess.DEVNULL, stdout=stdout,
                                            stderr=log, env=env)
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        self._terminating = False

    def wait_ready(self, check: Callable[[], bool] | None = None) -> re.Match[str] | None:
        """Wait until the child serves: its `ready_line` (the match is returned), or `check()`
        true. RuntimeError, the child killed, if it exits first or takes over start_timeout_s."""
        process, pattern = self._started(), self.ready_line
        if check is None and (pattern is None or process.stdout is None):
            raise ValueError(f"{self.label}: no ready line, so a check to wait with is needed")
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if check is not None:
                if check():
                    return None
                time.sleep(_POLL_S)
            elif select.select([process.stdout], [], [], _READ_WAIT_S)[0]:
                match = pattern.search(process.stdout.readline().decode(errors="replace"))
                if match:
                    return match
            if process.poll() is not None:
                problem = f"exited with code {process.returncode} during startup"
                break
            if time.monotonic() > deadline:
                problem = f"did not serve within {self.start_timeout_s:.0f} s"
                break
        self.kill()
        raise RuntimeError(f"{self.label} {problem}: {' '.join(map(str, process.args))}; "
                           f"log:\n{self.log_tail()}")

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        return self._started().pid

    def kill(self) -> None:
        """SIGKILL and wait: no cleanup, no goodbye to the clients (no-op if not running)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def terminate(self) -> None:
        """SIGTERM, once, without waiting (several children stop together)."""
        if self.process is not None and self.process.poll() is None and not self._terminating:
            self.process.send_signal(signal.SIGTERM)
            self._terminating = True

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL past STOP_TIMEOUT_S); the exit code (None: never started)."""
        if self.process is None:
            return None
        self.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_pipe()
        return self.process.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the child's log ("(no log)" where there is none yet)."""
        if self.log_path is None:
            return "(no log: the child's output went to this process's)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError(f"{self.label} was never started")
        return self.process

    def _close_pipe(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
