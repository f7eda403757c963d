"""A one-line progress bar on stderr (bytes done in the unit that fits the total, rate and ETA),
and ``size`` for the one-line summaries the command prints."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def _unit(n: float) -> tuple[str, float]:
    return next(((name, scale) for name, scale in _UNITS if n >= scale), ("B", 1.0))


def size(n: float, unit_of: float | None = None) -> str:
    """``n`` bytes as "812 B", "1.05 MB", "3.20 GB": in the unit that fits ``unit_of`` (default ``n``)."""
    name, scale = _unit(n if unit_of is None else unit_of)
    return f"{n:.0f} B" if name == "B" else f"{n / scale:.2f} {name}"


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
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
            f"\r{self.label}: {size(self.done, self.total)} / {size(self.total)} ({pct:5.1f}%) "
            f"{size(rate)}/s  ETA {clock(eta)}"
        )
        self.stream.flush()

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


__all__ = ["clock", "Progress", "size"]
