"""The pure renderers: golden files, API validation of every object, and the facts that matter."""

from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Any

import pytest
import yaml
from operator_schemas import K8S_VERSIONS, crd_errors, validate
from operator_tools import SAMPLES

from kvflow.operator import names
from kvflow.operator.cli import main
from kvflow.operator.render import render, render_yaml
from kvflow.operator.spec import LLMService, parse

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
IMAGES = names.Images(kvflow="ghcr.io/kvflow/kvflow:test", vllm="vllm/vllm-openai:test")
SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.yaml"))


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return doc


def with_uid(body: dict[str, Any]) -> LLMService:
    body = {**body, "metadata": {**body["metadata"], "uid": "00000000-0000-0000-0000-000000000001"}}
    return parse(body)


def by_kind(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_golden(sample: str) -> None:
    rendered = render_yaml((SAMPLES / sample).read_text(), IMAGES)
    golden = GOLDEN / sample
    if os.environ.get("KVFLOW_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file; run with KVFLOW_UPDATE_GOLDEN=1 to create {golden}"
    assert rendered == golden.read_text(), f"{sample} renders differently from {golden}"


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_cli_render_prints_the_same_objects(sample: str, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_IMAGE", IMAGES.kvflow)
    monkeypatch.setenv("KVFLOW_VLLM_IMAGE", IMAGES.vllm)
    assert main(["render", str(SAMPLES / sample)]) == 0
    assert capsys.readouterr().out == (GOLDEN / sample).read_text()


def test_cli_render_rejects_a_bad_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = load("sim.yaml")
    body["spec"]["model"]["source"] = "ftp://host/model"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["render", str(path)]) == 2
    assert "spec.model.source" in capsys.readouterr().err


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_samples_pass_the_crd_schema_and_cel(sample: str) -> None:
    assert crd_errors(load(sample)) == []


VARIANTS = {
    "hpa": {"autoscaling": {"mode": "hpa"}, "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
            "decode": {"autoscaling": {"minReplicas": 2, "maxReplicas": 8}}},
    "keda": {"autoscaling": {"mode": "keda", "targetQueueDepth": 2.5},
             "decode": {"autoscaling": {"minReplicas": 0, "maxReplicas": 8}}},
    "s3-model": {"model": {"name": "m", "source": "s3://bucket/llama", "tokenizer": "hf://o/llama",
                           "credentialsSecret": "s3-creds"}},
    "model-cache": {"model": {"cacheSize": "80Gi", "cacheStorageClass": "nfs"}},
    "amd": {"engine": {"accelerator": "amd.com/gpu", "parallelism": {"tensor": 2}}},
    "offloading": {"engine": {"kvOffloadingGiB": 64}},
    "plugins": {"routing": {"plugins": [{"type": "healthy-filter"}, {"type": "ttft-scorer", "weight": 3},
                                        {"type": "lora-affinity-scorer", "weight": 1}, {"type": "max-score-picker"}]}},
    "pvc-model": {"model": {"name": "m", "source": "pvc://models/llama/8b"}},
    "oci-model": {"model": {"name": "m", "source": "oci://registry.example.com/models/llama:8b"}},
    "http-route": {"gateway": {"mode": "httpRoute", "parentRef": {"name": "gw", "sectionName": "http"}}},
    "no-gateway": {"gateway": {"mode": "none"}},
    "disaggregated": {"prefill": {"replicas": 1}, "routing": {"profile": "prefix-precise"}},
}


def merged(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merged(base.get(k), v) for k, v in patch.items()}}
    return patch


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_every_rendered_object_is_valid(sample: str) -> None:
    for obj in render(with_uid(load(sample)), IMAGES):
        validate(obj)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_renders_valid_objects(variant: str) -> None:
    body = load("sim.yaml")
    body["spec"] = merged(body["spec"], VARIANTS[variant])
    assert crd_errors(body) == []
    objs = render(with_uid(body), IMAGES)
    for obj in objs:
        validate(obj)
    kinds = {o["kind"] for o in objs}
    assert ("HorizontalPodAutoscaler" in kinds) == (variant == "hpa")
    assert ("ScaledObject" in kinds) == (variant == "keda")
    assert ("HTTPRoute" in kinds) == (variant == "http-route")
    assert ("PersistentVolumeClaim" in kinds) == (variant == "model-cache")
    if variant in ("hpa", "keda"):  # the autoscaler owns replicas: server-side apply must not
        assert all("replicas" not in o["spec"] for o in objs
                   if o["kind"] == "Deployment" and o["metadata"]["labels"].get(names.LABEL_ENGINE))


def test_validation_uses_kubernetes_1_35_and_the_newest_schema() -> None:
    assert K8S_VERSIONS[0] == "1.35.0" and K8S_VERSIONS[-1] >= "1.35.0"


def test_pd_engine_command_line_and_environment() -> None:
    svc = with_uid(load("pd-nixl.yaml"))
    objs = render(svc, IMAGES)
    router = by_kind(objs, "Deployment", "llama-pd-router")["spec"]["template"]["spec"]["containers"][0]
    for role in ("prefill", "decode"):
        pod = by_kind(objs, "Deployment", f"llama-pd-{role}")["spec"]["template"]
        engine = pod["spec"]["containers"][0]
        args = engine["args"]
        assert engine["command"] == ["vllm", "serve"] and args[0] == "meta-llama/Llama-3.1-70B-Instruct"
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        # a failed KV pull is computed again on the decode pod, not a failed request
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
        events = json.loads(args[args.index("--kv-events-config") + 1])
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": "tcp://*:5557",  # vLLM binds; the router connects to pods
                          "topic": "kv@$(POD_NAME)@llama-3.1-70b-instruct"}
        env = env_of(engine)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert env["PYTHONHASHSEED"] == env_of(router)["PYTHONHASHSEED"] == "42"
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
        assert engine["lifecycle"]["preStop"] and pod["spec"]["terminationGracePeriodSeconds"] == 120
        # each pool its own parallelism, and the accelerators it needs
        tensor = {"prefill": 2, "decode": 4}[role]
        assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == tensor
        assert ("--max-num-batched-tokens=16384" in args) == (role == "prefill")
        assert pod["metadata"]["labels"][names.LABEL_ROLE] == role
    strict_body = merged(load("pd-nixl.yaml"), {"spec": {"kvTransfer": {"loadFailurePolicy": "fail"}}})
    assert crd_errors(strict_body) == []
    strict = render(with_uid(strict_body), IMAGES)
    args = by_kind(strict, "Deployment", "llama-pd-decode")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_load_failure_policy"] == "fail"


