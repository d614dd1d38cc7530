"""More free KV cache scores higher: ``1 - vllm:kv_cache_usage_perc``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


@register("kv-cache-utilization-scorer", "scorer")
class KvCacheScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        return {ep.id: 1.0 - ep.metrics.kv_usage for ep in endpoints}
