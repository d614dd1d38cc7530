"""Pick at random in proportion to score (zero scores only when nothing else is left)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.max_score import PickerParams
from kvflow.router.plugins.registry import PluginContext, register


@register("weighted-random-picker", "picker")
class WeightedRandomPicker:
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: PluginContext) -> None:
        self.name = name
        self.max_targets = params.max_targets

    def pick(self, cycle: Cycle, scored: Sequence[tuple[EndpointView, float]]) -> list[EndpointView]:
        pool = list(scored)
        order: list[EndpointView] = []
        while pool and len(order) < self.max_targets:
            weights = [max(s, 0.0) for _, s in pool]
            if sum(weights) <= 0:
                weights = [1.0] * len(pool)
            i = cycle.rng.choices(range(len(pool)), weights=weights)[0]
            order.append(pool.pop(i)[0])
        return order
