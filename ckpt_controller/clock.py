"""Time sources: monotonic seconds for durations and deadlines, wall seconds for people.

Everything that waits or stamps takes a ``Clock`` so tests can inject ``ManualClock`` and
make timeout paths fast and exact. Neighbours: used by ``lifecycle`` and ``agent``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class Clock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class ManualClock(Clock):
    """A clock that moves only when told to; ``sleep`` advances it instantly."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))


@dataclass(frozen=True)
class Deadline:
    """A point on a clock's monotonic axis; ``None`` seconds means no deadline."""

    at: float | None
    clock: Clock

    @classmethod
    def after(cls, seconds: float | None, clock: Clock) -> "Deadline":
        return cls(None if seconds is None else clock.monotonic() + seconds, clock)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` when unbounded."""
        if self.at is None:
            return None
        return max(0.0, self.at - self.clock.monotonic())

    def passed(self) -> bool:
        return self.at is not None and self.clock.monotonic() >= self.at

    def earlier(self, other: "Deadline") -> "Deadline":
        """Whichever of the two comes first (an unbounded one never does)."""
        if self.at is None:
            return other
        if other.at is None or self.at <= other.at:
            return self
        return other
