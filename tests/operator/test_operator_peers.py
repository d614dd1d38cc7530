"""Router replicas that share what they routed (``router/peers.py``): with more than one replica,
the picker's routers and each kvflow gateway's get a ``peers`` config naming a headless Service
of their own pods and a key mounted from a Secret, and the key stays the same from one reconcile
to the next; one replica renders none of it. Every object passes kubernetes-validate (strict)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import Harness, eventually
from operator_rbac import audit_against_chart
from operator_schemas import validate
from operator_samples import IMAGES, SECTION, body, rendered, service

from kvflow.gateway.config import GatewayConfig
from kvflow.operator import names
from kvflow.operator.objects import key
from kvflow.operator.plan import plan
from kvflow.operator.render import render
from kvflow.operator.render_network import network_policies
from kvflow.router.config import load_config
from kvflow.router.peers import read_key

CONFIG = {"router": ("sim-llm-router", "router.yaml"), "gateway": ("sim-llm-gateway", "gateway.yaml")}
NS = "default"
LLMS = f"/apis/kvflow.io/v1alpha1/namespaces/{NS}/llmservices"
KEY_ID = "kvflow.io/peers-key-id"


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name), None)


def router_config(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The router config ``component`` runs: the picker's file, or the gateway's one pool's."""
    name, file_name = CONFIG[component]
    config_map = find(objs, "ConfigMap", name)
    assert config_map is not None
    data: dict[str, Any] = yaml.safe_load(config_map["data"][file_name])
    if component == "gateway":
        pool = GatewayConfig.model_validate(data).pools[0]
        assert isinstance(pool.router_config, dict)
        return pool.router_config
    return data


