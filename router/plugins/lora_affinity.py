"""LoRA affinity: a pod already running the adapter is best, one with a free adapter slot next.

Scores as the Inference Extension's lora-affinity scorer: active (running or waiting) 1.0,
room to load it 0.8, otherwise 0. A pod whose ``/v1/models`` does not list the adapter
(``EndpointView.adapters``) has nothing to put in a slot: 0. For requests without an adapter
it abstains (every pod alike).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId

ACTIVE, ROOM, FULL = 1.0, 0.8, 0.0


def lora_score(ep: EndpointView, lora: str) -> float:
    m = ep.metrics
    if lora in m.running_loras or lora in m.waiting_loras:
        return ACTIVE
    if ep.adapters is not None and lora not in ep.adapters and lora not in ep.endpoint.models:
        return FULL  # not loaded there: vLLM would not serve it
    if m.max_loras == 0 or len(m.running_loras | m.waiting_loras) < m.max_loras:
        return ROOM
    return FULL


@register("lora-affinity-scorer", "scorer")
class LoraAffinityScorer:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        lora = cycle.request.lora
        if not lora:
            return {}  # every pod alike: the scorer abstains
        return {ep.id: lora_score(ep, lora) for ep in endpoints}
