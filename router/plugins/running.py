"""Fewer running requests scores higher (min-max over the candidates)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.router.framework import Cycle, min_max_inverse
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


@register("running-requests-scorer", "scorer")
class RunningRequestsScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        return min_max_inverse({ep.id: float(ep.metrics.running) for ep in endpoints})
