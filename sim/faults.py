"""Faults a test can inject into a simulated pod, from flags or at run time (``/_sim/faults``).

* ``fail_rate`` — this fraction of requests gets a 500 error (OpenAI error JSON) at once.
* ``stall_after_tokens`` — a response stops after this many tokens and hangs (the engine still
  finishes the request; the client sees a stalled stream until it gives up).
* ``slow_factor`` — every step takes this many times longer.
* ``crash_after_requests`` — the process exits (code 1, no traceback) when this request arrives;
  ``{"crash": true}`` crashes at once.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvflow.errors import InvalidRequestError


@dataclass(slots=True)
class Faults:
    fail_rate: float = 0.0
    stall_after_tokens: int | None = None
    slow_factor: float = 1.0
    crash_after_requests: int | None = None

    def update(self, patch: dict[str, Any]) -> None:
        """Apply a partial update; unknown keys or bad values are a 400, applied all or nothing."""
        known = {f.name for f in fields(self)} | {"crash"}
        unknown = sorted(set(patch) - known)
        if unknown:
            raise InvalidRequestError(f"unknown fault(s): {', '.join(unknown)}")
        new = Faults(**{**asdict(self), **{k: v for k, v in patch.items() if k != "crash"}})
        new.validate()
        for f in fields(self):
            setattr(self, f.name, getattr(new, f.name))

    def validate(self) -> None:
        if not isinstance(self.fail_rate, int | float) or not 0.0 <= self.fail_rate <= 1.0:
            raise InvalidRequestError("fail_rate must be a number in [0, 1]")
        if not isinstance(self.slow_factor, int | float) or self.slow_factor <= 0:
            raise InvalidRequestError("slow_factor must be a positive number")
        for name in ("stall_after_tokens", "crash_after_requests"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidRequestError(f"{name} must be a non-negative integer or null")

    def should_fail(self, rng: random.Random) -> bool:
        return self.fail_rate > 0 and rng.random() < self.fail_rate

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
