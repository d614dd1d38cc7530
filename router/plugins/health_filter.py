"""Drop endpoints whose last scrape failed, went stale, or that the gateway marked failed."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


@register("healthy-filter", "filter")
class HealthyFilter:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self._last: tuple[Sequence[EndpointView], Sequence[EndpointView]] | None = None

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        # health is part of the frozen views: the same list of them gets the same answer
        if self._last is None or self._last[0] is not endpoints:
            healthy = [ep for ep in endpoints if ep.healthy]
            self._last = (endpoints, endpoints if len(healthy) == len(endpoints) else healthy)
        return self._last[1]
