"""The progress lines on stderr: one per finished measurement, with position and a time estimate."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    """One line per finished measurement, with position and a time estimate, on stderr.

    ``total`` is the planned work in (estimated) seconds; each :meth:`step` adds its weight to what is done."""

    def __init__(self, total: float = 0.0, stream: IO[str] | None = None) -> None:
        self.total = max(total, 1e-9)
        self.done = 0.0
        self.start = time.monotonic()
        self.stream = stream or sys.stderr

    def plan(self, total: float) -> None:
        """Set the planned total, once it is known."""
        self.total = max(total, 1e-9)

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.start
        self.stream.write(f"[{clock(elapsed)}] {text}\n")
        self.stream.flush()

    def step(self, weight: float, text: str) -> None:
        self.done += weight
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        pct = min(100.0, 100 * self.done / self.total)
        self.stream.write(f"[{clock(elapsed)} {pct:3.0f}% ~{clock(left)} left] {text}\n")
        self.stream.flush()


def clock(seconds: float) -> str:
    """``m:ss``."""
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"
