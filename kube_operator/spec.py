"""The ``LLMService`` spec as typed, validated pydantic models (the operator's edge).

The CRD's OpenAPI schema (``charts/kvflow/crds/llmservices.kvflow.io.yaml``) rejects most bad
specs at admission; these models repeat those rules and add the ones a schema cannot express
(flags the operator owns, duplicate adapter names, unknown scorers). A spec that fails here is
reported as the ``Degraded`` condition with reason ``InvalidSpec``; nothing is applied.

Field names are camelCase on the wire (as in the CRD) and snake_case in Python.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel

GROUP = "kvflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMService"
PLURAL = "llmservices"

SpecPool = Literal["prefill", "decode"]
"""The spec's two pool sections. ``decode`` is the pool that serves every request: with no prefill
replicas it is an aggregated pool (role ``both``), else the decode half of a P/D pair."""
SPEC_POOLS: tuple[SpecPool, ...] = ("prefill", "decode")
PoolRole = Literal["prefill", "decode", "both"]
"""A rendered pool's role, in the router's words (``kvflow.io/role``, ``llm-d.ai/role``)."""

# Flags the operator sets itself; passing them through extraArgs would silently fight it (or,
# like --block-size and --prefix-caching-hash-algo, desync the router's block hashes).
MANAGED_ENGINE_FLAGS = frozenset({
    "--port", "--host", "--served-model-name", "--kv-transfer-config", "--kv-events-config",
    "--tensor-parallel-size", "--data-parallel-size", "--max-model-len", "--lora-modules",
    "--block-size", "--enable-prefix-caching", "--prefix-caching-hash-algo", "--enable-lora",
    "--model", "--tokenizer", "--revision", "--data-parallel-size-local", "--data-parallel-rank",
    "--data-parallel-start-rank", "--data-parallel-address", "--data-parallel-rpc-port",
    "--pipeline-parallel-size", "--enable-expert-parallel", "--headless", "--load-format",
    "--kv-offloading-size", "--kv-offloading-backend",
})
# vLLM's short aliases (vllm/engine/arg_utils.py) of flags above.
ENGINE_FLAG_ALIASES = {
    "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size", "-dpl": "--data-parallel-size-local",
    "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank", "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port", "-pp": "--pipeline-parallel-size", "-ep": "--enable-expert-parallel",
}
# Environment the operator sets in engine pods; the spec may not set them again.
OWNED_ENV = frozenset({"POD_NAME", "POD_NAMESPACE", "PYTHONHASHSEED", "HF_HOME",
                       "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT",
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING"})
# Labels that select pods (Deployments, Services, the InferencePool, the router's P/D pairing):
# a podTemplate that changed them would orphan or mis-route pods.
PROTECTED_LABELS = frozenset({
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "kvflow.io/service", "kvflow.io/role", "kvflow.io/engine", "kvflow.io/revision", "llm-d.ai/role",
})


def engine_flag(arg: str) -> str | None:
    """The long flag an engine argument sets, as vLLM's parser reads it: ``--max_model_len=8``,
    ``-tp``, ``--kv-transfer-config.kv_role=x`` and ``--no-enable-prefix-caching`` all name the
    flag they change; None for a value."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
        if name.startswith("--no-"):
            name = "--" + name[5:]
    return ENGINE_FLAG_ALIASES.get(name, name)


# Router profiles an LLMService can name (kvflow.router.config.BUILTIN_PROFILES; a test keeps
# them equal). ``default`` is the profile `make up` runs and the routing benchmark measures.
BUILTIN_PROFILES = ("default", "prefix-precise", "prefix-approx", "least-load", "round-robin")
CUSTOM_PROFILE = "custom"  # the router profile rendered from routing.plugins
# The Inference Extension's own endpoint picker (routing.picker gie), at the release whose
# InferencePool (inference.networking.k8s.io/v1) and EndpointPickerConfig the operator renders.
GIE_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
SOURCE_SCHEMES = ("hf", "s3", "gs", "pvc", "oci")
OBJECT_STORES = ("s3", "gs")  # vLLM streams these with --load-format runai_streamer
_SOURCE_RE = re.compile(r"^(hf|s3|gs|pvc|oci)://[^\s]+$")
_ADAPTER_SOURCE_RE = re.compile(r"^(hf|pvc|oci)://[^\s]+$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# Resource names that are not accelerators: anything else in a pool's resources is one.
PLAIN_RESOURCES = ("cpu", "memory", "ephemeral-storage")
DEFAULT_ACCELERATOR = "nvidia.com/gpu"


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
    )


