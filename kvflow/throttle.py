"""A warning that says so at most once per interval: for what untrusted peers can repeat at will.

A pod that sends a broken KV-event batch or unreadable metrics every few milliseconds must not
flood the router's log (or slow it down writing it); the first occurrence is logged, later ones
are counted and summarised in the next line that gets through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ThrottledLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``key`` was logged less than ``interval`` ago; True if logged."""
        now = self.clock()
        if now < self._next.get(key, float("-inf")):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._next[key] = now + self.interval
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (and %d more like it since the last report)"
            args = (*args, suppressed)
        self.logger.warning(message, *args)
        return True
