"""Time sources. Policy code never reads the system clock directly, so tests never sleep."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful (buckets, leases)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, UTC (budget periods: days and months)."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock tests move by hand; wall time moves with it."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_780_000_000.0) -> None:
        self._now = start
        self._wall = wall_start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        self._wall += seconds
