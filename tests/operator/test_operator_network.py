"""NetworkPolicies: engines accept only the service's front door, its picker, their peers and the
scrapers; every policy is valid as the API server would check it (kubernetes-validate, strict)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from operator_schemas import validate
from operator_tools import SAMPLES

from kvflow.operator import names
from kvflow.operator.render_network import NAMESPACE_LABEL, OPERATOR_LABELS, network_policies
from kvflow.operator.spec import LLMService, parse

SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.yaml"))


def service(name: str) -> LLMService:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return parse({**body, "metadata": {**body["metadata"], "uid": "00000000-0000-0000-0000-000000000001"}})


def policy(svc: LLMService, suffix: str, **kwargs: Any) -> dict[str, Any]:
    return next(p for p in network_policies(svc, **kwargs) if p["metadata"]["name"] == f"{svc.name}-{suffix}")


def admitted(pol: dict[str, Any]) -> list[tuple[Any, list[int] | None]]:
    """(peer, ports or None for every port) for each peer of each ingress rule."""
    out = []
    for rule in pol["spec"]["ingress"]:
        ports = [p["port"] for p in rule["ports"]] if "ports" in rule else None
        out += [(peer, ports) for peer in rule["from"]]
    return out


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_every_samples_policies_are_valid_network_policies(sample: str) -> None:
    for obj in network_policies(service(sample)):
        assert (obj["apiVersion"], obj["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
        validate(obj)


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_engines_admit_only_the_front_door_the_picker_their_peers_and_scrapers(sample: str) -> None:
    svc = service(sample)
    pol = policy(svc, "engines")
    assert pol["spec"]["podSelector"] == {"matchLabels": names.engine_pool_selector(svc)}
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    engine_ports = sorted({svc.spec.engine.port, *(names.engine_port(svc, r) for r in svc.spec.roles)})
    picker = {"podSelector": {"matchLabels": names.selector_labels(svc, "router")}}
    peers = {"podSelector": {"matchLabels": names.engine_pool_selector(svc)}}
    rules = admitted(pol)
    assert (picker, [*engine_ports, names.KV_EVENTS_PORT]) in rules
    assert (peers, None) in rules  # NIXL side channel, UCX and data-parallel RPC: any port
    # nobody else gets every port, and nothing admits "from anywhere"
    assert [peer for peer, ports in rules if ports is None] == [peers]
    assert all(peer for peer, _ in rules)
    assert all(set(ports) <= {*engine_ports, names.KV_EVENTS_PORT} for _, ports in rules if ports)


def test_a_standalone_gateways_pods_are_the_front_door() -> None:
    svc = service("sim.yaml")
    gateway = {"podSelector": {"matchLabels": names.selector_labels(svc, "gateway")}}
    assert (gateway, [svc.spec.engine.port]) in admitted(policy(svc, "engines"))
    assert (gateway, [names.ROUTER_GRPC_PORT]) in admitted(policy(svc, "router"))


def test_an_http_route_admits_the_parent_gateways_namespace_on_the_pools_target_port() -> None:
    svc = service("pd-nixl.yaml")
    assert svc.spec.gateway.mode == "httpRoute"
    gateway_ns = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "gateway-system"}}}
    rules = admitted(policy(svc, "engines"))
    assert (gateway_ns, [svc.spec.engine.port]) in rules
    assert (gateway_ns, [names.ROUTER_GRPC_PORT]) in admitted(policy(svc, "router"))


def test_scrapers_come_from_the_prometheus_namespace_or_the_ones_given() -> None:
    svc = service("sim.yaml")
    monitoring = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "monitoring"}}}
    assert any(peer == monitoring for peer, _ in admitted(policy(svc, "engines")))
    assert any(peer == monitoring for peer, _ in admitted(policy(svc, "router")))
    obs = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "observability"}}}
    chosen = admitted(policy(svc, "engines", metrics_from=["observability"]))
    assert any(peer == obs for peer, _ in chosen) and not any(peer == monitoring for peer, _ in chosen)
    none = admitted(policy(svc, "router", metrics_from=()))
    assert [ports for _, ports in none] == [[names.ROUTER_GRPC_PORT]]  # the router's HTTP port: nobody


def test_the_operator_can_still_scrape_the_engines() -> None:
    svc = service("sim.yaml")
    operator = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "ops"}},
                "podSelector": {"matchLabels": OPERATOR_LABELS}}
    assert (operator, [svc.spec.engine.port]) in admitted(policy(svc, "engines", operator_namespace="ops"))


def test_policies_belong_to_the_service() -> None:
    svc = service("sim.yaml")
    for obj in network_policies(svc):
        meta = obj["metadata"]
        assert meta["namespace"] == svc.namespace and meta["ownerReferences"][0]["name"] == svc.name
        assert meta["labels"][names.LABEL_SERVICE] == svc.name and names.LABEL_ENGINE not in meta["labels"]
