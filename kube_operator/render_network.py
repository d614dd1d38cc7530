"""NetworkPolicies of one LLMService: engines answer only the parts of the service that call them.

Pure: ``network_policies(svc) -> objects``. Without them any pod in the cluster can call an
engine directly, around the gateway's authentication, limits and accounting. Two policies:

``NAME-engines`` (every engine pod of the service) admits

* the **front door** on the pool's target port: the service's kvflow gateway pods
  (``gateway.mode: standalone``); with ``httpRoute`` every pod of the parent Gateway's namespace
  (the Gateway implementation's data plane, whose labels kvflow does not know); with ``none``
  every pod of the service's own namespace (whatever routes to the InferencePool there);
* the **endpoint picker** (kvflow's router or GIE's EPP) on the engine ports (``/metrics``) and
  the KV-event port;
* **peer engine pods** of the same service on every port: the NIXL side channel, UCX's
  transfers (their ports are not fixed) and a multi-node group's data-parallel RPC;
* **Prometheus** from the namespaces ``metrics_from`` (default: the namespace of
  ``autoscaling.prometheusAddress``, ``monitoring``) on the engine ports, and the **operator**
  (its lifecycle scrapes) from ``operator_namespace``. A NetworkPolicy sees ports, not paths: an
  engine serves ``/metrics`` on its inference port, so those namespaces can reach inference
  too. Pass ``metrics_from=()`` to admit no scraper.

``NAME-router`` (the picker's pods) admits ext_proc gRPC from the front door, its metrics
port (``/metrics``, ``/tokenize``, ``/debug``) only from the same scrapers and, with several
replicas, the peers port from the other replicas (``render_peers.py``); kubelet probes are node
traffic, which Kubernetes network plugins admit whatever the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvflow.operator import names, render_peers
from kvflow.operator.objects import Obj, new
from kvflow.operator.spec import LLMService

API_VERSION = "networking.k8s.io/v1"
OPERATOR_NAMESPACE = "kvflow-system"
"""Where the chart installs the operator (its pods: ``app.kubernetes.io/component: operator``)."""
OPERATOR_LABELS = {"app.kubernetes.io/name": "kvflow", "app.kubernetes.io/component": "operator"}
COMPONENT = "network"
"""``app.kubernetes.io/component`` of the policies (they belong to no one component)."""
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace: selects a namespace by its name."""


def prometheus_namespace(svc: LLMService) -> str:
    """The namespace in ``autoscaling.prometheusAddress`` (``http://NAME.NAMESPACE[.svc…]:PORT``)."""
    host = urlsplit(svc.spec.autoscaling.prometheus_address).hostname or ""
    parts = host.split(".")
    return parts[1] if len(parts) >= 2 else svc.namespace


def network_policies(svc: LLMService, *, metrics_from: Sequence[str] | None = None,
                     operator_namespace: str = OPERATOR_NAMESPACE) -> list[Obj]:
    """The service's NetworkPolicies (see the module docstring for what each admits)."""
    scrapers = [prometheus_namespace(svc)] if metrics_from is None else list(metrics_from)
    return [_engines(svc, scrapers, operator_namespace), _router(svc, scrapers)]


def _engines(svc: LLMService, scrapers: list[str], operator_namespace: str) -> Obj:
    target = svc.spec.engine.port
    engine_ports = sorted({target, *(names.engine_port(svc, role) for role in svc.spec.roles)})
    picker = {"podSelector": {"matchLabels": names.selector_labels(svc, "router")}}
    peers = {"podSelector": {"matchLabels": names.engine_pool_selector(svc)}}
    operator = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: operator_namespace}},
                "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}
    rules = [
        _rule(_front_door(svc), [target]),
        _rule([picker], [*engine_ports, names.KV_EVENTS_PORT]),
        {"from": [peers]},  # every port: side channel, UCX, data-parallel RPC
        _rule([operator], engine_ports),
    ]
    if scrapers:
        rules.append(_rule(_namespaces(scrapers), engine_ports))
    return _policy(svc, f"{svc.name}-engines", names.engine_pool_selector(svc), rules)


def _router(svc: LLMService, scrapers: list[str]) -> Obj:
    rules = [_rule(_front_door(svc), [names.ROUTER_GRPC_PORT])]
    if scrapers:
        rules.append(_rule(_namespaces(scrapers), [names.ROUTER_METRICS_PORT]))
    if render_peers.enabled(svc, "router"):
        replicas = {"podSelector": {"matchLabels": names.selector_labels(svc, "router")}}
        rules.append(_rule([replicas], [names.PEERS_PORT]))
    return _policy(svc, f"{svc.name}-router", names.selector_labels(svc, "router"), rules)


def _front_door(svc: LLMService) -> list[Obj]:
    """Who sends the service's requests (see the module docstring)."""
    gateway = svc.spec.gateway
    if gateway.mode == "standalone":
        return [{"podSelector": {"matchLabels": names.selector_labels(svc, "gateway")}}]
    if gateway.mode == "httpRoute" and gateway.parent_ref is not None and gateway.parent_ref.namespace \
            and gateway.parent_ref.namespace != svc.namespace:
        return _namespaces([gateway.parent_ref.namespace])
    return [{"podSelector": {}}]  # every pod of the service's own namespace


def _namespaces(namespaces: Sequence[str]) -> list[Obj]:
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: ns}}} for ns in dict.fromkeys(namespaces)]


def _rule(peers: list[Obj], ports: Sequence[int]) -> Obj:
    return {"from": peers, "ports": [{"protocol": "TCP", "port": p} for p in dict.fromkeys(ports)]}


def _policy(svc: LLMService, name: str, selector: dict[str, str], ingress: list[Any]) -> Obj:
    obj = new(svc, API_VERSION, "NetworkPolicy", name, "router")  # the router's labels carry no engine ones
    obj["metadata"]["labels"]["app.kubernetes.io/component"] = COMPONENT
    obj["spec"] = {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": ingress}
    return obj


__all__ = ["network_policies", "prometheus_namespace", "OPERATOR_NAMESPACE"]
