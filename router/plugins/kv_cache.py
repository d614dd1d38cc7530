"""More free KV cache scores higher: ``1 - usage``, with usage as scraped
(``vllm:kv_cache_usage_perc``) moved by the tokens this router sent or finished since
(``EndpointView.kv_usage``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle, Scores
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


@register("kv-cache-utilization-scorer", "scorer")
class KvCacheScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Scores:
        out = []
        for ep in endpoints:  # ``EndpointView.kv_usage`` inlined: runs for every endpoint
            c = ep.counter
            free = 1.0 - c.kv_base - c.tokens * c.kv_per_token
            out.append(0.0 if free < 0.0 else 1.0 if free > 1.0 else free)
        return Scores(endpoints, out)
