"""Each endpoint in turn, ignoring scores: what a plain Kubernetes Service gives you."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.max_score import PickerParams
from kvflow.router.plugins.registry import PluginContext, register


@register("round-robin-picker", "picker")
class RoundRobinPicker:
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: PluginContext) -> None:
        self.name = name
        self.max_targets = params.max_targets
        self.next = 0

    def pick(self, cycle: Cycle, scored: Sequence[tuple[EndpointView, float]]) -> list[EndpointView]:
        eps = sorted((ep for ep, _ in scored), key=lambda ep: ep.id)
        start = self.next % len(eps)
        self.next += 1
        return (eps[start:] + eps[:start])[: self.max_targets]
