"""Router configuration: YAML/JSON → validated ``RouterConfig``, built-in profiles included.

The layout follows the Inference Extension's EndpointPickerConfig::

    blockSize: 16
    plugins:
      - {name: prefix, type: precise-prefix-cache-scorer}
      - {name: queue, type: queue-scorer}
    schedulingProfiles:
      - name: mine
        plugins: [{pluginRef: prefix, weight: 3}, {pluginRef: queue, weight: 1}, {pluginRef: max-score}]

Built-in plugins and profiles (``BUILTIN_PLUGINS``, ``BUILTIN_PROFILES``) are always there; a
user entry with the same name replaces the built-in one. Loading is strict: unknown keys,
references to plugins that do not exist, scorers without a weight, weights on non-scorers, and
profiles without exactly one picker are all ``ValueError``s naming the culprit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvflow.hashing import HASH_ALGOS
from kvflow.router.plugins import REGISTRY, validate
from kvflow.endpoints import Endpoint, Role, parse_host_port


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class PluginSpec(_Strict):
    name: str
    type: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class PluginRef(_Strict):
    plugin_ref: str = Field(alias="pluginRef")
    weight: float | None = Field(default=None, ge=0)


class ProfileSpec(_Strict):
    name: str
    plugins: list[PluginRef]


class EndpointSpec(_Strict):
    address: str
    role: Role = Role.BOTH
    models: list[str] = Field(default_factory=list)
    kv_events: str | None = Field(default=None, alias="kvEvents")
    """This pod's ZMQ publisher, when not ``tcp://<host>:<kvEvents.port>``."""
    kv_events_replay: str | None = Field(default=None, alias="kvEventsReplay")
    """This pod's replay socket (vLLM's ``replay_endpoint``), asked for batches the router missed."""


class KubernetesSpec(_Strict):
    namespace: str = "default"
    inference_pool: str | None = Field(default=None, alias="inferencePool")
    """Read the selector and port from this InferencePool (the operator creates it)."""
    selector: dict[str, str] = Field(default_factory=dict)
    target_port: int = Field(default=8000, alias="targetPort")
    role_label: str = Field(default="llm-d.ai/role", alias="roleLabel")

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesSpec:
        if not self.selector and not self.inference_pool:
            raise ValueError("kubernetes needs a selector or an inferencePool")
        return self


class PoolSpec(_Strict):
    name: str = "default"
    model: str | None = None
    """The base model the pool serves (requests naming it, or one of ``loras``, are this pool's)."""
    loras: list[str] = Field(default_factory=list)
    """LoRA adapters the pods serve, by the names clients put in ``model``."""
    endpoints: list[EndpointSpec] = Field(default_factory=list)
    kubernetes: KubernetesSpec | None = None


class KvEventsSpec(_Strict):
    enabled: bool = True
    port: int = 5557
    """Each pod publishes on ``tcp://<pod host>:<port>`` (vLLM binds, the router connects)."""
    speculative_ttl: float = Field(default=2.0, alias="speculativeTtlSeconds", ge=0)
    """How long a routed request's blocks count as cached before KV events confirm them (0: off)."""
    data_parallel_size: int = Field(default=1, alias="dataParallelSize", ge=1, le=64)
    """Data-parallel ranks per pod: vLLM publishes each rank's events on ``port + rank``."""


class PdSpec(_Strict):
    enabled: bool = True
    threshold: int = Field(default=256, ge=0)
    """Disaggregate when more prompt tokens than this are uncached on the chosen decode pod."""
    prefill_profile: str | None = Field(default=None, alias="prefillProfile")
    """Profile that picks the prefill pod; by default the request's own profile."""


class ConfigSpec(_Strict):
    block_size: int = Field(default=16, alias="blockSize", gt=0)
    hash_seed: str = Field(default="0", alias="hashSeed")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(default="sha256", alias="hashAlgo")
    scrape_interval: float = Field(default=0.5, alias="scrapeIntervalSeconds", gt=0)
    """Seconds between scrapes of a pod with load (the router's own accounting fills the gaps)."""
    scrape_idle_interval: float = Field(default=2.0, alias="scrapeIdleIntervalSeconds", gt=0)
    """Seconds between scrapes of an idle pod."""
    stale_after: float = Field(default=1.0, alias="staleAfterSeconds", gt=0)
    """A pod that does not answer a scrape within this long drops out until one succeeds."""
    step_tokens: int = Field(default=256, alias="stepTokens", ge=0)
    """An engine step's fixed cost, in prompt tokens of prefill work (the TTFT estimate's unit)."""
    max_prompt_tokens: int | None = Field(default=None, alias="maxPromptTokens", gt=0)
    """Longest prompt scheduled (a 400 beyond); by default the pods' context length when the
    gateway learns it from ``/v1/models``, else ``DEFAULT_MAX_PROMPT_TOKENS``."""
    prefill_rate: float = Field(default=20_000.0, alias="prefillTokensPerSecond", gt=0)
    """A pod's prefill speed until its first tokens are observed (its queue drains at this rate)."""
    approx_capacity: int = Field(default=8192, alias="approxCapacityBlocks", gt=0)
    seed: int = 0
    lora_paths: dict[str, str] = Field(default_factory=dict, alias="loraPaths")
    """Adapter name → the path pods load it from: vLLM hashes both into LoRA blocks."""
    default_profile: str = Field(default="default", alias="defaultProfile")
    kv_events: KvEventsSpec = Field(default_factory=KvEventsSpec, alias="kvEvents")
    pd: PdSpec = Field(default_factory=PdSpec)
    pool: PoolSpec = Field(default_factory=PoolSpec)
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[ProfileSpec] = Field(default_factory=list, alias="schedulingProfiles")


DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
"""A million tokens: no model server takes more, and hashing more would hold the router for long."""

_FILTERS = ["model-filter", "healthy-filter"]
BUILTIN_PLUGINS: tuple[PluginSpec, ...] = tuple(
    PluginSpec(name=n, type=t)
    for n, t in [
        ("model-filter", "model-filter"),
        ("healthy-filter", "healthy-filter"),
        ("saturation-filter", "saturation-filter"),
        ("decode-filter", "role-filter"),
        ("prefill-filter", "role-filter"),
        ("prefix-approx", "prefix-cache-scorer"),
        ("prefix-precise", "precise-prefix-cache-scorer"),
        ("queue", "queue-scorer"),
        ("kv-cache", "kv-cache-utilization-scorer"),
        ("running", "running-requests-scorer"),
        ("active-requests", "active-request-scorer"),
        ("lora-affinity", "lora-affinity-scorer"),
        ("session-affinity", "session-affinity-scorer"),
        ("ttft", "ttft-scorer"),
        ("max-score", "max-score-picker"),
        ("weighted-random", "weighted-random-picker"),
        ("round-robin", "round-robin-picker"),
    ]
)
# role-filter needs its role parameter
BUILTIN_PLUGINS = tuple(
    p.model_copy(update={"parameters": {"role": p.name.split("-")[0]}}) if p.type == "role-filter" else p
    for p in BUILTIN_PLUGINS
)


def _profile(name: str, refs: list[str | tuple[str, float]]) -> ProfileSpec:
    plugins = [PluginRef(pluginRef=r) if isinstance(r, str) else PluginRef(pluginRef=r[0], weight=r[1]) for r in refs]
    return ProfileSpec(name=name, plugins=plugins)


_GUARDED = [*_FILTERS, "saturation-filter"]
BUILTIN_PROFILES: tuple[ProfileSpec, ...] = (
    _profile("round-robin", [*_FILTERS, "round-robin"]),
    _profile("least-load", [*_GUARDED, ("queue", 1), ("kv-cache", 1), ("active-requests", 1), "max-score"]),
    _profile("prefix-approx", [*_GUARDED, ("prefix-approx", 2), ("kv-cache", 1), ("queue", 1), "max-score"]),
    _profile("prefix-precise", [*_GUARDED, ("prefix-precise", 2), ("kv-cache", 1), ("queue", 1), "max-score"]),
    _profile(
        "default",
        [
            *_GUARDED,
            ("ttft", 4),
            ("kv-cache", 1),
            ("lora-affinity", 1),
            ("session-affinity", 1),
            "max-score",
        ],
    ),
)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    block_size: int = 16
    hash_seed: str = "0"
    hash_algo: str = "sha256"
    scrape_interval: float = 0.5
    scrape_idle_interval: float = 2.0
    stale_after: float = 1.0
    step_tokens: int = 256
    prefill_rate: float = 20_000.0
    max_prompt_tokens: int | None = None
    approx_capacity: int = 8192
    seed: int = 0
    lora_paths: Mapping[str, str] = field(default_factory=dict)
    default_profile: str = "default"
    kv_events_enabled: bool = True
    kv_events_port: int = 5557
    speculative_ttl: float = 2.0
    kv_events_ranks: int = 1
    pd_enabled: bool = True
    pd_threshold: int = 256
    pd_prefill_profile: str | None = None
    pool_name: str = "default"
    model: str | None = None
    loras: frozenset[str] = frozenset()
    endpoints: tuple[Endpoint, ...] = ()
    kv_event_endpoints: Mapping[str, str] = field(default_factory=dict)
    """Endpoint id → ZMQ address, where it is not the default."""
    kv_replay_endpoints: Mapping[str, str] = field(default_factory=dict)
    """Endpoint id → the pod's KV-event replay address, where it has one."""
    kubernetes: KubernetesSpec | None = None
    plugins: Mapping[str, PluginSpec] = field(default_factory=dict)
    profiles: Mapping[str, ProfileSpec] = field(default_factory=dict)

    def kv_events_address(self, endpoint: Endpoint) -> str:
        return self.kv_event_endpoints.get(endpoint.id) or f"tcp://{endpoint.host}:{self.kv_events_port}"

    def kv_events_addresses(self, endpoint: Endpoint) -> tuple[str, ...]:
        """Every publisher of the pod: one per data-parallel rank, on consecutive ports."""
        if endpoint.id in self.kv_event_endpoints or self.kv_events_ranks == 1:
            return (self.kv_events_address(endpoint),)
        return tuple(f"tcp://{endpoint.host}:{self.kv_events_port + rank}" for rank in range(self.kv_events_ranks))


