"""Drop endpoints whose last scrape failed, went stale, or that the gateway marked failed."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.per_list import PerList
from kvflow.router.plugins.registry import NoParams, PluginContext, register


@register("healthy-filter", "filter")
class HealthyFilter:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self._healthy = PerList(_healthy)  # health is part of the frozen views

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        return self._healthy(endpoints)


def _healthy(endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
    healthy = [ep for ep in endpoints if ep.healthy]
    return endpoints if len(healthy) == len(endpoints) else healthy
