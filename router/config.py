"""Router configuration: YAML/JSON → one frozen, validated ``RouterConfig``, built-ins included.

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

``RouterConfig`` is both the file's schema (camelCase aliases, nested sections) and what the
router reads: the flat names it reads (``pd_threshold``, ``endpoints``, ``plugins`` with the
built-ins, ...) are read-only views of those sections, not copies. ``load_config`` builds it:
pydantic checks each field, ``load_config`` the references between them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvflow.hashing import HASH_ALGOS
from kvflow.router.plugins import REGISTRY, validate
from kvflow.router.working_set import DEFAULT_WINDOW
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
    predict_evictions: bool = Field(default=True, alias="predictEvictions")
    """Count a prefix's blocks as gone from a pod once a cacheful of other blocks was sent there
    after them (the pod's cache is LRU, and frees a request's last block first), before the pod's
    ``BlockRemoved`` says so (``WorkingSet.surviving``).
    On pods that offload KV to vLLM's native CPU tier, a match it cuts goes on as that tier's
    (``prefix_cache.offloaded_matches``); turn it off for pods that offload with LMCache, whose
    tier sends no events the router reads."""
    data_parallel_size: int = Field(default=1, alias="dataParallelSize", ge=1, le=64)
    """Data-parallel ranks per pod: vLLM publishes each rank's events on ``port + rank``."""


class PeersSpec(_Strict):
    """Router replicas of one pool telling each other what they routed (``router/peers.py``)."""

    port: int = Field(default=0, ge=0, le=65535)
    """Where this replica publishes what it routes (0: it has no peers)."""
    addresses: tuple[str, ...] = ()
    """The other replicas' ``HOST:PORT`` (its own address may be among them: it is skipped)."""
    service: str | None = None
    """A DNS name that resolves to every replica (a headless Service), re-read every
    ``resolveSeconds``; each address it names is a peer at ``port``."""
    resolve_seconds: float = Field(default=5.0, alias="resolveSeconds", gt=0)
    key_file: str | None = Field(default=None, alias="keyFile")
    """The key the replicas share: it signs their messages and keys their block fingerprints
    alike, so that each one's fingerprints name the same blocks."""

    @property
    def enabled(self) -> bool:
        return self.port > 0

    @model_validator(mode="after")
    def _complete(self) -> PeersSpec:
        if self.enabled and not self.key_file:
            raise ValueError("peers.port is set but peers.keyFile is not: replicas must share a key")
        if not self.enabled and (self.addresses or self.service):
            raise ValueError("peers.addresses or peers.service is set but peers.port is not")
        for address in self.addresses:
            parse_host_port(address)
        return self


class PdSpec(_Strict):
    enabled: bool = True
    threshold: int = Field(default=256, ge=0)
    """Disaggregate when more prompt tokens than this are uncached on the chosen decode pod."""
    prefill_profile: str | None = Field(default=None, alias="prefillProfile")
    """Profile that picks the prefill pod; by default the request's own profile."""


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
    plugins = [PluginRef(plugin_ref=r) if isinstance(r, str) else PluginRef(plugin_ref=r[0], weight=r[1]) for r in refs]
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


