"""The clock the simulator's engine keeps its timeline on, injectable so tests control time.

``Clock.now()`` is a monotonic reading in seconds; ``sleep_until(deadline)`` returns once
``now() >= deadline`` (or, for a real event loop, within ``resolution`` of it: uvloop's timers
tick in whole milliseconds and may fire up to one tick early).

``FakeClock`` is virtual time: it moves only when told (``set``/``advance``), or, by default,
jumps straight to each deadline a task sleeps towards, so an engine started on it runs a whole
timeline in no wall time and every timestamp is exact. With ``jump=False`` a sleeper waits until
``set``/``advance`` reach its deadline instead: the clock a test steps for several components at
once (two pods' KV transfers, whose leases and heartbeats must not move time for each other).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
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

    def __init__(self, start: float = 0.0, *, jump: bool = True) -> None:
        self._now = start
        self.jump = jump
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []  # a heap by deadline
        self._order = itertools.count()  # equal deadlines wake in the order they slept

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        """Move time to ``t``; sleepers whose deadline it reaches wake (when the caller next awaits)."""
        if t < self._now:
            raise ValueError(f"a monotonic clock cannot go back from {self._now} to {t}")
        self._now = t
        while self._sleepers and self._sleepers[0][0] <= t:
            _, _, woken = heapq.heappop(self._sleepers)
            if not woken.done():  # a cancelled sleeper's future is done already
                woken.set_result(None)

    def advance(self, seconds: float) -> None:
        self.set(self._now + seconds)

    @property
    def sleepers(self) -> int:
        """Tasks waiting for a deadline (``jump=False``): 0 when nothing runs a timer."""
        return sum(not woken.done() for _, _, woken in self._sleepers)

    async def sleep_until(self, deadline: float) -> None:
        """With ``jump``, move time to ``deadline``; else wait until ``set`` does. Then let other
        tasks run once."""
        if self.jump or deadline <= self._now:
            self._now = max(self._now, deadline)
            await asyncio.sleep(0)
            return
        woken = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline, next(self._order), woken))
        await woken
