"""Highest total score wins; ties broken at random (seeded per request), fallbacks follow."""

from __future__ import annotations

import heapq
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
        # A random second key breaks ties; nlargest keeps this O(n) for a thousand endpoints.
        rand = cycle.rng.random
        keyed = [(round(score, 9), rand(), i) for i, (_, score) in enumerate(scored)]
        return [scored[i][0] for _, _, i in heapq.nlargest(self.max_targets, keyed)]
