"""Shorter waiting queue scores higher (min-max over the candidates, as the EPP does).

The queue is ``EndpointView.queue``: this router's requests with no first token yet (live), plus
other routers' waiting requests as last scraped, so a burst that lands between two scrapes does
not pile onto one pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.router.framework import Cycle, min_max_inverse
from kvflow.router.load import VECTOR_MIN
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


@register("queue-scorer", "scorer")
class QueueScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        # ``EndpointView.queue``, from the cycle's load numbers: a column each for many pods
        if len(endpoints) >= VECTOR_MIN:
            c = cycle.loads(endpoints).columns
            queue = (c.prefilling + c.foreign_waiting).tolist()
        else:
            queue = [c.prefilling + c.foreign_waiting for c in cycle.numbers(endpoints)]
        return min_max_inverse({ep.id: q for ep, q in zip(endpoints, queue)})
