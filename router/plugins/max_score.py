"""Highest total score wins; ties broken at random (seeded per request), fallbacks follow."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from pydantic import Field

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


class PickerParams(NoParams):
    max_targets: int = Field(default=3, alias="maxTargets", ge=1)
    """The pick plus fallbacks handed to Envoy / the gateway."""


@register("max-score-picker", "picker")
class MaxScorePicker:
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: PluginContext) -> None:
        self.name = name
        self.max_targets = params.max_targets

    def pick(self, cycle: Cycle, scored: Sequence[tuple[EndpointView, float]]) -> list[EndpointView]:
        # Ranked by (score to 9 decimals, the i-th draw of the cycle's generator, i): a random
        # tie-break. The draws are taken in one call and decoded only for endpoints that can
        # reach the top ``max_targets``; rounding, the slow part, is done only for those too.
        n = len(scored)
        if n <= 8:  # too few to be worth the shortcut below; the same ranking
            rand = cycle.rng.random
            keyed = [(round(score, 9), rand(), i) for i, (_, score) in enumerate(scored)]
            return [scored[i][0] for _, _, i in heapq.nlargest(self.max_targets, keyed)]
        draws = cycle.rng.getrandbits(64 * n)  # leaves the generator where n random() calls would
        scores = [s for _, s in scored]
        contenders: Sequence[int] = range(n)
        if n > self.max_targets and math.isfinite(sum(scores)):  # NaN or inf: rank everyone
            floor = round(heapq.nlargest(self.max_targets, scores)[-1], 9)
            floor -= 1e-9 + abs(floor) * 1e-12  # round(s, 9) >= that rounded floor needs s >= this
            contenders = [i for i, s in enumerate(scores) if s >= floor]
        keyed = [(round(scores[i], 9), nth_random(draws, i), i) for i in contenders]
        return [scored[i][0] for _, _, i in heapq.nlargest(self.max_targets, keyed)]


def nth_random(draws: int, i: int) -> float:
    """What the i-th ``random()`` would have returned, from ``getrandbits(64 * n)``: CPython's
    ``random()`` is two 32-bit outputs, (a >> 5) * 2**26 + (b >> 6) over 2**53, and
    ``getrandbits`` stores successive outputs from the least significant word up."""
    pair = draws >> (64 * i)
    a, b = (pair & 0xFFFFFFFF) >> 5, ((pair >> 32) & 0xFFFFFFFF) >> 6
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)
