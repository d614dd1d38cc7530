"""Keep endpoints under their queue limit, and sheddable requests off full KV caches; when no
endpoint is left, shed only what may be shed.

Like the Inference Extension's saturation detector: the pool is saturated when every pod is over
its limits, and then a sheddable request (priority below 0: batch lines, or what an API key or
the priority header marks so) is told to retry later (429), since adding it only grows queues.
Any other request is still sent, among every pod, and queues on the model server, as vLLM queues
what it cannot run yet: refusing it would lose a request the pool will serve in a moment.

A full KV cache (``kvCacheLimit``) moves only sheddable requests. Under load a pod's cache fills
with the prompts it is running, and the pods that fill first are the homes of the busiest
prefixes: dropping them sent each of their requests where its prefix was not, to compute it
again (and evict another's), so past the knee the router kept the load even and lost its hits.
A request on a full pod waits in its queue, which the TTFT scorer prices; the KV-cache scorer
still prefers free KV among pods that price alike. The queue limit still filters every request:
a pod that far behind is no home for anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from kvflow.errors import RateLimitError
from kvflow.router.framework import Cycle
from kvflow.router.load import VECTOR_MIN
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


class SaturationParams(NoParams):
    queue_limit: int = Field(default=128, alias="queueLimit", ge=0)
    kv_limit: float = Field(default=0.99, alias="kvCacheLimit", gt=0, le=1)
    retry_after: float = Field(default=1.0, alias="retryAfterSeconds", ge=0)


@register("saturation-filter", "filter")
class SaturationFilter:
    Params = SaturationParams

    def __init__(self, name: str, params: SaturationParams, ctx: PluginContext) -> None:
        self.name = name
        self.p = params

    def saturated(self, ep: EndpointView) -> bool:
        return ep.queue > self.p.queue_limit or ep.kv_usage >= self.p.kv_limit

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        # ``saturated`` inlined, with queue and KV use from the pods' load numbers: for a few pods
        # one by one, for many from their columns at once
        queue_limit = self.p.queue_limit
        # A full KV cache moves only a sheddable request (see the module's docstring).
        kv_limit = self.p.kv_limit if cycle.request.priority < 0 else math.inf
        if len(endpoints) < VECTOR_MIN:
            kept = [ep for ep, c in zip(endpoints, cycle.numbers(endpoints))
                    if c.prefilling + c.foreign_waiting <= queue_limit and c.kv_base + c.tokens * c.kv_per_token < kv_limit]
        else:
            candidates = cycle.loads(endpoints)
            loads = candidates.columns
            keep = ((loads.prefilling + loads.foreign_waiting <= queue_limit)
                    & (loads.kv_base + loads.tokens * loads.kv_per_token < kv_limit))
            if keep.all():
                return endpoints
            kept = [ep for ep, k in zip(endpoints, keep.tolist()) if k]
            cycle.set_loads(candidates.subset(keep, kept))
        if endpoints and not kept:
            if cycle.request.priority >= 0:
                return endpoints  # not sheddable: it waits on a pod, not on the client's retry
            raise RateLimitError("every endpoint is saturated; retry later", retry_after=self.p.retry_after)
        return endpoints if len(kept) == len(endpoints) else kept