def _replaced(value: object, old: str, new: str) -> None:
    """A field the spec no longer takes: refused with what replaces it (never silently dropped)."""
    if value is not None:
        raise ValueError(f"{old} is replaced by {new}")


class LoraAdapter(_Model):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    source: str

    @pydantic.field_validator("source")
    @classmethod
    def _source_scheme(cls, value: str) -> str:
        if not _ADAPTER_SOURCE_RE.match(value):
            raise ValueError(f"adapter source {value!r} must start with hf://, pvc:// or oci://")
        return value


class ModelSpec(_Model):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    source: str
    revision: str | None = None
    lora_adapters: tuple[LoraAdapter, ...] = ()
    # Where the router finds the served model's tokenizer; default: the model's own source.
    tokenizer: str | None = None
    # A Secret whose keys become the engine's environment (HF_TOKEN; AWS_ACCESS_KEY_ID,
    # AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; GOOGLE_APPLICATION_CREDENTIALS...).
    credentials_secret: Annotated[str | None, Field(pattern=_DNS_NAME, max_length=253)] = None
    # A PersistentVolumeClaim for the Hugging Face cache of an hf:// model (default: emptyDir).
    cache_pvc: Annotated[str | None, Field(alias="cachePVC", pattern=_DNS_NAME, max_length=253)] = None
    # Or let the operator create one (ReadWriteMany, shared by every engine pod of the service).
    cache_size: Annotated[str | None, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")] = None
    cache_storage_class: Annotated[str | None, Field(pattern=_DNS_NAME, max_length=253)] = None

    @pydantic.field_validator("source", "tokenizer")
    @classmethod
    def _source_scheme(cls, value: str | None) -> str | None:
        if value is not None and not _SOURCE_RE.match(value):
            raise ValueError(f"model source {value!r} must start with hf://, s3://, gs://, pvc:// or oci://")
        return value

    @pydantic.field_validator("tokenizer")
    @classmethod
    def _tokenizer_readable(cls, value: str | None) -> str | None:
        if value is not None and value.split("://", 1)[0] in OBJECT_STORES:
            raise ValueError("model.tokenizer must be hf://, pvc:// or oci:// (the router reads it)")
        return value

    @pydantic.model_validator(mode="after")
    def _cache_for_hub_models(self) -> ModelSpec:
        if (self.cache_pvc or self.cache_size) and self.scheme != "hf":
            raise ValueError("model.cachePVC and model.cacheSize hold a hub download cache: they need an hf:// source")
        if self.cache_pvc and self.cache_size:
            raise ValueError("model.cachePVC names an existing claim, model.cacheSize has one created: set one")
        if self.cache_storage_class and not self.cache_size:
            raise ValueError("model.cacheStorageClass needs model.cacheSize")
        return self

    @pydantic.field_validator("lora_adapters")
    @classmethod
    def _unique_adapters(cls, value: tuple[LoraAdapter, ...]) -> tuple[LoraAdapter, ...]:
        names = [adapter.name for adapter in value]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate LoRA adapter names: {', '.join(duplicates)}")
        return value

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        return self.source.split("://", 1)[1]


class Parallelism(_Model):
    """vLLM's parallelism of one engine (a pod, or a multi-node group of pods).

    ``data`` ranks in all, ``dataLocal`` of them per pod: ``data / dataLocal`` pods form one
    engine (a LeaderWorkerSet group, as llm-d's wide-EP deployments run it). Each pod holds
    ``tensor * pipeline * dataLocal`` accelerators.
    """

    tensor: Annotated[int, Field(ge=1, le=64)] = 1
    data: Annotated[int, Field(ge=1, le=1024)] = 1
    data_local: Annotated[int | None, Field(ge=1, le=64)] = None
    pipeline: Annotated[int, Field(ge=1, le=64)] = 1
    expert: bool = False

    @pydantic.model_validator(mode="after")
    def _ranks_divide(self) -> Parallelism:
        if self.data_local is not None and (self.data_local > self.data or self.data % self.data_local):
            raise ValueError(f"parallelism.dataLocal ({self.data_local}) must divide parallelism.data ({self.data})")
        return self

    @property
    def local_ranks(self) -> int:
        return self.data_local or self.data

    @property
    def nodes(self) -> int:
        return self.data // self.local_ranks

    @property
    def devices(self) -> int:
        """Accelerators each pod needs."""
        return self.tensor * self.pipeline * self.local_ranks


class ParallelismOverride(_Model):
    tensor: Annotated[int | None, Field(ge=1, le=64)] = None
    data: Annotated[int | None, Field(ge=1, le=1024)] = None
    data_local: Annotated[int | None, Field(ge=1, le=64)] = None
    pipeline: Annotated[int | None, Field(ge=1, le=64)] = None
    expert: bool | None = None


def _check_extra_args(value: tuple[str, ...], where: str) -> tuple[str, ...]:
    clashes = sorted({arg for arg in value if engine_flag(arg) in MANAGED_ENGINE_FLAGS})
    if clashes:
        raise ValueError(
            f"{where} must not set {', '.join(clashes)}: the operator sets "
            f"{', '.join(sorted({engine_flag(a) or a for a in clashes}))} from the spec "
            "(use the matching spec field instead)")
    return value


def _check_env(value: tuple[dict[str, Any], ...], where: str) -> tuple[dict[str, Any], ...]:
    names = []
    for item in value:
        if not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"every {where} entry needs a name")
        names.append(item["name"])
    _check_env_names(names, where)
    return value


