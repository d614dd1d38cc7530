"""Bad specs: rejected at admission by the CRD (schema or CEL) and, should one slip through
(CEL disabled, an older CRD), by the operator's own validation with a clear message."""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import pytest
import yaml
from operator_schemas import crd_errors
from operator_tools import CHART, SAMPLES

from kvflow.operator import spec as spec_mod
from kvflow.operator.render import render
from kvflow.operator.spec import InvalidSpecError, parse


def sample() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / "sim.yaml").read_text())
    return body


def patched(changes: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    body = sample()

    def merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
        for k, v in patch.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                merge(base[k], v)
            else:
                base[k] = copy.deepcopy(v)

    merge(body["spec"], changes)
    if name:
        body["metadata"]["name"] = name
    return body


# id -> (spec patch, fragment of the CRD's message, fragment of the operator's message)
BAD_SPECS: dict[str, tuple[dict[str, Any], str, str]] = {
    "source-scheme": ({"model": {"source": "ftp://host/m"}}, "does not match", "must start with hf://"),
    "adapter-scheme": ({"model": {"loraAdapters": [{"name": "a", "source": "s3://b/a"}]}}, "does not match",
                       "adapter source 's3://b/a' must start with hf://, pvc:// or oci://"),
    "bucket-without-tokenizer": ({"engine": {"kind": "vllm"}, "model": {"source": "s3://bucket/m"}},
                                 "model.tokenizer is needed", "model.tokenizer is needed with an s3:// source"),
    "managed-flag": ({"engine": {"extraArgs": ["--port=9000"]}}, "flags the operator manages",
                     "must not set --port"),
    "managed-flag-of-a-pool": ({"decode": {"engine": {"extraArgs": ["--tensor-parallel-size=2"]}}},
                               "flags the operator manages", "must not set --tensor-parallel-size"),
    "min-over-max": ({"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
                     "minReplicas must not exceed maxReplicas", "must not exceed maxReplicas"),
    "unknown-plugin": ({"routing": {"plugins": [{"type": "magic-scorer", "weight": 1}, {"type": "max-score-picker"}]}},
                       "is not one of", "unknown type 'magic-scorer'"),
    "scorer-without-weight": ({"routing": {"plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}]}},
                              "every scorer needs a weight", "scorer 'queue-scorer' needs a weight"),
    "two-pickers": ({"routing": {"plugins": [{"type": "queue-scorer", "weight": 1}, {"type": "max-score-picker"},
                                             {"type": "round-robin-picker"}]}},
                    "exactly one picker", "needs exactly one picker"),
    "bad-plugin-parameter": ({"routing": {"plugins": [{"type": "ttft-scorer", "weight": 1, "parameters": {"nope": 1}},
                                                      {"type": "max-score-picker"}]}},
                             "", "routing.plugins: "),
    "profile-and-plugins": ({"routing": {"profile": "default", "plugins": [{"type": "max-score-picker"}]}},
                            "both choose the profile", "both choose the profile"),
    "unknown-profile": ({"routing": {"profile": "fastest"}}, "is not one of", "Input should be 'default'"),
    "old-scheduler-profile": ({"routing": {"schedulerProfile": "pd"}}, "replaced by routing.profile",
                              "routing.schedulerProfile is replaced by routing.profile"),
    "old-scorer-weights": ({"routing": {"scorerWeights": {"prefix": 2}}}, "replaced by routing.plugins",
                           "routing.scorerWeights is replaced by routing.plugins"),
    "old-tensor-parallel": ({"engine": {"tensorParallelSize": 2}}, "replaced by engine.parallelism.tensor",
                            "engine.tensorParallelSize is replaced by engine.parallelism.tensor"),
    "data-local-divides": ({"engine": {"parallelism": {"data": 4, "dataLocal": 3}}}, "must divide",
                           "must divide parallelism.data"),
    "multi-node-sim": ({"engine": {"parallelism": {"data": 4, "dataLocal": 2}}}, "",
                       "a multi-node pool (parallelism.data / parallelism.dataLocal > 1) needs engine.kind vllm"),
    "accelerators-off-parallelism": ({"engine": {"kind": "vllm", "parallelism": {"tensor": 4}},
                                      "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "",
                                     "gives 1 nvidia.com/gpu per pod, but its parallelism needs 4"),
    "two-accelerators": ({"engine": {"kind": "vllm", "accelerator": "amd.com/gpu"},
                          "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "",
                         "ask for nvidia.com/gpu but the engine's accelerator is amd.com/gpu"),
    "offloading-with-pd": ({"engine": {"kind": "vllm", "kvOffloadingGiB": 32}, "prefill": {"replicas": 1}}, "",
                           "would need vLLM's MultiConnector"),
    "offloading-on-cpu": ({"engine": {"kind": "vllm", "kvOffloadingGiB": 32, "accelerator": "none"}}, "",
                          "vLLM's CPU offloading does not start on CPU engines"),
    "engine-args-in-pod-template": ({"decode": {"podTemplate": {"spec": {"containers": [
        {"name": "engine", "args": ["serve", "--tensor-parallel-size", "4"]}]}}}},
        "must not set command, args or image", "podTemplate.spec.containers[engine].args is owned by the operator"),
    "route-without-gateway": ({"gateway": {"mode": "httpRoute"}}, "needs gateway.parentRef",
                              "needs gateway.parentRef"),
    "no-decode": ({"decode": {"replicas": 0}}, "decode.replicas must be at least 1",
                  "decode.replicas must be at least 1"),
    "pool-order": ({"rollout": {"poolOrder": ["decode", "decode"]}}, "once each", "once each"),
    "autoscaling-bounds": ({"autoscaling": {"mode": "hpa"}}, "needs decode.autoscaling",
                           "needs decode.autoscaling"),
    "duplicate-adapter": ({"model": {"loraAdapters": [{"name": "a", "source": "hf://x/a"},
                                                      {"name": "a", "source": "hf://x/b"}]}},
                          "duplicate entries", "duplicate LoRA adapter names: a"),
    "unknown-field": ({"engine": {"gpus": 4}}, "'gpus' was unexpected", "Extra inputs are not permitted"),
    "stuck-too-eager": ({"lifecycle": {"stuckAfterSeconds": 1}}, "less than the minimum", "greater than or equal to 10"),
    "bad-seed": ({"routing": {"hashSeed": "abc"}}, "does not match", "should match pattern"),
    # Every spelling of a flag the operator owns, as vLLM's parser would read it.
    "alias-tp": ({"engine": {"extraArgs": ["-tp", "4"]}}, "flags the operator manages", "--tensor-parallel-size"),
    "alias-dp": ({"engine": {"extraArgs": ["-dp=2"]}}, "flags the operator manages", "--data-parallel-size"),
    "underscore-flag": ({"engine": {"extraArgs": ["--max_model_len=4096"]}}, "flags the operator manages",
                        "--max-model-len"),
    "dotted-flag": ({"engine": {"extraArgs": ["--kv-transfer-config.kv_role=kv_producer"]}},
                    "flags the operator manages", "--kv-transfer-config"),
    "block-size": ({"engine": {"extraArgs": ["--block-size", "32"]}}, "flags the operator manages",
                   "--block-size"),
    "negated-flag": ({"engine": {"extraArgs": ["--no-enable-prefix-caching"]}}, "flags the operator manages",
                     "--enable-prefix-caching"),
    "owned-env": ({"engine": {"env": [{"name": "PYTHONHASHSEED", "value": "1"}]}},
                  "variables the operator sets", "must not set PYTHONHASHSEED"),
    "duplicate-env": ({"engine": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
                      "duplicate entries", "names A more than once"),
    "selector-label": ({"decode": {"podTemplate": {"labels": {"app.kubernetes.io/component": "x"}}}},
                       "labels the operator selects pods by", "must not set app.kubernetes.io/component"),
    "cache-for-pvc-model": ({"model": {"source": "pvc://models/m", "cachePVC": "hf-cache"}},
                            "need an hf:// source", "need an hf:// source"),
    "cache-twice": ({"model": {"cachePVC": "hf-cache", "cacheSize": "10Gi"}}, "set one", "set one"),
    "tls-secret-unnamed": ({"routing": {"tls": {"mode": "Secret"}}}, "secretName is needed", "secretName is needed"),
    "mtls-without-tls": ({"routing": {"tls": {"mode": "Disabled", "clientCASecretName": "ca"}}},
                         "needs TLS", "needs TLS"),
    "zero-min-replicas-without-keda": ({"autoscaling": {"mode": "hpa"},
                                        "decode": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}},
                                       "minReplicas 0 needs autoscaling.mode keda", "minReplicas 0 needs autoscaling.mode keda"),
    "rollout-stuck": ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "cannot both be 0", "cannot both be 0"),
    # GIE's EPP: no P/D, no standalone gateway (it embeds kvflow's router), no client certificates.
    "gie-with-pd": ({"routing": {"picker": "gie"}, "prefill": {"replicas": 1}, "gateway": {"mode": "none"}},
                    "gie does no prefill/decode disaggregation", "gie does no prefill/decode disaggregation"),
    "gie-standalone-gateway": ({"routing": {"picker": "gie"}}, "gie needs gateway.mode", "gie needs gateway.mode"),
    "gie-mtls": ({"routing": {"picker": "gie", "tls": {"clientCASecretName": "ca"}}, "gateway": {"mode": "none"}},
                 "does not check client certificates", "does not check client certificates"),
}


def test_values_that_only_look_like_managed_flags_pass() -> None:
    body = patched({"engine": {"extraArgs": ["--gpu-memory-utilization=0.9", "--max-num-seqs", "64", "-q", "fp8",
                                             "--portable", "-1", "--kv-cache-dtype", "fp8"]}})
    assert crd_errors(body) == []
    parse(body)


def test_owned_env_in_a_pod_template_is_refused() -> None:
    body = patched({"decode": {"podTemplate": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "HF_HOME", "value": "/x"}]}]}}}})
    with pytest.raises(InvalidSpecError, match="must not set HF_HOME"):
        parse(body)


