"""Pure renderers for the InferencePool's endpoint picker: what kvflow's router and GIE's EPP
share (the Service on the EPP's ports, gRPC probes, RBAC), and GIE's EPP itself.

Either picker is named ``<service>-router``, so the InferencePool's ``endpointPickerRef`` stays put
and switching ``routing.picker`` replaces the Deployment in place.
"""

from __future__ import annotations

import copy
from typing import Any

from kvflow.operator import args, names
from kvflow.operator.objects import Obj, config_file, content_hash, new
from kvflow.operator.render_pools import NON_ROOT
from kvflow.operator.render_replicas import rolling_update, spread_over_nodes
from kvflow.operator.spec import LLMService
from kvflow.router.config import BUILTIN_PLUGINS, BUILTIN_PROFILES

Rule = dict[str, list[str]]
_READ = ["get", "list", "watch"]
# Both pickers follow the pool's pods and read the InferencePool.
PICKER_RULES: list[Rule] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": [*_READ]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": [*_READ]},
]
# GIE's EPP also watches InferenceObjectives (request priorities); its cache does not start without.
GIE_RULES: list[Rule] = [
    *PICKER_RULES,
    {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"], "verbs": [*_READ]},
]


def grpc_probe(period: int) -> Obj:
    # GIE's EPP probes: gRPC health on its own plaintext port (kubelet probes speak no TLS).
    return {"grpc": {"port": names.ROUTER_HEALTH_PORT, "service": names.ROUTER_HEALTH_SERVICE},
            "periodSeconds": period}


PICKER_PORTS: list[Obj] = [
    {"name": "grpc", "containerPort": names.ROUTER_GRPC_PORT, "protocol": "TCP"},
    {"name": "grpc-health", "containerPort": names.ROUTER_HEALTH_PORT, "protocol": "TCP"},
    {"name": "metrics", "containerPort": names.ROUTER_METRICS_PORT, "protocol": "TCP"},
]


def picker_rbac(svc: LLMService, rules: list[Rule]) -> list[Obj]:
    """The picker's ServiceAccount, and a Role with ``rules`` bound to it."""
    name = names.child_name(svc, "router")
    account = new(svc, "v1", "ServiceAccount", name, "router")
    role = new(svc, "rbac.authorization.k8s.io/v1", "Role", name, "router")
    role["rules"] = [{key: list(value) for key, value in rule.items()} for rule in rules]  # no YAML aliases
    binding = new(svc, "rbac.authorization.k8s.io/v1", "RoleBinding", name, "router")
    binding["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    binding["subjects"] = [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}]
    return [account, role, binding]


def picker_service(svc: LLMService) -> Obj:
    service = new(svc, "v1", "Service", names.child_name(svc, "router"), "router")
    plaintext = svc.spec.routing.tls.mode == "Disabled"
    service["spec"] = {
        "selector": names.selector_labels(svc, "router"),
        "ports": [
            {"name": "grpc", "port": names.ROUTER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
             "appProtocol": "kubernetes.io/h2c" if plaintext else "http2"},
            {"name": "grpc-health", "port": names.ROUTER_HEALTH_PORT, "targetPort": "grpc-health", "protocol": "TCP"},
            {"name": "metrics", "port": names.ROUTER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
        ],
    }
    return service


def picker_deployment(svc: LLMService, pod_spec: Obj, config_text: str) -> Obj:
    deployment = new(svc, "apps/v1", "Deployment", names.child_name(svc, "router"), "router")
    deployment["spec"] = {
        "replicas": svc.spec.routing.replicas,
        "strategy": rolling_update(),
        "selector": {"matchLabels": names.selector_labels(svc, "router")},
        "template": {
            "metadata": {
                "labels": names.labels(svc, "router"),
                # A config change restarts the picker: it reads the file once at start.
                "annotations": {"kvflow.io/config-hash": content_hash(config_text)},
            },
            "spec": {**pod_spec, **spread_over_nodes(svc, "router")},
        },
    }
    return deployment


# kvflow's plugin types -> GIE v1.0's, for the same profile run by GIE's EPP. GIE has no
# active-request count (its queue scorer stands in), reads no KV events (its prefix scorer
# estimates hits from the prompt) and has no TTFT estimate: ttft-scorer becomes the two signals it
# weighs, the prefix cache and the queue.
GIE_SCORERS: dict[str, tuple[str, ...]] = {
    "prefix-cache-scorer": ("prefix-cache-scorer",), "precise-prefix-cache-scorer": ("prefix-cache-scorer",),
    "queue-scorer": ("queue-scorer",), "active-request-scorer": ("queue-scorer",),
    "running-requests-scorer": ("queue-scorer",), "kv-cache-utilization-scorer": ("kv-cache-utilization-scorer",),
    "lora-affinity-scorer": ("lora-affinity-scorer",), "ttft-scorer": ("prefix-cache-scorer", "queue-scorer"),
}
GIE_PICKERS = {"max-score-picker": "max-score-picker", "weighted-random-picker": "weighted-random-picker",
               "round-robin-picker": "random-picker"}
GIE_PROFILE = "default"


def profile_plugins(svc: LLMService) -> list[tuple[str, float | None]]:
    """(plugin type, weight) of the profile the router runs for this spec, in order."""
    routing = svc.spec.routing
    if routing.plugins:
        return [(p.type, p.weight) for p in routing.plugins]
    types = {p.name: p.type for p in BUILTIN_PLUGINS}
    profile = next(p for p in BUILTIN_PROFILES if p.name == routing.profile_name)
    return [(types[ref.plugin_ref], ref.weight) for ref in profile.plugins]


def gie_scorer_weights(svc: LLMService) -> tuple[dict[str, float], str]:
    """The GIE scorers (and their weights) closest to the router's profile, and GIE's picker."""
    weights: dict[str, float] = {}
    picker = "max-score-picker"
    for plugin_type, weight in profile_plugins(svc):
        if plugin_type in GIE_PICKERS:
            picker = GIE_PICKERS[plugin_type]
        for gie in GIE_SCORERS.get(plugin_type, ()):
            weights[gie] = weights.get(gie, 0.0) + float(weight or 0)
    weights = {name: weight for name, weight in sorted(weights.items()) if weight > 0}
    if not weights and picker == "max-score-picker":  # nothing to score: pick at random
        picker = "random-picker"
    return weights, picker


def gie_config(svc: LLMService) -> dict[str, Any]:
    """GIE's ``EndpointPickerConfig`` equivalent to kvflow's scoring for this spec."""
    weights, picker = gie_scorer_weights(svc)
    plugins = ["single-profile-handler", *weights, picker]
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": plugin} for plugin in plugins],
        "schedulingProfiles": [{"name": GIE_PROFILE, "plugins": [
            *({"pluginRef": plugin, "weight": weight} for plugin, weight in _integers(weights).items()),
            {"pluginRef": picker},
        ]}],
    }


def _integers(weights: dict[str, float]) -> dict[str, int]:
    # GIE's weights are integers: fractional ones are scaled by 10 to keep their ratios.
    scale = 1 if all(float(w).is_integer() for w in weights.values()) else 10
    return {plugin: round(weight * scale) for plugin, weight in weights.items()}


GIE_CONFIG_DIR = "/config"
GIE_CONFIG_FILE = "epp-config.yaml"


def gie_args(svc: LLMService) -> list[str]:
    """GIE's EPP flags (its chart's), on the same ports kvflow's router takes."""
    tls = svc.spec.routing.tls
    out = [
        "--pool-name", names.pool_name(svc), "--pool-namespace", svc.namespace,
        "--config-file", f"{GIE_CONFIG_DIR}/{GIE_CONFIG_FILE}",
        "--grpc-port", str(names.ROUTER_GRPC_PORT), "--grpc-health-port", str(names.ROUTER_HEALTH_PORT),
        "--metrics-port", str(names.ROUTER_METRICS_PORT), "--zap-encoder", "json",
    ]
    if tls.mode == "Disabled":
        out.append("--secure-serving=false")  # a Go bool flag takes its value after "="
    elif tls.mode == "Secret":
        out += ["--cert-path", args.TLS_DIR]
    return out


def gie_objects(svc: LLMService) -> list[Obj]:
    """GIE's EPP in the picker's place: RBAC, its config, Deployment and Service."""
    name = names.child_name(svc, "router")
    config_text, config, volume, mount = config_file(svc, name, "router", GIE_CONFIG_FILE, gie_config(svc),
                                                     GIE_CONFIG_DIR)
    volumes: list[Obj] = [volume]
    mounts: list[Obj] = [mount]
    tls = svc.spec.routing.tls
    if tls.mode == "Secret" and tls.secret_name:
        volumes.append({"name": "tls", "secret": {"secretName": tls.secret_name}})
        mounts.append({"name": "tls", "mountPath": args.TLS_DIR, "readOnly": True})
    container: Obj = {
        "name": "epp", "image": svc.spec.routing.gie_image, "imagePullPolicy": "IfNotPresent",
        "args": gie_args(svc),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": copy.deepcopy(PICKER_PORTS),
        "readinessProbe": grpc_probe(5),
        "livenessProbe": grpc_probe(10),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
        "securityContext": NON_ROOT,
    }
    pod_spec: Obj = {
        "serviceAccountName": name,
        "containers": [container],
        "volumes": volumes,
        # GIE's chart: as long as the longest grace period of the pool's pods.
        "terminationGracePeriodSeconds": 130,
    }
    return [*picker_rbac(svc, GIE_RULES), config, picker_deployment(svc, pod_spec, config_text),
            picker_service(svc)]
