"""More free KV cache scores higher: ``1 - usage``, with usage as scraped
(``vllm:kv_cache_usage_perc``) moved by the tokens this router sent or finished since
(``EndpointView.kv_usage``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.router.framework import Cycle, Scores
from kvflow.router.load import VECTOR_MIN
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


@register("kv-cache-utilization-scorer", "scorer")
class KvCacheScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Scores:
        if len(endpoints) >= VECTOR_MIN:  # every pod at once, from the load numbers' columns
            loads = cycle.loads(endpoints).columns
            free = 1.0 - loads.kv_base - loads.tokens * loads.kv_per_token
            return Scores(endpoints, np.minimum(np.maximum(free, 0.0), 1.0))
        out = []
        for c in cycle.numbers(endpoints):  # ``EndpointView.kv_usage`` inlined
            free = 1.0 - c.kv_base - c.tokens * c.kv_per_token
            out.append(0.0 if free < 0.0 else 1.0 if free > 1.0 else free)
        return Scores(endpoints, out)
