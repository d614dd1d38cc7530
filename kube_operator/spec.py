"""The ``LLMService`` spec as typed, validated pydantic models (the operator's edge).

The CRD's OpenAPI schema (``charts/kvflow/crds/llmservices.kvflow.io.yaml``) rejects most bad
specs at admission; these models repeat those rules and add the ones a schema cannot express
(flags the operator owns, duplicate adapter names, unknown scorers). A spec that fails here is
reported as the ``Degraded`` condition with reason ``InvalidSpec``; nothing is applied.

Field names are camelCase on the wire (as in the CRD) and snake_case in Python.
"""

from __future__ import annotations

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

PoolRole = Literal["prefill", "decode"]
POOL_ROLES: tuple[PoolRole, ...] = ("prefill", "decode")

# Flags the operator sets itself; passing them through extraArgs would silently fight it (or,
# like --block-size and --prefix-caching-hash-algo, desync the router's block hashes).
MANAGED_ENGINE_FLAGS = frozenset({
    "--port", "--host", "--served-model-name", "--kv-transfer-config", "--kv-events-config",
    "--tensor-parallel-size", "--data-parallel-size", "--max-model-len", "--lora-modules",
    "--block-size", "--enable-prefix-caching", "--prefix-caching-hash-algo", "--enable-lora",
    "--model", "--tokenizer", "--revision", "--data-parallel-size-local", "--data-parallel-rank",
    "--data-parallel-start-rank", "--data-parallel-address", "--data-parallel-rpc-port",
})
# vLLM's short aliases (vllm/engine/arg_utils.py) of flags above.
ENGINE_FLAG_ALIASES = {
    "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size", "-dpl": "--data-parallel-size-local",
    "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank", "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
}
# Environment the operator sets in engine pods; the spec may not set them again.
OWNED_ENV = frozenset({"POD_NAME", "POD_NAMESPACE", "PYTHONHASHSEED", "HF_HOME",
                       "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"})
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


KNOWN_SCORERS = frozenset({"prefix", "load", "kvCacheUtilization", "queueDepth", "lora"})
# The Inference Extension's own endpoint picker (routing.picker gie), at the release whose
# InferencePool (inference.networking.k8s.io/v1) and EndpointPickerConfig the operator renders.
GIE_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
_SOURCE_RE = re.compile(r"^(hf|pvc|oci)://[^\s]+$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
    )


class LoraAdapter(_Model):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    source: str

    @pydantic.field_validator("source")
    @classmethod
    def _source_scheme(cls, value: str) -> str:
        if not _SOURCE_RE.match(value):
            raise ValueError(f"adapter source {value!r} must start with hf://, pvc:// or oci://")
        return value


class ModelSpec(_Model):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    source: str
    revision: str | None = None
    lora_adapters: tuple[LoraAdapter, ...] = ()
    # Where the router finds the served model's tokenizer; default: the model's own source.
    tokenizer: str | None = None
    # A PersistentVolumeClaim for the Hugging Face cache of an hf:// model (default: emptyDir).
    cache_pvc: Annotated[str | None, Field(alias="cachePVC", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                           max_length=253)] = None

    @pydantic.field_validator("source", "tokenizer")
    @classmethod
    def _source_scheme(cls, value: str | None) -> str | None:
        if value is not None and not _SOURCE_RE.match(value):
            raise ValueError(f"model source {value!r} must start with hf://, pvc:// or oci://")
        return value

    @pydantic.model_validator(mode="after")
    def _cache_for_hub_models(self) -> ModelSpec:
        if self.cache_pvc and self.scheme != "hf":
            raise ValueError("model.cachePVC holds a hub download cache: it needs an hf:// source")
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