def test_inference_pool_points_at_the_router() -> None:
    objs = render(with_uid(load("sim.yaml")), IMAGES)
    pool = by_kind(objs, "InferencePool", "sim-llm")["spec"]
    router_svc = by_kind(objs, "Service", "sim-llm-router")
    assert pool["endpointPickerRef"]["name"] == router_svc["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in router_svc["spec"]["ports"]}
    engine_labels = by_kind(objs, "Deployment", "sim-llm-aggregated")["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= engine_labels.items()
    assert pool["targetPorts"] == [{"number": 8000}]


def test_sim_engine_runs_kvflow_sim() -> None:
    objs = render(with_uid(load("sim-pd.yaml")), IMAGES)
    engine = by_kind(objs, "Deployment", "sim-pd-prefill")["spec"]["template"]["spec"]["containers"][0]
    # simulated P/D moves KV with real NIXL: the image built with it
    assert engine["image"] == IMAGES.kvflow_nixl and engine["command"] == ["kvflow"]
    assert engine["args"][:8] == ["sim", "--host", "0.0.0.0", "--port", "8000", "--role", "prefill", "--model"]
    events = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557" and {"name": "kv-events", "containerPort": 5557,
                                                      "protocol": "TCP"} in engine["ports"]
    assert engine["args"][engine["args"].index("--kv-transfer") + 1] == "nixl"
    assert "nvidia.com/gpu" not in engine["resources"].get("limits", {})


def test_pod_template_override_merges_by_name() -> None:
    body = load("sim.yaml")
    body["spec"]["decode"]["podTemplate"] = {"spec": {
        "containers": [{"name": "engine", "env": [{"name": "EXTRA", "value": "1"}]},
                       {"name": "sidecar", "image": "busybox"}],
        "priorityClassName": "high"}}
    pod = by_kind(render(with_uid(body), IMAGES), "Deployment", "sim-llm-aggregated")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine", "sidecar"]
    assert pod["containers"][0]["args"][0] == "sim"  # amended, not replaced
    assert pod["containers"][0]["env"][-1] == {"name": "EXTRA", "value": "1"}
    assert pod["priorityClassName"] == "high"


def test_owner_references_only_with_a_uid() -> None:
    body = load("sim.yaml")
    assert all("ownerReferences" not in o["metadata"] for o in render(parse(body), IMAGES))
    assert all(o["metadata"]["ownerReferences"][0]["controller"] for o in render(with_uid(body), IMAGES))


def test_render_is_deterministic() -> None:
    svc = with_uid(load("pd-nixl.yaml"))
    assert render(svc, IMAGES) == render(svc, IMAGES)


# ---- the command lines and config files parse with the real components ----------------------


def containers(objs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [c for o in objs if o["kind"] == "Deployment"
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
            for c in o["spec"]["template"]["spec"]["containers"]]


def config_file(objs: list[dict[str, Any]], name: str, key: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(by_kind(objs, "ConfigMap", name)["data"][key])
    return data


@pytest.mark.parametrize("variant", ["sim", "disaggregated", "load", "random", "no-kv-events", "lora", "plugins"])
def test_router_and_gateway_configs_load_in_the_components(variant: str) -> None:
    from kvflow.gateway.config import GatewayConfig
    from kvflow.router.config import load_config

    body = load("sim.yaml")
    changes = {"disaggregated": {"prefill": {"replicas": 1}},
               "load": {"routing": {"profile": "least-load"}},
               "random": {"routing": {"profile": "round-robin"}},
               "no-kv-events": {"routing": {"kvEvents": False, "profile": "prefix-approx"}},
               "lora": {"model": {"loraAdapters": [{"name": "sql", "source": "hf://o/sql"}]}},
               "plugins": {"routing": {"plugins": [
                   {"type": "model-filter"}, {"type": "precise-prefix-cache-scorer", "weight": 3},
                   {"type": "queue-scorer", "weight": 1}, {"type": "max-score-picker"}]}}}.get(variant, {})
    body["spec"] = merged(body["spec"], changes)
    objs = render(with_uid(body), IMAGES)
    router = load_config(config_file(objs, "sim-llm-router", "router.yaml"))
    assert router.kubernetes is not None and router.kubernetes.inference_pool == "sim-llm"
    assert router.kubernetes.role_label == names.LABEL_ROLE and router.default_profile in router.profiles
    assert router.default_profile == {"load": "least-load", "random": "round-robin", "no-kv-events": "prefix-approx",
                                      "plugins": "custom"}.get(variant, "default")
    gateway = GatewayConfig.model_validate(config_file(objs, "sim-llm-gateway", "gateway.yaml"))
    assert gateway.port == 8080 and [p.model for p in gateway.pools] == ["sim-model"]


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_command_lines_parse_with_the_components(sample: str) -> None:
    from kvflow.gateway.cli import parser as gateway_parser
    from kvflow.router.cli import parse_args as router_parse
    from kvflow.sim.cli import parser as sim_parser

    objs = render(with_uid(load(sample)), IMAGES)
    for container in containers(objs, "router"):
        if container["name"] == "epp":  # GIE's image (routing.picker gie): test_gie_epp_takes_the_pickers_place
            continue
        assert container["command"] == ["kvflow"] and container["args"][0] == "router"
        parsed = router_parse(container["args"][1:])
        assert (parsed.host, parsed.port, parsed.metrics_port) == ("0.0.0.0", 9002, 9090)
    for container in containers(objs, "gateway"):
        assert container["args"][0] == "gateway"
        gateway_parser().parse_args(container["args"][1:])
    for role in ("prefill", "decode", "aggregated"):
        for container in containers(objs, role):
            if container["command"] == ["kvflow"] and container["args"][0] == "sim":
                parsed = sim_parser().parse_args(container["args"][1:])
                assert parsed.host == "0.0.0.0" and parsed.port in (8000, 8200)
            elif container["command"] == ["kvflow"]:
                assert container["args"][0] == "gateway"
                parsed = gateway_parser().parse_args(container["args"][1:])
                assert parsed.sidecar and parsed.upstream == "127.0.0.1:8200" and parsed.port == 8000


@pytest.mark.parametrize("mode", ["standalone", "httpRoute"])
def test_decode_routing_sidecar_only_behind_an_external_gateway(mode: str) -> None:
    body = load("sim-pd.yaml")
    body["spec"]["gateway"] = {"mode": mode, "parentRef": {"name": "gw"}} if mode == "httpRoute" else {"mode": mode}
    objs = render(with_uid(body), IMAGES)
    decode = by_kind(objs, "Deployment", "sim-pd-decode")["spec"]["template"]
    prefill = by_kind(objs, "Deployment", "sim-pd-prefill")["spec"]["template"]
    names_ = [c["name"] for c in decode["spec"]["containers"]]
    engine = decode["spec"]["containers"][0]
    if mode == "httpRoute":  # llm-d's layout: the sidecar takes the pool's port, the engine 8200
        assert names_ == ["engine", "routing-sidecar"]
        assert engine["args"][engine["args"].index("--port") + 1] == "8200"
        assert engine["ports"][0] == {"name": "engine", "containerPort": 8200, "protocol": "TCP"}
        assert engine["readinessProbe"]["httpGet"]["port"] == "engine"
        assert decode["metadata"]["annotations"]["prometheus.io/port"] == "8200"
        sidecar = decode["spec"]["containers"][1]
        assert sidecar["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    else:
        assert names_ == ["engine"] and engine["ports"][0]["containerPort"] == 8000
    assert [c["name"] for c in prefill["spec"]["containers"]] == ["engine"]
    assert by_kind(objs, "InferencePool", "sim-pd")["spec"]["targetPorts"] == [{"number": 8000}]


@pytest.mark.parametrize("tls", [{}, {"mode": "Secret", "secretName": "epp-tls"},
                                 {"mode": "Secret", "secretName": "epp-tls", "clientCASecretName": "gw-ca"},
                                 {"mode": "Disabled"}], ids=["self-signed", "secret", "mtls", "plaintext"])
def test_router_serves_like_the_inference_extension_epp(tls: dict[str, Any]) -> None:
    from kvflow.router.cli import parse_args as router_parse

    body = load("sim.yaml")
    body["spec"]["routing"] = {"tls": tls}
    assert crd_errors(body) == []
    objs = render(with_uid(body), IMAGES)
    pod = by_kind(objs, "Deployment", "sim-llm-router")["spec"]["template"]["spec"]
    router = pod["containers"][0]
    parsed = router_parse(router["args"][1:])
    assert (parsed.port, parsed.grpc_health_port, parsed.metrics_port) == (9002, 9003, 9090)
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {"grpc": 9002, "grpc-health": 9003,
                                                                          "metrics": 9090}
    probe = {"port": 9003, "service": "inference-extension"}  # GIE's chart probes the same
    assert router["readinessProbe"]["grpc"] == router["livenessProbe"]["grpc"] == probe
    assert parsed.secure_serving is (tls.get("mode") != "Disabled")
    secrets = {v["secret"]["secretName"]: v["name"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    if tls.get("mode") == "Secret":
        assert str(parsed.cert_path) == mounts[secrets["epp-tls"]] == "/etc/kvflow/tls"
    else:
        assert parsed.cert_path is None
    if "clientCASecretName" in tls:
        assert str(parsed.client_ca) == mounts[secrets["gw-ca"]] + "/ca.crt"
    service = by_kind(objs, "Service", "sim-llm-router")["spec"]["ports"]
    grpc_port = next(p for p in service if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == ("kubernetes.io/h2c" if tls.get("mode") == "Disabled" else "http2")
    assert {p["port"] for p in service} == {9002, 9003, 9090}


@pytest.mark.parametrize("source, tokenizer, init", [
    ("hf://org/model", "/models/tokenizer", True),
    ("pvc://models/llama/8b", "/models/models/llama/8b", False),
    ("oci://registry.example.com/models/llama:8b", "/models/oci", False),
])
def test_router_and_gateway_get_the_models_tokenizer(source: str, tokenizer: str, init: bool) -> None:
    from kvflow.gateway.config import GatewayConfig

    body = load("vllm-gpu.yaml")
    body["spec"]["model"] = {"name": "m", "source": source, "revision": "abc" if init else None}
    body["spec"]["model"] = {k: v for k, v in body["spec"]["model"].items() if v is not None}
    body["spec"]["engine"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
    objs = render(with_uid(body), IMAGES)
    for name, container in (("qwen-chat-router", "router"), ("qwen-chat-gateway", "gateway")):
        pod = by_kind(objs, "Deployment", name)["spec"]["template"]["spec"]
        main = next(c for c in pod["containers"] if c["name"] == container)
        paths = {m["mountPath"] for m in main["volumeMounts"]}
        assert any(tokenizer == p or tokenizer.startswith(p + "/") for p in paths), (tokenizer, paths)
        assert ("initContainers" in pod) is init
        if init:
            fetch = pod["initContainers"][0]
            assert fetch["image"] == IMAGES.kvflow and fetch["args"] == [
                "tokenizer", "fetch", source, "/models/tokenizer", "--revision", "abc"]
            assert fetch["env"] == body["spec"]["engine"]["env"]  # the hub token reaches it
            assert fetch["securityContext"]["runAsNonRoot"]
    router = by_kind(objs, "Deployment", "qwen-chat-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--tokenizer") + 1] == tokenizer
    gateway = GatewayConfig.model_validate(config_file(objs, "qwen-chat-gateway", "gateway.yaml"))
    assert gateway.pools[0].tokenizer == tokenizer


def test_sim_engines_and_their_router_use_the_builtin_tokenizer() -> None:
    objs = render(with_uid(load("sim.yaml")), IMAGES)
    router = by_kind(objs, "Deployment", "sim-llm-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--tokenizer") + 1] == "builtin"
    engine = by_kind(objs, "Deployment", "sim-llm-aggregated")["spec"]["template"]["spec"]["containers"][0]
    assert "--tokenizer" not in engine["args"]


def test_engine_pods_carry_their_revision_and_llm_d_role() -> None:
    def labels(body: dict[str, Any], role: str) -> dict[str, str]:
        pod = by_kind(render(with_uid(body), IMAGES), "Deployment", f"{body['metadata']['name']}-{role}")
        return dict(pod["spec"]["template"]["metadata"]["labels"])

    body = load("sim-pd.yaml")
    prefill, decode = labels(body, "prefill"), labels(body, "decode")
    assert prefill[names.LABEL_REVISION] == decode[names.LABEL_REVISION]  # one revision, both pools
    assert (prefill["llm-d.ai/role"], decode["llm-d.ai/role"]) == ("prefill", "decode")
    changed = merged(body, {"spec": {"model": {"name": "other"}}})
    assert labels(changed, "decode")[names.LABEL_REVISION] != decode[names.LABEL_REVISION]
    scaled = merged(body, {"spec": {"decode": {"replicas": 5}}})  # not a revision change
    assert labels(scaled, "decode")[names.LABEL_REVISION] == decode[names.LABEL_REVISION]
    # what a decode pod does when a KV pull fails is no revision change either
    strict = merged(body, {"spec": {"kvTransfer": {"loadFailurePolicy": "fail"}}})
    assert labels(strict, "decode")[names.LABEL_REVISION] == decode[names.LABEL_REVISION]
    aggregated = labels(load("sim.yaml"), "aggregated")  # one pool, named and labelled for what it is
    assert aggregated["llm-d.ai/role"] == aggregated[names.LABEL_ROLE] == "both"
    assert aggregated["app.kubernetes.io/component"] == "aggregated"
    # The selector labels stay the operator's whatever the pod template says.
    assert names.selector_labels(with_uid(body), "decode").items() <= decode.items()


def test_a_named_volume_in_the_pod_template_replaces_the_rendered_one() -> None:
    body = load("vllm-gpu.yaml")
    body["spec"]["decode"]["podTemplate"] = {"spec": {
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-cache"}}],
        "containers": [{"name": "engine", "env": [{"name": "HF_TOKEN", "value": "plain"}],
                        "volumeMounts": [{"name": "model-cache", "mountPath": "/models/hf-cache", "subPath": "q"}]}]}}
    assert crd_errors(body) == []
    deployment = by_kind(render(with_uid(body), IMAGES), "Deployment", "qwen-chat-aggregated")
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-cache"}}  # one source
    engine = pod["containers"][0]
    assert [e for e in engine["env"] if e["name"] == "HF_TOKEN"] == [{"name": "HF_TOKEN", "value": "plain"}]
    mounts = [m for m in engine["volumeMounts"] if m["mountPath"] == "/models/hf-cache"]
    assert mounts == [{"name": "model-cache", "mountPath": "/models/hf-cache", "subPath": "q"}]


def test_cache_pvc_gives_hub_models_a_persistent_cache() -> None:
    body = load("vllm-gpu.yaml")
    del body["spec"]["model"]["cacheSize"]
    body["spec"]["model"]["cachePVC"] = "hf-cache"
    assert crd_errors(body) == []
    pod = by_kind(render(with_uid(body), IMAGES), "Deployment", "qwen-chat-aggregated")["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    assert env_of(pod["containers"][0])["HF_HOME"] == "/models/hf-cache"


def test_cache_size_creates_one_claim_every_engine_pod_shares() -> None:
    objs = render(with_uid(load("vllm-gpu.yaml")), IMAGES)
    claim = by_kind(objs, "PersistentVolumeClaim", "qwen-chat-model-cache")
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}
    pod = by_kind(objs, "Deployment", "qwen-chat-aggregated")["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "qwen-chat-model-cache"}} in pod["volumes"]
    # the credentials Secret reaches the engine (and the router's tokenizer fetch) as environment
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    router = by_kind(objs, "Deployment", "qwen-chat-router")["spec"]["template"]["spec"]
    assert router["initContainers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]


def test_lora_adapters_are_mounted_where_the_engine_loads_them() -> None:
    body = load("sim.yaml")
    body["spec"]["engine"]["kind"] = "vllm"
    body["spec"]["model"] = {"name": "m", "source": "pvc://models/base", "loraAdapters": [
        {"name": "sql", "source": "pvc://models/adapters/sql"},  # on the model's PVC: no second mount
        {"name": "chat", "source": "pvc://adapters-pvc/chat"},
        {"name": "code", "source": "oci://registry.example.com/lora/code:1"},
        {"name": "hub", "source": "hf://org/hub-lora"}]}
    assert crd_errors(body) == []
    objs = render(with_uid(body), IMAGES)
    deployment = by_kind(objs, "Deployment", "sim-llm-aggregated")
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    # adapters are loaded at run time (vLLM's /v1/load_lora_adapter), not on the command line:
    # adding one changes no pod template, so no pod restarts
    assert "--lora-modules" not in engine["args"] and "--enable-lora" in engine["args"]
    assert env_of(engine)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    paths = config_file(objs, "sim-llm-router", "router.yaml")["loraPaths"]
    assert paths == {"sql": "/models/models/adapters/sql", "chat": "/models/adapters-pvc/chat",
                     "code": "/models/adapters/registry.example.com_lora_code_1", "hub": "org/hub-lora"}
    mounts = [m["mountPath"] for m in engine["volumeMounts"]]
    for name in ("sql", "chat", "code"):
        assert any(paths[name] == m or paths[name].startswith(m + "/") for m in mounts), name
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert sorted(claims) == ["adapters-pvc", "models"]
    assert any(v.get("image", {}).get("reference") == "registry.example.com/lora/code:1" for v in pod["volumes"])
    fewer = merged(body, {"spec": {"model": {"loraAdapters": body["spec"]["model"]["loraAdapters"][:1]}}})
    fewer_pod = by_kind(render(with_uid(fewer), IMAGES), "Deployment", "sim-llm-aggregated")["spec"]["template"]
    assert fewer_pod["spec"]["containers"][0]["args"] == engine["args"]


@pytest.mark.parametrize("unavailable, surge", [(0, 1), (1, 0), (1, 2)])
def test_rollout_budget_is_the_specs(unavailable: int, surge: int) -> None:
    body = load("sim.yaml")
    body["spec"]["rollout"] = {"maxUnavailable": unavailable, "maxSurge": surge}
    assert crd_errors(body) == []
    deployment = by_kind(render(with_uid(body), IMAGES), "Deployment", "sim-llm-aggregated")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": unavailable, "maxSurge": surge}


def test_the_router_follows_every_data_parallel_rank() -> None:
    from kvflow.endpoints import Endpoint
    from kvflow.router.config import load_config

    body = load("pd-nixl.yaml")
    body["spec"]["decode"]["engine"]["parallelism"]["data"] = 2
    body["spec"]["decode"]["resources"]["limits"]["nvidia.com/gpu"] = 8
    assert crd_errors(body) == []
    objs = render(with_uid(body), IMAGES)
    engine = by_kind(objs, "Deployment", "llama-pd-decode")["spec"]["template"]["spec"]["containers"][0]
    assert [(p["name"], p["containerPort"]) for p in engine["ports"] if p["name"].startswith("kv-events")] == [
        ("kv-events", 5557), ("kv-events-1", 5558)]  # vLLM binds port + rank for each rank
    config = load_config(config_file(objs, "llama-pd-router", "router.yaml"))
    assert config.kv_events_addresses(Endpoint("10.1.2.3", 8000)) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")


GIE = {"routing": {"picker": "gie", "profile": "prefix-approx"}, "prefill": {"replicas": 0},
       "gateway": {"mode": "httpRoute", "parentRef": {"name": "inference-gateway"}}}
PICKER_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service", "NetworkPolicy"}


def flag_values(arguments: list[str]) -> dict[str, str]:
    """Go's flag syntax, as GIE's EPP parses it: ``--name value`` or ``--name=value``."""
    out, rest = {}, list(arguments)
    while rest:
        name = rest.pop(0)
        assert name.startswith("--"), name
        key, sep, value = name[2:].partition("=")
        out[key] = value if sep else rest.pop(0)
    return out


@pytest.mark.parametrize("tls", [{}, {"mode": "Secret", "secretName": "epp-tls"}, {"mode": "Disabled"}],
                         ids=["self-signed", "secret", "plaintext"])
def test_gie_epp_takes_the_pickers_place(tls: dict[str, Any]) -> None:
    """Same name, Service, ports and probes as kvflow's router, so the InferencePool does not change."""
    kvflow_body = load("sim.yaml")
    kvflow_body["spec"] = merged(kvflow_body["spec"], {**GIE, "routing": {"profile": "prefix-approx", "tls": tls}})
    gie_body = copy.deepcopy(kvflow_body)
    gie_body["spec"]["routing"]["picker"] = "gie"
    assert crd_errors(gie_body) == crd_errors(kvflow_body) == []
    kvflow_objs, gie_objs = render(with_uid(kvflow_body), IMAGES), render(with_uid(gie_body), IMAGES)
    for obj in gie_objs:
        validate(obj)

    def picker(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {o["kind"]: o for o in objs if o["metadata"]["name"] == "sim-llm-router"}

    assert set(picker(gie_objs)) == set(picker(kvflow_objs)) == PICKER_KINDS
    assert by_kind(gie_objs, "InferencePool", "sim-llm") == by_kind(kvflow_objs, "InferencePool", "sim-llm")
    assert picker(gie_objs)["Service"] == picker(kvflow_objs)["Service"]
    [epp], [router] = containers(gie_objs, "router"), containers(kvflow_objs, "router")
    assert epp["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
    for key in ("ports", "readinessProbe", "livenessProbe"):
        assert epp[key] == router[key]
    flags = flag_values(epp["args"])
    assert {k: flags[k] for k in ("pool-name", "pool-namespace", "grpc-port", "grpc-health-port", "metrics-port")} \
        == {"pool-name": "sim-llm", "pool-namespace": "default", "grpc-port": "9002", "grpc-health-port": "9003",
            "metrics-port": "9090"}
    mounts = {m["mountPath"]: m["name"] for m in epp["volumeMounts"]}
    pod = picker(gie_objs)["Deployment"]["spec"]["template"]["spec"]
    configmap = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == mounts["/config"])
    config_name = flags["config-file"].removeprefix("/config/")
    assert config_name in by_kind(gie_objs, "ConfigMap", configmap)["data"]
    assert flags.get("secure-serving") == ("false" if tls.get("mode") == "Disabled" else None)
    assert flags.get("cert-path") == ("/etc/kvflow/tls" if tls.get("mode") == "Secret" else None)
    if "cert-path" in flags:
        assert mounts[flags["cert-path"]] == "tls"
    rules = picker(gie_objs)["Role"]["rules"]
    assert picker(kvflow_objs)["Role"]["rules"] == rules[:2]  # GIE's adds InferenceObjectives, read-only
    assert rules[2] == {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
                        "verbs": ["get", "list", "watch"]}


@pytest.mark.parametrize("routing, plugins", [
    ({"profile": "prefix-approx"}, {"prefix-cache-scorer": 2, "queue-scorer": 1, "kv-cache-utilization-scorer": 1}),
    ({"plugins": [{"type": "prefix-cache-scorer", "weight": 1.5}, {"type": "active-request-scorer", "weight": 1},
                  {"type": "queue-scorer", "weight": 0.5}, {"type": "lora-affinity-scorer", "weight": 1},
                  {"type": "max-score-picker"}]},
     {"prefix-cache-scorer": 15, "queue-scorer": 15, "lora-affinity-scorer": 10}),
    ({"profile": "least-load"}, {"queue-scorer": 2, "kv-cache-utilization-scorer": 1}),
    ({"profile": "round-robin"}, {}),
    # GIE has no TTFT estimate: the default profile's ttft-scorer becomes the two signals it weighs
    ({"profile": "default"}, {"prefix-cache-scorer": 4, "queue-scorer": 4, "kv-cache-utilization-scorer": 1,
                              "lora-affinity-scorer": 1}),
], ids=["prefix-approx", "fractional", "least-load", "round-robin", "default"])
def test_gie_config_is_kvflows_scoring_in_gies_plugins(routing: dict[str, Any], plugins: dict[str, int]) -> None:
    body = load("sim.yaml")
    body["spec"] = merged(body["spec"], {**GIE, "routing": {"picker": "gie"}})
    body["spec"]["routing"] = {"picker": "gie", **routing}
    config = config_file(render(with_uid(body), IMAGES), "sim-llm-router", "epp-config.yaml")
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    [profile] = config["schedulingProfiles"]
    picker = "max-score-picker" if plugins else "random-picker"
    assert profile["plugins"][-1] == {"pluginRef": picker}
    assert {p["pluginRef"]: p["weight"] for p in profile["plugins"][:-1]} == plugins
    assert sorted(p["type"] for p in config["plugins"]) == sorted(["single-profile-handler", *plugins, picker])


def test_the_make_up_equivalent_llmservice_routes_as_make_up_does() -> None:
    """manifests/samples/sim.yaml is `make up` on a cluster: the router config the operator renders
    schedules exactly as the one `kvflow up` runs (what the routing benchmark measures)."""
    from kvflow.local import up
    from kvflow.router.config import RouterConfig, load_config

    def scheduling(config: RouterConfig, profile: str) -> dict[str, Any]:
        chosen = config.profiles[profile]
        return {"profile": chosen.model_dump(), "block_size": config.block_size,
                "plugins": {ref.plugin_ref: config.plugins[ref.plugin_ref].model_dump() for ref in chosen.plugins},
                **config.model_dump(exclude={"pool", "default_profile", "user_plugins", "scheduling_profiles"})}

    objs = render(with_uid(load("sim.yaml")), IMAGES)
    operator = load_config(config_file(objs, "sim-llm-router", "router.yaml"))
    gateway = config_file(objs, "sim-llm-gateway", "gateway.yaml")["pools"][0]
    args = up.parse_args([])
    plan = up.plan_stack(args.decode, args.prefill)
    local = load_config(up.router_config(plan, up.SIM_BLOCK_SIZE))
    assert gateway["profile"] == operator.default_profile == args.profile == "default"
    assert load_config(gateway["router_config"]) == operator
    assert scheduling(operator, operator.default_profile) == scheduling(local, args.profile)
    # and the same engines: as many simulated pods, on the same timing profile
    deployment = by_kind(objs, "Deployment", "sim-llm-aggregated")
    assert deployment["spec"]["replicas"] == len(plan.pods)
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    from kvflow.sim.cli import parser as sim_parser

    rendered = sim_parser().parse_args(engine["args"][1:])
    args.model = "sim-model"
    local_argv = up.sim_argv(plan.pods[0], args)
    local_sim = sim_parser().parse_args(local_argv[local_argv.index("sim") + 1:])
    assert (rendered.profile, rendered.role, rendered.block_size) == (local_sim.profile, local_sim.role, 16)


def test_what_the_pool_asks_is_the_accelerator_that_renders() -> None:
    amd = by_kind(render(with_uid(load("amd.yaml")), IMAGES), "Deployment", "llama-rocm-aggregated")
    engine = amd["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"] == {"memory": "96Gi", "amd.com/gpu": 2}  # tensor 2, and no nvidia.com/gpu
    assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
    cpu = merged(load("vllm-gpu.yaml"), {"spec": {"engine": {"accelerator": "none"},
                                                  "decode": {"resources": {"limits": {"memory": "48Gi"}}}}})
    cpu["spec"]["decode"]["resources"]["limits"].pop("nvidia.com/gpu")
    assert crd_errors(cpu) == []
    limits = by_kind(render(with_uid(cpu), IMAGES), "Deployment", "qwen-chat-aggregated")[
        "spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "48Gi"}
    tpu = merged(load("vllm-gpu.yaml"), {"spec": {"engine": {"parallelism": {"tensor": 4}}}})
    tpu["spec"]["decode"]["resources"]["limits"] = {"google.com/tpu": 4}
    limits = by_kind(render(with_uid(tpu), IMAGES), "Deployment", "qwen-chat-aggregated")[
        "spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"google.com/tpu": 4}


def test_a_multi_node_pool_is_a_leader_worker_set_whose_leaders_serve() -> None:
    objs = render(with_uid(load("multi-node.yaml")), IMAGES)
    lws = by_kind(objs, "LeaderWorkerSet", "deepseek-aggregated")
    validate(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    [leader_line], [worker_line] = leader["spec"]["containers"][0]["args"], worker["spec"]["containers"][0]["args"]
    for line in (leader_line, worker_line):
        assert line.startswith("exec vllm serve deepseek-ai/DeepSeek-R1-0528 ")
        assert "--data-parallel-size 16 --data-parallel-size-local 8 --enable-expert-parallel" in line
        assert "--data-parallel-address ${LWS_LEADER_ADDRESS} --data-parallel-rpc-port 5555" in line
    assert leader_line.endswith("--data-parallel-start-rank 0") and "--headless" not in leader_line
    assert worker_line.endswith("--data-parallel-start-rank $((LWS_WORKER_INDEX * 8)) --headless")
    assert leader["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "readinessProbe" in leader["spec"]["containers"][0] and "readinessProbe" not in worker["spec"]["containers"][0]
    # the InferencePool and the pool's Service select leaders only; the PDB covers the whole group
    pool = by_kind(objs, "InferencePool", "deepseek")["spec"]["selector"]["matchLabels"]
    assert pool.items() <= leader["metadata"]["labels"].items()
    assert not pool.items() <= worker["metadata"]["labels"].items()
    assert by_kind(objs, "Service", "deepseek-aggregated")["spec"]["selector"]["kvflow.io/engine"] == "true"
    assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "deepseek-aggregated"]


def test_object_store_models_stream_with_their_credentials() -> None:
    body = merged(load("vllm-gpu.yaml"), {"spec": {"model": {"source": "s3://models/qwen", "tokenizer": "hf://Qwen/Qwen2.5-7B-Instruct",
                                                             "credentialsSecret": "s3-creds"}}})
    del body["spec"]["model"]["cacheSize"]
    assert crd_errors(body) == []
    engine = by_kind(render(with_uid(body), IMAGES), "Deployment", "qwen-chat-aggregated")[
        "spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][:5] == ["s3://models/qwen", "--served-model-name", "qwen2.5-7b-instruct",
                                  "--load-format", "runai_streamer"]
    assert engine["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "HF_HOME" not in env_of(engine)


def test_a_cpu_kv_tier_adds_its_memory_and_vllms_flags() -> None:
    body = merged(load("vllm-gpu.yaml"), {"spec": {"engine": {"kvOffloadingGiB": 64}}})
    objs = render(with_uid(body), IMAGES)
    engine = by_kind(objs, "Deployment", "qwen-chat-aggregated")["spec"]["template"]["spec"]["containers"][0]
    args = engine["args"]
    assert args[args.index("--kv-offloading-size") + 1] == "64"
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    gib = 1 << 30
    assert engine["resources"]["requests"]["memory"] == str(32 * gib + 64 * gib)
    assert engine["resources"]["limits"]["memory"] == str(48 * gib + 64 * gib)
    router = config_file(objs, "qwen-chat-router", "router.yaml")
    assert router["kvEvents"]["predictEvictions"] is False  # a CPU tier keeps what the GPU evicts
    pod = by_kind(objs, "Deployment", "qwen-chat-aggregated")["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")  # vLLM keeps the CPU pool in shared memory
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "72Gi"}


def test_a_keda_pool_at_zero_wakes_on_the_gateways_held_requests() -> None:
    objs = render(with_uid(load("scale-to-zero.yaml")), IMAGES)
    scaled = by_kind(objs, "ScaledObject", "qwen-burst-aggregated")
    validate(scaled)
    assert scaled["spec"]["minReplicaCount"] == 0
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": "qwen-burst-aggregated"}
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    assert 'kvflow_gateway_held_requests{namespace="default",model="qwen2.5-7b-instruct"}' in trigger["query"]
    assert "vllm:num_requests_waiting" in trigger["query"] and trigger["activationThreshold"] == "0"
    assert "replicas" not in by_kind(objs, "Deployment", "qwen-burst-aggregated")["spec"]  # KEDA owns it
    pool = config_file(objs, "qwen-burst-gateway", "gateway.yaml")["pools"][0]
    assert pool["hold_when_empty_seconds"] == 600


def test_a_pool_override_changes_that_pool_only() -> None:
    objs = render(with_uid(load("pd-nixl.yaml")), IMAGES)
    prefill = by_kind(objs, "Deployment", "llama-pd-prefill")["spec"]["template"]
    decode = by_kind(objs, "Deployment", "llama-pd-decode")["spec"]["template"]
    # per-pool parallelism does not split the KV-cache revision: NIXL pairs the two pools
    assert prefill["metadata"]["labels"][names.LABEL_REVISION] == decode["metadata"]["labels"][names.LABEL_REVISION]
    env = merged(load("pd-nixl.yaml"), {"spec": {"decode": {"engine": {"env": [{"name": "UCX_TLS", "value": "rc"}]}}}})
    engine = by_kind(render(with_uid(env), IMAGES), "Deployment", "llama-pd-decode")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(engine)["UCX_TLS"] == "rc"  # the pool's env replaces the shared one of that name


def test_network_policies_are_rendered_unless_turned_off() -> None:
    objs = render(with_uid(load("sim.yaml")), IMAGES)
    assert sorted(o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy") == [
        "sim-llm-engines", "sim-llm-router"]
    off = merged(load("sim.yaml"), {"spec": {"networkPolicy": {"enabled": False}}})
    assert crd_errors(off) == []
    assert not [o for o in render(with_uid(off), IMAGES) if o["kind"] == "NetworkPolicy"]
    scrapers = merged(load("sim.yaml"), {"spec": {"networkPolicy": {"metricsNamespaces": ["observability"]}}})
    engines = by_kind(render(with_uid(scrapers), IMAGES), "NetworkPolicy", "sim-llm-engines")
    validate(engines)
    peers = [p for rule in engines["spec"]["ingress"] for p in rule.get("from", [])]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}} in peers
