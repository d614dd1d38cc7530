"""Keep endpoints that serve the requested model (or LoRA adapter).

An endpoint's models are what its config says, else what its metrics report; an endpoint that
declares none serves anything (a pool serves one base model).

A LoRA request goes only to pods that have the adapter: those whose config lists it, or whose
``/v1/models`` lists it as loaded (``EndpointView.adapters``, learned by the scraper). vLLM does
not load an adapter a request names (it answers 404 unless a LoRA resolver plugin is installed),
so a pod known to lack it is no candidate. Pods not known either way (LoRA metrics absent, or
``/v1/models`` not asked yet) are the fallback when no pod is known to have it, as before the
router learned adapters: a pool whose pods say nothing still routes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.per_list import PerList
from kvflow.router.plugins.registry import NoParams, PluginContext, register


def served(ep: EndpointView) -> frozenset[str]:
    return ep.endpoint.models or ep.metrics.models


def has_adapter(ep: EndpointView, lora: str) -> bool | None:
    """Whether the pod has ``lora`` loaded: True, False, or None when the router cannot tell."""
    if lora in served(ep):
        return True
    return None if ep.adapters is None else lora in ep.adapters


@register("model-filter", "filter")
class ModelFilter:
    MEMO = 64
    """(model, adapter) pairs whose result is kept per candidate list."""

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self._answers: PerList[dict[tuple[str, str | None], Sequence[EndpointView]]] = PerList(lambda _: {})
        """Per list of views (frozen), the answer for each (model, adapter): computed once per list
        and name, not once per request (over a thousand pods the answer is real work)."""

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        answers = self._answers(endpoints)
        key = (cycle.request.model, cycle.request.lora)
        found = answers.get(key)
        if found is None:
            if len(answers) >= self.MEMO:
                answers.clear()
            found = answers[key] = self._filter(*key, endpoints)
        return found

    @staticmethod
    def _filter(model: str, lora: str | None, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if model:
            serving = [
                ep
                for ep in endpoints
                if not (models := ep.endpoint.models or ep.metrics.models) or model in models or model == lora
            ]
            endpoints = endpoints if len(serving) == len(endpoints) else serving
        if lora:
            known = [has_adapter(ep, lora) for ep in endpoints]
            having = [ep for ep, has in zip(endpoints, known, strict=True) if has]
            return having or [ep for ep, has in zip(endpoints, known, strict=True) if has is None]
        return endpoints
