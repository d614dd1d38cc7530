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
from kvflow.operator.spec import LLMService

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
        "selector": {"matchLabels": names.selector_labels(svc, "router")},
        "template": {
            "metadata": {
                "labels": names.labels(svc, "router"),
                # A config change restarts the picker: it reads the file once at start.
                "annotations": {"kvflow.io/config-hash": content_hash(config_text)},
            },
            "spec": pod_spec,
        },
    }
    return deployment


# routing.scorerWeights -> GIE v1.0's scorer plugins. GIE has no active-request count, so kvflow's
# "load" falls back on the queue; its prefix scorer estimates cache hits from the prompt's
# characters (it reads no KV events).
GIE_SCORERS = {"prefix": "prefix-cache-scorer", "load": "queue-scorer", "queueDepth": "queue-scorer",
               "kvCacheUtilization": "kv-cache-utilization-scorer", "lora": "lora-affinity-scorer"}
GIE_PROFILE = "default"


def gie_scorer_weights(svc: LLMService) -> dict[str, float]:
    """The GIE scorers (and their weights) closest to the router's profile for this spec."""
    routing = svc.spec.routing
    if routing.scheduler_profile == "random":
        return {}
    if routing.scheduler_profile == "load":  # the router's least-load, less active requests
        return {"queue-scorer": 1.0, "kv-cache-utilization-scorer": 1.0}
    weights: dict[str, float] = {}
    for scorer, weight in sorted(routing.scorer_weights.items()):
        if weight > 0:
            plugin = GIE_SCORERS[scorer]
            weights[plugin] = weights.get(plugin, 0.0) + weight
    return weights


def gie_config(svc: LLMService) -> dict[str, Any]:
    """GIE's ``EndpointPickerConfig`` equivalent to kvflow's scoring for this spec."""
    weights = gie_scorer_weights(svc)
    picker = "max-score-picker" if weights else "random-picker"
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
