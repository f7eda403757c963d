"""A one-line progress bar on stderr: bytes done, rate and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """``advance(nbytes)`` as work completes; redraws at most every ``interval`` s; ``close()`` ends the line."""

    def __init__(self, total: int, label: str, *, quiet: bool = False, stream: TextIO | None = None,
                 interval: float = 0.25):
        self.total, self.label, self.quiet = max(total, 1), label, quiet
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0
        self.skipped = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def advance(self, nbytes: int, *, skipped: bool = False) -> None:
        """Count ``nbytes`` as done; ``skipped`` bytes (resumed parts) do not count toward the rate."""
        self.done += nbytes
        if skipped:
            self.skipped += nbytes
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        if self.quiet:
            return
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.skipped) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        pct = 100.0 * self.done / self.total
        self.stream.write(
            f"\r{self.label}: {_gb(self.done)} / {_gb(self.total)} ({pct:5.1f}%) "
            f"{rate / 1e6:8.1f} MB/s  ETA {_clock(eta)}"
        )
        self.stream.flush()

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


__all__ = ["Progress"]