def test_the_crd_refuses_exactly_the_managed_flags() -> None:
    """The CEL regex is generated from the models' flag set: one definition, checked here."""
    import re

    from kvflow.operator.spec import ENGINE_FLAG_ALIASES, MANAGED_ENGINE_FLAGS

    longs = sorted(f[2:].replace("-", "[-_]") for f in MANAGED_ENGINE_FLAGS)
    shorts = sorted(k[1:] for k in ENGINE_FLAG_ALIASES)
    regex = "^(--(no[-_])?(" + "|".join(longs) + ")([=.].*)?|-(" + "|".join(shorts) + ")(=.*)?)$"
    rules = _crd_spec_schema()["properties"]["engine"]["properties"]["extraArgs"]["x-kubernetes-validations"]
    assert rules[0]["rule"] == f"self.all(a, !a.matches('{regex}'))"
    for arg in ["--port", "--no-enable-prefix-caching", "--kv_events_config={}", "-tp", "--block-size=8"]:
        assert re.match(regex, arg) and spec_mod.engine_flag(arg) in MANAGED_ENGINE_FLAGS


# Cases without a CRD message are ones no schema rule can say (a plugin's parameters, devices
# against parallelism): only the operator refuses them (the next test).
@pytest.mark.parametrize("case", sorted(case for case, (_, crd, _) in BAD_SPECS.items() if crd))
def test_bad_spec_is_rejected_by_the_crd(case: str) -> None:
    changes, crd_message, _ = BAD_SPECS[case]
    errors = crd_errors(patched(changes))
    assert errors and any(crd_message in e for e in errors), errors


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_is_reported_by_the_operator(case: str) -> None:
    changes, _, message = BAD_SPECS[case]
    with pytest.raises(InvalidSpecError) as exc:
        render(parse(patched(changes)))  # every refusal before anything is applied: parse, or render
    assert message in str(exc.value)