def pod_spec(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    deployment = find(objs, "Deployment", f"sim-llm-{component}")
    assert deployment is not None
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def peer_objects(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs if o["metadata"]["name"].endswith("-peers"))


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_one_replica_renders_nothing_of_peers(component: str) -> None:
    objs = rendered(**{SECTION[component]: {"replicas": 1}})
    assert "peers" not in router_config(objs, component)
    assert peer_objects(objs) == []
    assert not [o for o in objs if o["kind"] == "Secret"]
    pod = pod_spec(objs, component)
    assert all(p["containerPort"] != names.PEERS_PORT for c in pod["containers"] for p in c["ports"])
    assert not [v for v in pod["volumes"] if "secret" in v]


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_three_replicas_find_each_other_through_a_headless_service(component: str) -> None:
    objs = rendered(**{SECTION[component]: {"replicas": 3}})
    config = router_config(objs, component)
    name = f"sim-llm-{component}-peers"
    assert config["peers"]["port"] == names.PEERS_PORT and config["peers"]["service"] == f"{name}.{NS}.svc"
    loaded = load_config(config).peers  # the router's own loader takes it
    assert loaded.enabled and loaded.service == f"{name}.{NS}.svc" and loaded.key_file == config["peers"]["keyFile"]

    peers = find(objs, "Service", name)
    assert peers is not None
    assert peers["spec"]["clusterIP"] == "None"  # its DNS name resolves to every replica, not to one address
    assert peers["spec"]["publishNotReadyAddresses"] is True  # a starting replica is heard before it is ready
    assert peers["spec"]["ports"] == [{"name": "peers", "port": names.PEERS_PORT, "targetPort": "peers",
                                       "protocol": "TCP"}]
    selector = peers["spec"]["selector"].items()
    selected = [o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"
                and selector <= o["spec"]["template"]["metadata"]["labels"].items()]
    assert selected == [f"sim-llm-{component}"]  # this component's replicas, and no other pods

    [container] = pod_spec(objs, component)["containers"]
    assert {"name": "peers", "containerPort": names.PEERS_PORT, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_the_key_file_is_the_secret_mounted_read_only(component: str) -> None:
    objs = rendered(**{SECTION[component]: {"replicas": 3}})
    key_file = Path(router_config(objs, component)["peers"]["keyFile"])
    pod = pod_spec(objs, component)
    [mount] = [m for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"] == str(key_file.parent)]
    assert mount["readOnly"] is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["items"] == [{"key": key_file.name, "path": key_file.name}]
    secret = find(objs, "Secret", volume["secret"]["secretName"])
    assert secret is not None and secret["type"] == "Opaque"
    [owner] = secret["metadata"]["ownerReferences"]  # garbage-collected with the LLMService
    assert (owner["kind"], owner["name"], owner["controller"]) == ("LLMService", "sim-llm", True)
    assert "data" not in secret  # the renderer knows no key: the operator keeps the cluster's (below)


def test_picker_and_gateway_share_one_key_and_hear_only_their_own_replicas() -> None:
    objs = rendered(routing={"replicas": 2}, gateway={"replicas": 3})
    assert peer_objects(objs) == ["Secret/sim-llm-peers", "Service/sim-llm-gateway-peers", "Service/sim-llm-router-peers"]
    router, gateway = router_config(objs, "router")["peers"], router_config(objs, "gateway")["peers"]
    assert router["keyFile"] == gateway["keyFile"] and router["service"] != gateway["service"]


@pytest.mark.parametrize("spec", [
    {"routing": {"picker": "gie", "replicas": 3}, "gateway": {"mode": "none"}},  # GIE's EPP has no peers
    {"gateway": {"mode": "httpRoute", "parentRef": {"name": "gw"}, "replicas": 3}},  # no kvflow gateway runs
])
def test_no_kvflow_router_no_peers(spec: dict[str, dict[str, Any]]) -> None:
    assert peer_objects(rendered(**spec)) == []


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_pickers_network_policy_admits_its_peers_only_when_it_has_some(replicas: int) -> None:
    svc = service(routing={"replicas": replicas})
    policy = next(p for p in network_policies(svc) if p["metadata"]["name"] == "sim-llm-router")
    replicas_of_router = {"podSelector": {"matchLabels": names.selector_labels(svc, "router")}}
    rule = {"from": [replicas_of_router], "ports": [{"protocol": "TCP", "port": names.PEERS_PORT}]}
    admitting = [r for r in policy["spec"]["ingress"] if any(p["port"] == names.PEERS_PORT for p in r["ports"])]
    assert admitting == ([rule] if replicas > 1 else [])  # the other replicas, and nobody else


# -- the key: kept from the cluster's Secret, minted once ---------------------------------------

FRESH = base64.b64encode(b"f" * 64).decode()
OTHER = base64.b64encode(b"o" * 64).decode()


def applied(decided_apply: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(decided_apply, kind, name)
    assert found is not None
    return found


def key_ids(objs: list[dict[str, Any]]) -> dict[str, str | None]:
    return {o["metadata"]["name"]: (o["spec"]["template"]["metadata"].get("annotations") or {}).get(KEY_ID)
            for o in objs if o["kind"] == "Deployment" and not o["metadata"]["labels"].get("kvflow.io/engine")}


def test_a_new_secret_gets_the_fresh_key_and_the_pods_that_mount_it_its_id() -> None:
    svc = service(gateway={"replicas": 3})
    decided = plan(svc, render(svc, IMAGES), {}, fresh_key=FRESH)
    secret = applied(decided.apply, "Secret", "sim-llm-peers")
    assert secret["data"] == {"key": FRESH}
    validate(secret)
    ids = key_ids(decided.apply)
    assert ids["sim-llm-gateway"] is not None and ids["sim-llm-router"] is None  # one picker replica: no key
    assert FRESH not in str(ids) and base64.b64decode(FRESH).decode() not in str(ids)


def test_the_clusters_key_is_kept_and_an_unusable_one_replaced() -> None:
    svc = service(gateway={"replicas": 3})
    first = plan(svc, render(svc, IMAGES), {}, fresh_key=FRESH)
    observed = {key(o): o for o in first.apply}
    again = plan(svc, render(svc, IMAGES), observed, fresh_key=OTHER)
    assert applied(again.apply, "Secret", "sim-llm-peers")["data"] == {"key": FRESH}
    assert applied(again.apply, "Deployment", "sim-llm-gateway") == applied(first.apply, "Deployment", "sim-llm-gateway")

    short = {k: {**o, "data": {"key": base64.b64encode(b"too short").decode()}} if k[1] == "Secret" else o
             for k, o in observed.items()}
    replaced = plan(svc, render(svc, IMAGES), short, fresh_key=OTHER)
    assert applied(replaced.apply, "Secret", "sim-llm-peers")["data"] == {"key": OTHER}
    assert key_ids(replaced.apply)["sim-llm-gateway"] != key_ids(first.apply)["sim-llm-gateway"]  # every replica rolls


def test_without_a_key_to_keep_or_give_the_secret_stays_as_rendered() -> None:
    svc = service(gateway={"replicas": 3})
    decided = plan(svc, render(svc, IMAGES), {})
    assert decided.apply == render(svc, IMAGES)


# -- against the emulated cluster -----------------------------------------------------------


def secret_key(h: Harness) -> str | None:
    secret = h.k8s.read("v1/secrets", NS, "sim-llm-peers") or {}
    value = (secret.get("data") or {}).get("key")
    return value if isinstance(value, str) else None


def gateway_template(h: Harness) -> dict[str, Any]:
    deployment = h.k8s.read("apps/v1/deployments", NS, "sim-llm-gateway") or {}
    return (deployment.get("spec") or {}).get("template") or {}


def generation_seen(h: Harness) -> int:
    obj = h.k8s.read("kvflow.io/v1alpha1/llmservices", NS, "sim-llm") or {}
    return int((obj.get("status") or {}).get("observedGeneration") or 0)


async def test_the_key_survives_reconciles_and_a_new_one_rolls_every_replica(harness: Harness, tmp_path: Path) -> None:
    h = harness
    doc = body(gateway={"replicas": 3}, engine={"port": h.engines.port})
    await h.request("POST", LLMS, doc, content_type="application/json")
    first = await eventually(lambda: secret_key(h), what="the peers' key")
    (tmp_path / "key").write_bytes(base64.b64decode(first))
    assert len(read_key(str(tmp_path / "key"))) >= 16  # the routers take it as it is mounted
    await eventually(lambda: generation_seen(h) == 1, what="the first reconcile")
    template = gateway_template(h)
    assert template["metadata"]["annotations"][KEY_ID]

    # A spec change re-applies every child: the key, and so the gateway's pods, stay as they are.
    await h.request("PATCH", f"{LLMS}/sim-llm", {"spec": {"decode": {"replicas": 3}}})
    await eventually(lambda: generation_seen(h) == 2, what="the second reconcile")
    assert secret_key(h) == first
    assert gateway_template(h) == template

    # A key that does change (its Secret deleted) reaches every replica together: their template changes.
    await h.k8s.remove_object("v1/secrets", NS, "sim-llm-peers")
    second = await eventually(lambda: secret_key(h), what="a new key")
    assert second != first
    await eventually(lambda: gateway_template(h)["metadata"]["annotations"][KEY_ID]
                     != template["metadata"]["annotations"][KEY_ID], what="the gateway's pods on the new key")

    calls = [e for e in h.k8s.audit if e.user_agent.startswith(("kvflow-operator", "kopf"))]
    audit_against_chart(calls, check_unused=False)
    assert not [c for c in calls if c.resource == "secrets" and c.verb in ("list", "watch")]  # read by name only


def test_the_operator_accepts_the_keys_the_routers_accept() -> None:
    from kvflow.operator import render_peers
    from kvflow.router import peers

    assert render_peers.MIN_KEY_BYTES == peers.MIN_KEY_BYTES
