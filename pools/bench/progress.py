"""A one-line text progress bar per workload step, on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``W1 pooled no-op 2/3 [########------------]  2500/5000  3.1 s``, redrawn in place.

    On a terminal the line is redrawn at most every 0.2 s; elsewhere (a log file) only the
    first and the final state are written.
    """

    width = 30

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._drawn = 0.0
        self._tty = self.stream.isatty()
        self.stream.write(self._line(0) + ("" if self._tty else "\n"))
        self.stream.flush()

    def _line(self, done: int) -> str:
        filled = round(self.width * min(done, self.total) / self.total)
        return (
            f"{self.label:<34} [{'#' * filled}{'-' * (self.width - filled)}] "
            f"{done:>7}/{self.total:<7} {time.monotonic() - self.started:6.1f} s"
        )

    def update(self, done: int) -> None:
        """Redraw with ``done`` steps finished."""
        now = time.monotonic()
        if self._tty and now - self._drawn >= 0.2:
            self._drawn = now
            self.stream.write("\r" + self._line(done))
            self.stream.flush()

    def finish(self, done: int, note: str = "") -> None:
        """Draw the final state and end the line."""
        prefix = "\r" if self._tty else ""
        self.stream.write(prefix + self._line(done) + (f"  {note}" if note else "") + "\n")
        self.stream.flush()