def test_long_names_are_rejected_both_ways() -> None:
    body = patched({}, name="x" * 41)
    assert any("at most 40 characters" in e for e in crd_errors(body))
    with pytest.raises(InvalidSpecError, match="at most 40 characters"):
        parse(body)


def test_defaults_agree_between_the_crd_and_the_models() -> None:
    """A minimal spec defaulted by the CRD parses to the same model as the raw one."""
    from operator_schemas import CRD_SCHEMAS, apply_defaults

    body = {"apiVersion": "kvflow.io/v1alpha1", "kind": "LLMService", "metadata": {"name": "m"},
            "spec": {"model": {"name": "m", "source": "hf://o/m"}}}
    schema = CRD_SCHEMAS[("kvflow.io/v1alpha1", "LLMService")]
    defaulted = apply_defaults(schema, copy.deepcopy(body))
    assert parse(defaulted) == parse(body)


def _crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "crds" / "llmservices.kvflow.io.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def _model_paths(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        out.add(path)
        for arg in _types(field.annotation):
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                out |= _model_paths(arg, path + ".")
    return out


def _types(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types(a)]


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    props = schema.get("properties") or (schema.get("items") or {}).get("properties") or {}
    for name, sub in props.items():
        out.add(prefix + name)
        if not sub.get("x-kubernetes-preserve-unknown-fields") and prefix + name not in _OPAQUE:
            out |= _schema_paths(sub, prefix + name + ".")
    return out


