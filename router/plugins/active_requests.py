"""Fewer requests in flight from this router scores higher.

Unlike scraped metrics this count is exact and current, which is what keeps load even when
requests arrive faster than the scrape interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.router.framework import Cycle, min_max_inverse
from kvflow.router.load import VECTOR_MIN
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


@register("active-request-scorer", "scorer")
class ActiveRequestScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        if len(endpoints) >= VECTOR_MIN:
            in_flight = cycle.loads(endpoints).columns.in_flight.tolist()
        else:
            in_flight = [c.in_flight for c in cycle.numbers(endpoints)]
        return min_max_inverse({ep.id: n for ep, n in zip(endpoints, in_flight)})
