"""Where a `kvconnector bench` run is: rich's live bar on a terminal; elsewhere (a log file, CI),
one line per unit of work (a case's layout, a remote row) with the time so far and an estimate
of the time left, so a run whose output is not a terminal is never silent until its end.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any


def clock(seconds: float) -> str:
    """0:07, 1:32, 1:02:03."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class BenchProgress:
    """`next(description)` ends the unit under way (if any) and starts the next one."""

    def __init__(self, console: Any, units: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._console = console
        self._lines = not console.is_terminal
        # units take seconds to a minute: estimate from the whole run, not rich's last 30 s
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), console=console, transient=True,
                                  disable=self._lines, speed_estimate_period=24 * 3600)
        self._task = self._progress.add_task("", total=units)
        self._started = False

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()
        if exc_type is None and self._lines:
            self._console.print(f"done in {clock(self._progress.tasks[0].elapsed or 0.0)}",
                                highlight=False, soft_wrap=True)

    def next(self, description: str) -> None:
        if self._started:
            self._progress.advance(self._task)
        self._started = True
        self._progress.update(self._task, description=description)
        if not self._lines:
            return
        task = self._progress.tasks[0]
        elapsed = task.elapsed or 0.0
        # the mean time per finished unit so far, times the units left (this one included)
        left = ("estimating" if not task.completed else
                f"about {clock(elapsed / task.completed * (task.remaining or 0))} left")
        self._console.print(f"[{task.completed + 1:.0f}/{task.total:.0f}] {description} "
                            f"({clock(elapsed)} so far, {left})", highlight=False, markup=False,
                            soft_wrap=True)