class RouterConfig(_Strict):
    """The router's configuration, as the file spells it and as the router reads it."""

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
    working_set_window: float = Field(default=DEFAULT_WINDOW, alias="workingSetSeconds", gt=0)
    """A pod's cache in use: the prompt blocks its requests touched in this many seconds."""
    prefill_rate: float = Field(default=20_000.0, alias="prefillTokensPerSecond", gt=0)
    """A pod's prefill speed until its first tokens are observed (its queue drains at this rate)."""
    approx_capacity: int = Field(default=8192, alias="approxCapacityBlocks", gt=0)
    seed: int = 0
    lora_paths: dict[str, str] = Field(default_factory=dict, alias="loraPaths")
    """Adapter name → the path pods load it from: vLLM hashes both into LoRA blocks."""
    adapters_interval: float = Field(default=5.0, alias="adaptersIntervalSeconds", gt=0)
    """Seconds between asks of a LoRA pod's ``/v1/models`` for the adapters it has loaded."""
    default_profile: str = Field(default="default", alias="defaultProfile")
    kv_events: KvEventsSpec = Field(default_factory=KvEventsSpec, alias="kvEvents")
    pd: PdSpec = Field(default_factory=PdSpec)
    peers: PeersSpec = Field(default_factory=PeersSpec)
    pool: PoolSpec = Field(default_factory=PoolSpec)
    user_plugins: tuple[PluginSpec, ...] = Field(default=(), alias="plugins")
    """The file's ``plugins``; ``plugins`` below adds the built-ins."""
    scheduling_profiles: tuple[ProfileSpec, ...] = Field(default=(), alias="schedulingProfiles")
    """The file's profiles; ``profiles`` below adds the built-ins."""

    # -- views the router reads: derived from the sections above, never stored twice -------

    @property
    def kv_events_enabled(self) -> bool:
        return self.kv_events.enabled

    @property
    def kv_events_port(self) -> int:
        return self.kv_events.port

    @property
    def speculative_ttl(self) -> float:
        return self.kv_events.speculative_ttl

    @property
    def predict_evictions(self) -> bool:
        return self.kv_events.predict_evictions

    @property
    def kv_events_ranks(self) -> int:
        return self.kv_events.data_parallel_size

    @property
    def pd_enabled(self) -> bool:
        return self.pd.enabled

    @property
    def pd_threshold(self) -> int:
        return self.pd.threshold

    @property
    def pd_prefill_profile(self) -> str | None:
        return self.pd.prefill_profile

    @property
    def pool_name(self) -> str:
        return self.pool.name

    @property
    def model(self) -> str | None:
        return self.pool.model

    @property
    def kubernetes(self) -> KubernetesSpec | None:
        return self.pool.kubernetes

    @cached_property
    def loras(self) -> frozenset[str]:
        """Adapters the pool serves: those it lists and those it has paths for."""
        return frozenset(self.pool.loras) | frozenset(self.lora_paths)

    @cached_property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(_endpoint(e) for e in self.pool.endpoints)

    @cached_property
    def kv_event_endpoints(self) -> Mapping[str, str]:
        """Endpoint id → ZMQ address, where it is not the default."""
        return {ep.id: spec.kv_events for ep, spec in zip(self.endpoints, self.pool.endpoints) if spec.kv_events}

    @cached_property
    def kv_replay_endpoints(self) -> Mapping[str, str]:
        """Endpoint id → the pod's KV-event replay address, where it has one."""
        return {ep.id: spec.kv_events_replay for ep, spec in zip(self.endpoints, self.pool.endpoints)
                if spec.kv_events_replay}

    @cached_property
    def plugins(self) -> Mapping[str, PluginSpec]:
        """Every plugin by name: the built-ins, replaced or joined by the file's."""
        return {p.name: p for p in BUILTIN_PLUGINS} | _unique("plugin", self.user_plugins)

    @cached_property
    def profiles(self) -> Mapping[str, ProfileSpec]:
        """Every profile by name: the built-ins, replaced or joined by the file's."""
        return {p.name: p for p in BUILTIN_PROFILES} | _unique("profile", self.scheduling_profiles)

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
        config = RouterConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid router config: {problems}") from None
    assert config.hash_algo in HASH_ALGOS
    plugins, profiles = config.plugins, config.profiles  # duplicate names fail here
    for plugin in plugins.values():
        validate(plugin.name, plugin.type, plugin.parameters)
    for profile in profiles.values():
        _check_profile(profile, plugins)
    for ref in (config.default_profile, config.pd_prefill_profile):
        if ref is not None and ref not in profiles:
            raise ValueError(f"unknown profile {ref!r} (profiles: {', '.join(sorted(profiles))})")
    _ = config.endpoints  # every address parsed now: one that is not HOST:PORT fails the load
    return config


def read_source(source: str | Path | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise ValueError(f"cannot read router config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid router config {path}: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"invalid router config {path}: expected a mapping at the top level")
    return data


def _unique(what: str, items: Iterable[Any]) -> dict[str, Any]:
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
