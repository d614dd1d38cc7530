"""Plugin factories by type name, with strict parameter parsing.

A plugin file defines a class and registers it::

    @register("queue-scorer", "scorer")
    class QueueScorer: ...

The class is built as ``cls(name, params, ctx)``; ``params`` went through the class's
``Params`` pydantic model (unknown keys are errors), ``ctx`` holds the pool-wide state some
plugins read (the prefix indexes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvflow.router.load import LoadCounter
from kvflow.router.per_list import PerList
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex, SpeculativeIndex
from kvflow.endpoints import EndpointId

Kind = Literal["filter", "scorer", "picker"]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


@dataclass(frozen=True, slots=True)
class PluginContext:
    approx: ApproxPrefixIndex
    precise: PrefixIndex
    speculative: SpeculativeIndex | None = None
    """Recently routed blocks not yet confirmed by KV events (read by the precise scorer)."""
    event_sources: frozenset[EndpointId] | set[EndpointId] = frozenset()
    """Endpoints whose KV events have been heard: for the others the precise scorer falls back
    to the approximate index rather than assume an empty cache."""
    step_tokens: int = 256
    """An engine step's fixed cost in prompt tokens of prefill work (``RouterConfig.step_tokens``)."""
    predict_evictions: bool = True
    """Cut a pod's precise match where its LRU cache has since been filled by other blocks sent
    there (``RouterConfig.predict_evictions``)."""
    counters: PerList[dict[EndpointId, LoadCounter]] = field(
        default_factory=lambda: PerList(lambda views: {ep.id: ep.counter for ep in views})
    )
    """Each candidate's load counter by id, kept while the pool's list of views comes back."""


@dataclass(frozen=True, slots=True)
class PluginType:
    type: str
    kind: Kind
    cls: Any


REGISTRY: dict[str, PluginType] = {}


def register(type_name: str, kind: Kind) -> Callable[[Any], Any]:
    def deco(cls: Any) -> Any:
        if type_name in REGISTRY:
            raise ValueError(f"plugin type {type_name!r} registered twice")
        REGISTRY[type_name] = PluginType(type_name, kind, cls)
        cls.plugin_type = type_name
        return cls

    return deco


def validate(name: str, type_name: str, params: Mapping[str, Any] | None) -> tuple[PluginType, BaseModel]:
    """The plugin's type and parsed parameters; a ValueError naming the plugin otherwise."""
    try:
        ptype = REGISTRY[type_name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"plugin {name!r}: unknown type {type_name!r} (known: {known})") from None
    model: type[BaseModel] = getattr(ptype.cls, "Params", NoParams)
    try:
        return ptype, model.model_validate(dict(params or {}))
    except ValidationError as exc:
        raise ValueError(f"plugin {name!r} ({type_name}): bad parameters: {_short(exc)}") from None


def build(name: str, type_name: str, params: Mapping[str, Any] | None, ctx: PluginContext) -> tuple[Kind, Any]:
    ptype, parsed = validate(name, type_name, params)
    return ptype.kind, ptype.cls(name, parsed, ctx)


def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
