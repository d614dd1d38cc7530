"""More free KV cache scores higher: ``1 - usage``, with usage as scraped
(``vllm:kv_cache_usage_perc``) moved by the tokens this router sent or finished since
(``EndpointView.kv_usage``)."""

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
        return {ep.id: 1.0 - ep.kv_usage for ep in endpoints}