class EngineSpec(_Model):
    kind: Literal["vllm", "sim"] = "vllm"
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    block_size: Annotated[int, Field(ge=1, le=256)] = 16
    port: Annotated[int, Field(ge=1, le=65535)] = 8000

    @pydantic.field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        clashes = sorted({arg for arg in value if engine_flag(arg) in MANAGED_ENGINE_FLAGS})
        if clashes:
            raise ValueError(
                f"engine.extraArgs must not set {', '.join(clashes)}: the operator sets "
                f"{', '.join(sorted({engine_flag(a) or a for a in clashes}))} from the spec "
                "(use the matching spec field instead)")
        return value

    @pydantic.field_validator("env")
    @classmethod
    def _env_names(cls, value: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        names = []
        for item in value:
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError("every engine.env entry needs a name")
            names.append(item["name"])
        _check_env_names(names, "engine.env")
        return value


def _check_env_names(names: list[str], where: str) -> None:
    owned = sorted(set(names) & OWNED_ENV)
    if owned:
        raise ValueError(f"{where} must not set {', '.join(owned)}: the operator sets it in every engine pod")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{where} names {', '.join(duplicates)} more than once")


class PoolAutoscaling(_Model):
    # A floor of one: a pool at zero has no pods, so no metrics, so nothing would scale it back.
    min_replicas: Annotated[int, Field(ge=1)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 4

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> PoolAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas ({self.max_replicas})")
        return self


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
    def _no_owned_env(cls, value: dict[str, Any]) -> dict[str, Any]:
        for container in value.get("containers") or []:
            if isinstance(container, dict):
                env = [e.get("name") for e in container.get("env") or [] if isinstance(e, dict)]
                _check_env_names([n for n in env if isinstance(n, str)],
                                 f"podTemplate container {container.get('name')!r} env")
        return value


class PoolSpec(_Model):
    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    pod_template: PodTemplateOverride = PodTemplateOverride()
    autoscaling: PoolAutoscaling | None = None


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


class RoutingSpec(_Model):
    # Which endpoint picker serves the InferencePool: kvflow's router, or GIE's EPP image.
    picker: Literal["kvflow", "gie"] = "kvflow"
    gie_image: Annotated[str, Field(alias="gieImage", min_length=1)] = GIE_EPP_IMAGE
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    scheduler_profile: Literal["pd", "prefix", "load", "random"] = "pd"
    scorer_weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: {"prefix": 2.0, "load": 1.0})
    pd_threshold: Annotated[int, Field(ge=0)] = 256
    kv_events: bool = True
    hash_seed: Annotated[str, Field(pattern=r"^[0-9]{1,10}$")] = "0"
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    tls: EndpointPickerTLS = EndpointPickerTLS()

    @pydantic.field_validator("scorer_weights")
    @classmethod
    def _known_scorers(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - KNOWN_SCORERS)
        if unknown:
            raise ValueError(
                f"unknown scorer(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_SCORERS))}")
        if value and not any(weight > 0 for weight in value.values()):
            raise ValueError("at least one scorer weight must be positive")
        return value

    @pydantic.model_validator(mode="after")
    def _gie_checks_no_client_certificates(self) -> RoutingSpec:
        if self.picker == "gie" and self.tls.client_ca_secret_name:
            raise ValueError("routing.tls.clientCASecretName needs routing.picker kvflow: "
                             "GIE's EPP does not check client certificates")
        return self


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
    pool_order: tuple[PoolRole, PoolRole] = ("prefill", "decode")
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
    def _both_pools(cls, value: tuple[PoolRole, PoolRole]) -> tuple[PoolRole, PoolRole]:
        if sorted(value) != ["decode", "prefill"]:
            raise ValueError("rollout.poolOrder must name prefill and decode once each")
        return value


class LifecycleSpec(_Model):
    stuck_detection: bool = True
    stuck_after_seconds: Annotated[int, Field(ge=10)] = 300
    termination_grace_period_seconds: Annotated[int, Field(ge=0)] = 60


GIE_NO_PD = ("routing.picker gie does no prefill/decode disaggregation: set prefill.replicas to 0 "
             "(no prefill autoscaling) and routing.schedulerProfile to prefix, load or random")
GIE_NO_STANDALONE = ("routing.picker gie needs gateway.mode httpRoute or none: the standalone gateway "
                     "routes with kvflow's router built in, and GIE's EPP answers an Inference Extension Gateway")


class LLMServiceSpec(_Model):
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()
    kv_transfer: KvTransferSpec = KvTransferSpec()
    routing: RoutingSpec = RoutingSpec()
    gateway: GatewaySpec = GatewaySpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    rollout: RolloutSpec = RolloutSpec()
    lifecycle: LifecycleSpec = LifecycleSpec()

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> LLMServiceSpec:
        if self.decode.replicas < 1 and self.autoscaling.mode == "none":
            raise ValueError("decode.replicas must be at least 1: decode serves every request")
        if self.routing.scheduler_profile == "pd" and self.prefill.replicas == 0 \
                and self.autoscaling.mode == "none":
            raise ValueError("routing.schedulerProfile pd needs prefill.replicas >= 1")
        if self.autoscaling.mode != "none":
            for role in POOL_ROLES:  # an aggregated service (prefill.replicas 0) scales decode only
                if self.pool(role).autoscaling is None and (role == "decode" or self.prefill.replicas > 0):
                    raise ValueError(f"autoscaling.mode {self.autoscaling.mode} needs {role}.autoscaling")
        if self.routing.picker == "gie":
            if self.disaggregated:
                raise ValueError(GIE_NO_PD)
            if self.gateway.mode == "standalone":
                raise ValueError(GIE_NO_STANDALONE)
        return self

    def pool(self, role: PoolRole) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def disaggregated(self) -> bool:
        return self.prefill.replicas > 0 or (
            self.prefill.autoscaling is not None and self.autoscaling.mode != "none"
            and self.prefill.autoscaling.max_replicas > 0)


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
        # Children append "-prefill", "-gateway", ...: keep the result a DNS label (63).
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