# Kubernetes-typed fields the models keep as plain dicts (validated by the API server's types).
_OPAQUE = {f"{pool}.{field}" for pool in ("prefill", "decode")
           for field in ("resources", "tolerations", "podTemplate.spec", "engine.env")} | {"engine.env"}


def test_the_crd_schema_and_the_models_name_the_same_fields() -> None:
    from_models = _model_paths(spec_mod.LLMServiceSpec)
    from_crd = _schema_paths(_crd_spec_schema())
    assert from_crd == from_models


def test_the_crd_offers_exactly_the_routers_plugins_and_profiles() -> None:
    """routing.plugins' types and routing.profile's names come from the router (one definition)."""
    from kvflow.router.config import BUILTIN_PROFILES
    from kvflow.router.plugins import REGISTRY

    routing = _crd_spec_schema()["properties"]["routing"]["properties"]
    assert routing["plugins"]["items"]["properties"]["type"]["enum"] == sorted(REGISTRY)
    assert sorted(routing["profile"]["enum"]) == sorted(spec_mod.BUILTIN_PROFILES) == sorted(
        p.name for p in BUILTIN_PROFILES)
    # the CRD's CEL tells scorers and pickers by their names' suffix: every type is named so
    for name, plugin in REGISTRY.items():
        assert name.endswith(f"-{plugin.kind}"), name


def test_a_spec_with_only_a_model_is_one_aggregated_pool_on_the_default_profile() -> None:
    svc = parse({"metadata": {"name": "m"}, "spec": {"model": {"name": "m", "source": "hf://o/m"}}})
    assert svc.spec.roles == ("both",) and not svc.spec.disaggregated
    assert svc.spec.routing.profile_name == "default"
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in render(svc)
                   if o["kind"] in ("Deployment", "LeaderWorkerSet"))
    assert kinds == [("Deployment", "m-aggregated"), ("Deployment", "m-gateway"), ("Deployment", "m-router")]
