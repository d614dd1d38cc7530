"""Keep endpoints that serve the requested model (or LoRA adapter).

An endpoint's models are what its config says, else what its metrics report; an endpoint that
declares none serves anything (a pool serves one base model). A LoRA request prefers pods that
list the adapter; when no pod lists it, any pod may load it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


def served(ep: EndpointView) -> frozenset[str]:
    return ep.endpoint.models or ep.metrics.models


@register("model-filter", "filter")
class ModelFilter:
    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        model = cycle.request.model
        lora = cycle.request.lora
        if model:
            endpoints = [
                ep
                for ep in endpoints
                if not (models := ep.endpoint.models or ep.metrics.models) or model in models or model == lora
            ]
        if lora:
            listing = [ep for ep in endpoints if lora in served(ep)]
            return listing or endpoints
        return endpoints