def load_config(source: str | Path | Mapping[str, Any] | None = None) -> RouterConfig:
    """A file path (YAML or JSON), a mapping, or None for the built-ins alone."""
    raw = read_source(source)
    try:
        spec = ConfigSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid router config: {problems}") from None
    assert spec.hash_algo in HASH_ALGOS
    plugins = {p.name: p for p in BUILTIN_PLUGINS} | _unique("plugin", spec.plugins)
    profiles = {p.name: p for p in BUILTIN_PROFILES} | _unique("profile", spec.scheduling_profiles)
    for plugin in plugins.values():
        validate(plugin.name, plugin.type, plugin.parameters)
    for profile in profiles.values():
        _check_profile(profile, plugins)
    for ref in (spec.default_profile, spec.pd.prefill_profile):
        if ref is not None and ref not in profiles:
            raise ValueError(f"unknown profile {ref!r} (profiles: {', '.join(sorted(profiles))})")
    endpoints = tuple(_endpoint(e) for e in spec.pool.endpoints)
    return RouterConfig(
        block_size=spec.block_size,
        hash_seed=spec.hash_seed,
        hash_algo=spec.hash_algo,
        scrape_interval=spec.scrape_interval,
        scrape_idle_interval=spec.scrape_idle_interval,
        stale_after=spec.stale_after,
        step_tokens=spec.step_tokens,
        prefill_rate=spec.prefill_rate,
        max_prompt_tokens=spec.max_prompt_tokens,
        approx_capacity=spec.approx_capacity,
        seed=spec.seed,
        lora_paths=dict(spec.lora_paths),
        default_profile=spec.default_profile,
        kv_events_enabled=spec.kv_events.enabled,
        kv_events_port=spec.kv_events.port,
        speculative_ttl=spec.kv_events.speculative_ttl,
        kv_events_ranks=spec.kv_events.data_parallel_size,
        pd_enabled=spec.pd.enabled,
        pd_threshold=spec.pd.threshold,
        pd_prefill_profile=spec.pd.prefill_profile,
        pool_name=spec.pool.name,
        model=spec.pool.model,
        loras=frozenset(spec.pool.loras) | frozenset(spec.lora_paths),
        endpoints=endpoints,
        kv_event_endpoints={_endpoint(e).id: e.kv_events for e in spec.pool.endpoints if e.kv_events},
        kv_replay_endpoints={_endpoint(e).id: e.kv_events_replay for e in spec.pool.endpoints if e.kv_events_replay},
        kubernetes=spec.pool.kubernetes,
        plugins=plugins,
        profiles=profiles,
    )


def read_source(source: str | Path | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"invalid router config {path}: expected a mapping at the top level")
    return data


def _unique(what: str, items: list[Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for item in items:
        if item.name in seen:
            raise ValueError(f"duplicate {what} name {item.name!r}")
        seen[item.name] = item
    return seen


def _check_profile(profile: ProfileSpec, plugins: Mapping[str, PluginSpec]) -> None:
    pickers = 0
    for ref in profile.plugins:
        spec = plugins.get(ref.plugin_ref)
        if spec is None:
            raise ValueError(f"profile {profile.name!r}: unknown plugin {ref.plugin_ref!r}")
        ptype = REGISTRY.get(spec.type)
        if ptype is None:
            raise ValueError(f"plugin {spec.name!r}: unknown type {spec.type!r} (known: {', '.join(sorted(REGISTRY))})")
        if ptype.kind == "scorer" and ref.weight is None:
            raise ValueError(f"profile {profile.name!r}: scorer {ref.plugin_ref!r} needs a weight")
        if ptype.kind != "scorer" and ref.weight is not None:
            raise ValueError(f"profile {profile.name!r}: {ptype.kind} {ref.plugin_ref!r} takes no weight")
        pickers += ptype.kind == "picker"
    if pickers != 1:
        raise ValueError(f"profile {profile.name!r}: needs exactly one picker, has {pickers}")


def _endpoint(spec: EndpointSpec) -> Endpoint:
    host, port = parse_host_port(spec.address)
    return Endpoint(host, port, role=spec.role, models=frozenset(spec.models))
