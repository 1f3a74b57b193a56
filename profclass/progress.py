"""Progress on stderr for long loads, nsys exports and report exports (rich).

Shown only when stderr is a terminal and ``--quiet`` is off, so pipes, CI logs and JSON
consumers never see it. The pipeline calls ``progress(message, fraction=None)`` as each
stage starts; a fraction (files loaded, nsys's own export percentage) fills the bar, and
without one the bar pulses.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when the bar is shown (a terminal, not --quiet)
    from rich.console import Console
    from rich.progress import Progress


class Reporter:
    """Context manager; the object itself is the ``progress`` callback (a no-op when off)."""

    def __init__(self, enabled: bool, console: Console | None = None):
        self.enabled = enabled
        self._console = console
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> Reporter:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn,
                                       TimeElapsedColumn)
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      TaskProgressColumn(), TimeElapsedColumn(),
                                      console=self._console or Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self

    def __call__(self, message: str, fraction: float | None = None) -> None:
        if self._progress is None:
            return
        if fraction is None:
            self._progress.update(self._task, description=message, total=None, completed=0)
        else:
            self._progress.update(self._task, description=message, total=1.0,
                                  completed=min(max(float(fraction), 0.0), 1.0))

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def reporter(quiet: bool, stream=None) -> Reporter:
    """A Reporter that is on only when ``stream`` (stderr) is a terminal and not quiet."""
    stream = stream or sys.stderr
    return Reporter(enabled=not quiet and hasattr(stream, "isatty") and stream.isatty())
