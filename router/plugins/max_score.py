"""Highest total score wins; ties broken at random (seeded per request), fallbacks follow."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from pydantic import Field

from kvflow.router.framework import Cycle, tie_break
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


_SORT_MAX = 256
"""Up to this many endpoints the k-th best score is found by sorting them all (in C): quicker
than ``heapq.nlargest``, a Python loop, until a pool of several hundred."""


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
        # Ranked by (score to 9 decimals, the cycle's i-th tie-break draw, i): a random tie-break.
        # Rounding and drawing are the slow parts, so with many endpoints only those that can
        # reach the top ``max_targets`` are rounded, and the draws are computed only when two
        # rounded scores tie (distinct scores order the same without them).
        n, seed = len(scored), cycle.seed
        first = cycle.tie_breaks(n)
        scores = [s for _, s in scored]
        contenders: Sequence[int] = range(n)
        if n > 8 and n > self.max_targets and math.isfinite(sum(scores)):  # NaN or inf: rank everyone
            k = self.max_targets
            kth = sorted(scores, reverse=True)[k - 1] if n <= _SORT_MAX else heapq.nlargest(k, scores)[-1]
            floor = round(kth, 9)
            floor -= 1e-9 + abs(floor) * 1e-12  # round(s, 9) >= that rounded floor needs s >= this
            contenders = [i for i, s in enumerate(scores) if s >= floor]
        rounded = [round(scores[i], 9) for i in contenders]
        if len(set(rounded)) == len(rounded):
            ranked = sorted(zip(rounded, contenders), reverse=True)
            return [scored[i][0] for _, i in ranked[: self.max_targets]]
        keyed = sorted(((r, tie_break(seed, first + i), i) for r, i in zip(rounded, contenders)), reverse=True)
        return [scored[i][0] for _, _, i in keyed[: self.max_targets]]