class EngineSpec(_Model):
    kind: Literal["vllm", "sim"] = "vllm"
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    enable_prefix_caching: bool = True
    parallelism: Parallelism = Parallelism()
    # The extended resource each pod's accelerators are asked as: nvidia.com/gpu, amd.com/gpu,
    # google.com/tpu, ... or "none" (CPU engines). Default: the one a pool's resources name,
    # else nvidia.com/gpu for vLLM and none for the simulator.
    accelerator: Annotated[str | None, Field(pattern=r"^(none|([a-z0-9.-]+/)?[a-z0-9][-a-z0-9_.]*)$")] = None
    # GiB of CPU memory per pod for KV blocks the accelerator evicts (vLLM's --kv-offloading-size,
    # native backend); added to the pod's memory request and limit.
    kv_offloading_size: Annotated[float | None, Field(gt=0, le=4096, alias="kvOffloadingGiB")] = None
    block_size: Annotated[int, Field(ge=1, le=256)] = 16
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    tensor_parallel_size: int | None = None  # replaced: refused with a message
    data_parallel_size: int | None = None  # replaced: refused with a message

    @pydantic.field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _check_extra_args(value, "engine.extraArgs")

    @pydantic.field_validator("env")
    @classmethod
    def _env_names(cls, value: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        return _check_env(value, "engine.env")

    @pydantic.model_validator(mode="after")
    def _replaced_fields(self) -> EngineSpec:
        _replaced(self.tensor_parallel_size, "engine.tensorParallelSize", "engine.parallelism.tensor")
        _replaced(self.data_parallel_size, "engine.dataParallelSize", "engine.parallelism.data")
        return self


class EngineOverride(_Model):
    """One pool's changes to the shared ``engine``: parallelism field by field, extra arguments
    after the shared ones (vLLM's parser keeps a repeated flag's last value), env merged by name."""

    parallelism: ParallelismOverride = ParallelismOverride()
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    accelerator: Annotated[str | None, Field(pattern=r"^(none|([a-z0-9.-]+/)?[a-z0-9][-a-z0-9_.]*)$")] = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    kv_offloading_size: Annotated[float | None, Field(gt=0, le=4096, alias="kvOffloadingGiB")] = None

    @pydantic.field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _check_extra_args(value, "engine.extraArgs of a pool")

    @pydantic.field_validator("env")
    @classmethod
    def _env_names(cls, value: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        return _check_env(value, "engine.env of a pool")


def _check_env_names(names: list[str], where: str) -> None:
    owned = sorted(set(names) & OWNED_ENV)
    if owned:
        raise ValueError(f"{where} must not set {', '.join(owned)}: the operator sets it in every engine pod")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{where} names {', '.join(duplicates)} more than once")


class PoolAutoscaling(_Model):
    # 0 only with KEDA (autoscaling.mode keda): the gateway holds requests and its held-request
    # gauge wakes the pool; with no pods there is no engine metric to scale back up on.
    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 4

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> PoolAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas ({self.max_replicas})")
        return self


ENGINE_CONTAINER = "engine"


class PodTemplateOverride(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    spec: dict[str, Any] = Field(default_factory=dict)

    @pydantic.field_validator("labels")
    @classmethod
    def _no_selector_labels(cls, value: dict[str, str]) -> dict[str, str]:
        taken = sorted(set(value) & PROTECTED_LABELS)
        if taken:
            raise ValueError(f"podTemplate.labels must not set {', '.join(taken)}: the operator selects pods by it")
        return value

    @pydantic.field_validator("spec")
    @classmethod
    def _no_owned_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        for container in value.get("containers") or []:
            if not isinstance(container, dict):
                continue
            name = container.get("name")
            env = [e.get("name") for e in container.get("env") or [] if isinstance(e, dict)]
            _check_env_names([n for n in env if isinstance(n, str)], f"podTemplate container {name!r} env")
            if name == ENGINE_CONTAINER:
                # The operator renders the engine's command line from the spec: an override would
                # silently replace every flag it manages (ports, parallelism, KV events, ...).
                for field, instead in (("command", "engine.kind and engine.image"),
                                       ("args", "engine.extraArgs"), ("image", "engine.image")):
                    if field in container:
                        raise ValueError(f"podTemplate.spec.containers[{ENGINE_CONTAINER}].{field} is owned "
                                         f"by the operator: use {instead}")
        return value


class PoolSpec(_Model):
    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    pod_template: PodTemplateOverride = PodTemplateOverride()
    autoscaling: PoolAutoscaling | None = None
    engine: EngineOverride = EngineOverride()


class KvTransferSpec(_Model):
    connector: Literal["NixlConnector", "None"] = "NixlConnector"
    side_channel_port: Annotated[int, Field(ge=1, le=65535)] = 5600
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    # vLLM's kv_load_failure_policy: a decode pod that cannot pull the prefill's KV (the prefill
    # pod gone, a NIXL handshake timed out) computes the prompt itself ("recompute") instead of
    # failing the request ("fail", vLLM's own default).
    load_failure_policy: Literal["recompute", "fail"] = "recompute"


class EndpointPickerTLS(_Model):
    """TLS of the router's ext_proc port, as the Inference Extension's EPP serves it."""

    mode: Literal["SelfSigned", "Secret", "Disabled"] = "SelfSigned"
    secret_name: str | None = None  # a kubernetes.io/tls Secret (tls.crt, tls.key) for mode Secret
    # Require client certificates signed by this Secret's ca.crt (mutual TLS).
    client_ca_secret_name: Annotated[str | None, Field(alias="clientCASecretName")] = None

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> EndpointPickerTLS:
        if (self.mode == "Secret") != bool(self.secret_name):
            raise ValueError("routing.tls.secretName is needed for, and only for, mode Secret")
        if self.mode == "Disabled" and self.client_ca_secret_name:
            raise ValueError("routing.tls.clientCASecretName needs TLS (mode SelfSigned or Secret)")
        return self


class PluginEntry(_Model):
    """One plugin of a custom profile, as the router's EndpointPickerConfig names it: a filter, a
    scorer (with a weight) or the picker, with the plugin's own parameters."""

    type: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    weight: Annotated[float | None, Field(ge=0)] = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def ref(self) -> str:
        return self.name or self.type


class RoutingSpec(_Model):
    # Which endpoint picker serves the InferencePool: kvflow's router, or GIE's EPP image.
    picker: Literal["kvflow", "gie"] = "kvflow"
    gie_image: Annotated[str, Field(alias="gieImage", min_length=1)] = GIE_EPP_IMAGE
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    # A built-in router profile; routing.plugins instead defines one of the service's own.
    profile: Literal["default", "prefix-precise", "prefix-approx", "least-load", "round-robin"] | None = None
    plugins: tuple[PluginEntry, ...] = ()
    pd_threshold: Annotated[int, Field(ge=0)] = 256
    kv_events: bool = True
    hash_seed: Annotated[str, Field(pattern=r"^[0-9]{1,10}$")] = "0"
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    tls: EndpointPickerTLS = EndpointPickerTLS()
    scheduler_profile: str | None = None  # replaced: refused with a message
    scorer_weights: dict[str, Any] | None = None  # replaced: refused with a message

    @pydantic.model_validator(mode="after")
    def _checks(self) -> RoutingSpec:
        _replaced(self.scheduler_profile, "routing.schedulerProfile",
                  "routing.profile (default, prefix-precise, prefix-approx, least-load, round-robin); "
                  "P/D is on when prefill.replicas >= 1")
        _replaced(self.scorer_weights, "routing.scorerWeights",
                  "routing.plugins (filters, scorers with weights, a picker) or routing.profile")
        if self.profile is not None and self.plugins:
            raise ValueError("routing.profile and routing.plugins both choose the profile: set one")
        refs = [p.ref for p in self.plugins]
        duplicates = sorted({r for r in refs if refs.count(r) > 1})
        if duplicates:
            raise ValueError(f"routing.plugins names {', '.join(duplicates)} more than once (give each a name)")
        if self.picker == "gie" and self.tls.client_ca_secret_name:
            raise ValueError("routing.tls.clientCASecretName needs routing.picker kvflow: "
                             "GIE's EPP does not check client certificates")
        return self

    @property
    def profile_name(self) -> str:
        """The router profile requests get: the built-in one named, or the custom one."""
        if self.plugins:
            return CUSTOM_PROFILE
        return self.profile or "default"


class ParentRef(_Model):
    name: Annotated[str, Field(min_length=1)]
    namespace: str | None = None
    section_name: str | None = None


class GatewaySpec(_Model):
    mode: Literal["standalone", "httpRoute", "none"] = "standalone"
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    parent_ref: ParentRef | None = None
    hostnames: tuple[str, ...] = ()
    batch_claim: Annotated[str, Field(min_length=1)] | None = None
    """An existing PersistentVolumeClaim for the Batch API's database and files; without one they
    live in an emptyDir and go with the pod. Replicas share it on one node (docs/batch.md)."""
    # How long the gateway holds a request while its pool has no ready pod (scaled to zero, or
    # the first pod still loading the model) before it answers 503.
    hold_seconds: Annotated[float, Field(ge=0, le=3600)] = 600.0

    @pydantic.model_validator(mode="after")
    def _route_needs_parent(self) -> GatewaySpec:
        if self.mode == "httpRoute" and self.parent_ref is None:
            raise ValueError("gateway.mode httpRoute needs gateway.parentRef (the existing Gateway)")
        return self


class AutoscalingSpec(_Model):
    mode: Literal["none", "operator", "hpa", "keda"] = "none"
    target_queue_depth: Annotated[float, Field(gt=0)] = 4.0
    prometheus_address: str = "http://prometheus-operated.monitoring:9090"
    # Scale down only to the highest replica count wanted over this window (HPA's default).
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 300


class RolloutSpec(_Model):
    pool_order: tuple[SpecPool, SpecPool] = ("prefill", "decode")
    max_surge: Annotated[int, Field(ge=0)] = 1
    # 0 keeps every replica serving during a rollout, but a cluster without a spare GPU never
    # schedules the surge pod: allow 1 there, and the rollout replaces pods in place.
    max_unavailable: Annotated[int, Field(ge=0)] = 0

    @pydantic.model_validator(mode="after")
    def _can_progress(self) -> RolloutSpec:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
        return self

    @pydantic.field_validator("pool_order")
    @classmethod
    def _both_pools(cls, value: tuple[SpecPool, SpecPool]) -> tuple[SpecPool, SpecPool]:
        if sorted(value) != ["decode", "prefill"]:
            raise ValueError("rollout.poolOrder must name prefill and decode once each")
        return value


class NetworkPolicySpec(_Model):
    """NetworkPolicies that let only the service's gateway, picker and peers reach its engines."""

    enabled: bool = True
    # Namespaces whose pods may scrape /metrics (engines serve it on their inference port);
    # default: the namespace of autoscaling.prometheusAddress.
    metrics_namespaces: tuple[Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")], ...] | None = None


class LifecycleSpec(_Model):
    stuck_detection: bool = True
    stuck_after_seconds: Annotated[int, Field(ge=10)] = 300
    termination_grace_period_seconds: Annotated[int, Field(ge=0)] = 60


GIE_NO_PD = ("routing.picker gie does no prefill/decode disaggregation: set prefill.replicas to 0 "
             "(no prefill autoscaling)")
GIE_NO_STANDALONE = ("routing.picker gie needs gateway.mode httpRoute or none: the standalone gateway "
                     "routes with kvflow's router built in, and GIE's EPP answers an Inference Extension Gateway")


@dataclasses.dataclass(frozen=True, slots=True)
class Engine:
    """The engine one pool runs: the shared ``engine`` with the pool's ``engine`` override applied."""

    spec: EngineSpec
    parallelism: Parallelism
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    accelerator: str | None  # None: no accelerator resource
    max_model_len: int | None
    kv_offloading_size: float | None  # GiB

    @property
    def multi_node(self) -> bool:
        return self.parallelism.nodes > 1


class LLMServiceSpec(_Model):
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    prefill: PoolSpec = PoolSpec(replicas=0)
    decode: PoolSpec = PoolSpec()
    kv_transfer: KvTransferSpec = KvTransferSpec()
    routing: RoutingSpec = RoutingSpec()
    gateway: GatewaySpec = GatewaySpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    rollout: RolloutSpec = RolloutSpec()
    lifecycle: LifecycleSpec = LifecycleSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> LLMServiceSpec:
        if self.decode.replicas < 1 and self.autoscaling.mode == "none":
            raise ValueError("decode.replicas must be at least 1: decode serves every request")
        if self.autoscaling.mode != "none":
            for name in SPEC_POOLS:  # an aggregated service (prefill.replicas 0) scales decode only
                if self.section(name).autoscaling is None and (name == "decode" or self.prefill.replicas > 0):
                    raise ValueError(f"autoscaling.mode {self.autoscaling.mode} needs {name}.autoscaling")
        for name in SPEC_POOLS:
            bounds = self.section(name).autoscaling
            if bounds is not None and bounds.min_replicas == 0 and self.autoscaling.mode != "keda":
                raise ValueError(f"{name}.autoscaling.minReplicas 0 needs autoscaling.mode keda: only KEDA "
                                 "wakes a pool with no pods (on the gateway's held requests)")
        if self.model.scheme in OBJECT_STORES and self.engine.kind == "vllm" and not self.model.tokenizer:
            raise ValueError(f"model.tokenizer is needed with an {self.model.scheme}:// source: the router "
                             "reads the tokenizer from hf://, pvc:// or oci://")
        for role in self.roles:
            engine = self.engine_for(role)
            if engine.multi_node and self.engine.kind != "vllm":
                raise ValueError(f"{self.section_name(role)}: a multi-node pool (parallelism.data / "
                                 "parallelism.dataLocal > 1) needs engine.kind vllm")
            if engine.kv_offloading_size and self.engine.kind == "vllm":
                if self.disaggregated and self.kv_transfer.connector != "None":
                    raise ValueError("engine.kvOffloadingGiB with P/D would need vLLM's MultiConnector (NIXL and "
                                     "offloading together), which the operator does not render: offload on an "
                                     "aggregated service")
                if engine.accelerator is None:
                    raise ValueError("engine.kvOffloadingGiB needs a GPU: vLLM's CPU offloading does not start "
                                     "on CPU engines (engine.accelerator none)")
            self._check_devices(role, engine)
        if self.routing.picker == "gie":
            if self.disaggregated:
                raise ValueError(GIE_NO_PD)
            if self.gateway.mode == "standalone":
                raise ValueError(GIE_NO_STANDALONE)
        return self

    def _check_devices(self, role: PoolRole, engine: Engine) -> None:
        pool = self.section(self.section_name(role))
        named = accelerators(pool.resources)
        where = self.section_name(role)
        if engine.accelerator is None:
            if named:
                raise ValueError(f"{where}.resources ask for {', '.join(named)} but the engine's accelerator is none")
            return
        others = [n for n in named if n != engine.accelerator]
        if others:
            raise ValueError(f"{where}.resources ask for {', '.join(others)} but the engine's accelerator is "
                             f"{engine.accelerator} (engine.accelerator)")
        for kind in ("limits", "requests"):
            asked = (pool.resources.get(kind) or {}).get(engine.accelerator)
            if asked is not None and str(asked) != str(engine.parallelism.devices):
                raise ValueError(
                    f"{where}.resources.{kind} gives {asked} {engine.accelerator} per pod, but its parallelism "
                    f"needs {engine.parallelism.devices} (tensor {engine.parallelism.tensor} x pipeline "
                    f"{engine.parallelism.pipeline} x dataLocal {engine.parallelism.local_ranks})")

    def section(self, name: SpecPool) -> PoolSpec:
        return self.prefill if name == "prefill" else self.decode

    def pool(self, role: PoolRole) -> PoolSpec:
        """The spec section of a rendered pool (``both`` is the decode section)."""
        return self.section(self.section_name(role))

    @staticmethod
    def section_name(role: PoolRole) -> SpecPool:
        return "prefill" if role == "prefill" else "decode"

    @property
    def disaggregated(self) -> bool:
        return self.prefill.replicas > 0 or (
            self.prefill.autoscaling is not None and self.autoscaling.mode != "none"
            and self.prefill.autoscaling.max_replicas > 0)

    @property
    def roles(self) -> tuple[PoolRole, ...]:
        """The pools rendered: one aggregated pool, or a prefill and a decode pool."""
        return ("prefill", "decode") if self.disaggregated else ("both",)

    def engine_for(self, role: PoolRole) -> Engine:
        shared = self.engine
        override = self.pool(role).engine
        changes = override.parallelism.model_dump(exclude_none=True)
        try:
            parallelism = Parallelism.model_validate({**shared.parallelism.model_dump(), **changes})
        except pydantic.ValidationError as exc:
            raise ValueError(f"{self.section_name(role)}.engine.parallelism: {_describe(exc)}") from None
        env = {e["name"]: dict(e) for e in shared.env} | {e["name"]: dict(e) for e in override.env}
        return Engine(
            spec=shared, parallelism=parallelism, extra_args=shared.extra_args + override.extra_args,
            env=tuple(env.values()), accelerator=self._accelerator(role, override.accelerator or shared.accelerator),
            max_model_len=override.max_model_len or shared.max_model_len,
            kv_offloading_size=override.kv_offloading_size or shared.kv_offloading_size,
        )

    def _accelerator(self, role: PoolRole, asked: str | None) -> str | None:
        if asked is not None:
            return None if asked == "none" else asked
        named = accelerators(self.pool(role).resources)
        if named:
            return named[0]
        return DEFAULT_ACCELERATOR if self.engine.kind == "vllm" else None


def accelerators(resources: dict[str, Any]) -> list[str]:
    """The extended resources (GPUs, TPUs, ...) a pool's resources name."""
    found = {name for kind in ("limits", "requests") for name in (resources.get(kind) or {})
             if name not in PLAIN_RESOURCES and not name.startswith("hugepages-")}
    return sorted(found)


class LLMService(_Model):
    """An LLMService object: the metadata the renderers need plus the validated spec."""

    name: str
    namespace: str
    uid: str = ""
    generation: int = 0
    spec: LLMServiceSpec

    @pydantic.field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        # Children append "-aggregated", "-gateway", ...: keep the result a DNS label (63).
        if not _DNS_LABEL_RE.match(value) or len(value) > 40:
            raise ValueError(f"name {value!r} must be a DNS label of at most 40 characters")
        return value


class InvalidSpecError(ValueError):
    """The object cannot be rendered; ``str()`` is the message shown in the status."""


def parse(body: dict[str, Any]) -> LLMService:
    """Validate a raw LLMService body (as read from the API or a YAML file)."""
    meta = body.get("metadata") or {}
    try:
        return LLMService.model_validate({
            "name": meta.get("name", ""), "namespace": meta.get("namespace") or "default",
            "uid": meta.get("uid", ""), "generation": int(meta.get("generation") or 0),
            "spec": body.get("spec") or {},
        })
    except pydantic.ValidationError as exc:
        raise InvalidSpecError(_describe(exc)) from None


def _describe(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)
