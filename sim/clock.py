"""The clock the simulator's engine keeps its timeline on, injectable so tests control time.

``Clock.now()`` is a monotonic reading in seconds; ``sleep_until(deadline)`` returns once
``now() >= deadline`` (or, for a real event loop, within ``resolution`` of it: uvloop's timers
tick in whole milliseconds and may fire up to one tick early).

``FakeClock`` is virtual time: it moves only when told (``set``/``advance``), or, for an engine
started on it, jumps straight to each deadline the engine sleeps towards, so a whole run takes
no wall time and every timestamp is exact.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    resolution: float
    """How early ``sleep_until`` may return: a deadline this close counts as reached."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class MonotonicClock:
    """``time.monotonic`` (sub-microsecond; uvloop's ``loop.time()`` ticks in whole milliseconds)."""

    resolution = 0.001

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))


class FakeClock:
    resolution = 0.0

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"a monotonic clock cannot go back from {self._now} to {t}")
        self._now = t

    def advance(self, seconds: float) -> None:
        self.set(self._now + seconds)

    async def sleep_until(self, deadline: float) -> None:
        """Jump to ``deadline`` (virtual time), then let other tasks run once."""
        self._now = max(self._now, deadline)
        await asyncio.sleep(0)
