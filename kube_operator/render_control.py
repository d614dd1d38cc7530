"""Pure renderers for the control path: router, gateway or HTTPRoute, and autoscalers."""

from __future__ import annotations

import copy
from typing import Any

from kvflow.operator import args, names, render_peers, volumes
from kvflow.operator.objects import Obj, config_file, content_hash, new
from kvflow.operator.render_picker import (
    PICKER_PORTS,
    PICKER_RULES,
    gie_objects,
    grpc_probe,
    picker_deployment,
    picker_rbac,
    picker_service,
)
from kvflow.operator.render_pools import NON_ROOT, rendered_roles, workload_kind
from kvflow.operator.render_replicas import HOSTNAME, replica_budget, rolling_update, spread_over_nodes
from kvflow.operator.spec import CUSTOM_PROFILE, InvalidSpecError, LLMService, PoolRole
from kvflow.protocol.vllm_metrics import WAITING
from kvflow.router.config import load_config

def _custom_profile(svc: LLMService) -> dict[str, Any]:
    """routing.plugins as the router's ``plugins`` and one scheduling profile that uses them."""
    entries = svc.spec.routing.plugins
    plugins = [{"name": e.ref, "type": e.type, **({"parameters": dict(e.parameters)} if e.parameters else {})}
               for e in entries]
    refs = [{"pluginRef": e.ref, **({"weight": e.weight} if e.weight is not None else {})} for e in entries]
    return {"plugins": plugins, "schedulingProfiles": [{"name": CUSTOM_PROFILE, "plugins": refs}]}


def router_config(svc: LLMService, component: render_peers.Routing = "router") -> dict[str, Any]:
    """The router's configuration file (``kvflow router --config``), in its strict schema, and
    checked by the router's own loader: a spec whose plugins the router would refuse is refused
    here (an ``InvalidSpec`` condition), never rendered into a crash-looping router.

    ``component`` is the one that runs it, the picker or the gateway: its replicas, if it has
    several, share what they route with each other (``render_peers.py``)."""
    spec = svc.spec
    engines = [spec.engine_for(role) for role in spec.roles]
    kv_events: dict[str, Any] = {"enabled": spec.routing.kv_events, "port": names.KV_EVENTS_PORT,
                                 "dataParallelSize": max(e.parallelism.local_ranks for e in engines)}
    if any(e.kv_offloading_size for e in engines):  # a CPU tier keeps what the GPU cache evicts
        kv_events["predictEvictions"] = False
    config: dict[str, Any] = {
        "blockSize": spec.engine.block_size,
        "hashSeed": spec.routing.hash_seed,
        "defaultProfile": spec.routing.profile_name,
        "kvEvents": kv_events,
        # P/D happens only where the pool has prefill pods: an aggregated service has none.
        "pd": {"threshold": spec.routing.pd_threshold},
        "pool": {"name": names.pool_name(svc), "kubernetes": {
            "namespace": svc.namespace, "inferencePool": names.pool_name(svc), "roleLabel": names.LABEL_ROLE}},
    }
    if spec.model.lora_adapters:
        config["loraPaths"] = {a.name: args.adapter_path(a.source) for a in spec.model.lora_adapters}
    if spec.routing.plugins:
        config |= _custom_profile(svc)
    if render_peers.enabled(svc, component):
        config["peers"] = render_peers.config(svc, component)
    try:
        load_config(config)
    except ValueError as exc:
        raise InvalidSpecError(f"routing.plugins: {str(exc).removeprefix('invalid router config: ')}") from None
    return config


def gateway_config(svc: LLMService) -> dict[str, Any]:
    """The gateway's configuration file (``kvflow gateway --config``): one pool, its router inside."""
    config = router_config(svc, "gateway")
    return {
        "host": "0.0.0.0",
        "port": svc.spec.gateway.port,
        "pools": [{"model": svc.spec.model.name, "profile": config["defaultProfile"], "router_config": config,
                   "tokenizer": volumes.tokenizer_storage(svc)[1],
                   "hold_when_empty_seconds": svc.spec.gateway.hold_seconds}],
        "batch": {"dir": BATCH_DIR},
    }


BATCH_DIR = "/var/lib/kvflow/batches"


def _batch_volume(svc: LLMService) -> tuple[Obj, Obj]:
    """The Batch API's writable directory (the root filesystem is read-only): the LLMService's
    claim, or an emptyDir."""
    claim = svc.spec.gateway.batch_claim
    source: Obj = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    return {"name": "batches", **source}, {"name": "batches", "mountPath": BATCH_DIR}


def _gateway_placement(svc: LLMService) -> Obj:
    """Where the gateway's replicas go: on different nodes, unless they share a batch claim.

    Replicas sharing a claim share one SQLite database through one node's filesystem (a
    ReadWriteOnce volume; SQLite's locks do not hold over NFS), so they are all kept on the node
    that mounts it, and spreading them would only leave replicas unable to start. That holds
    for a single replica too: its rolling update's surge pod must start where the claim is
    attached, or it waits forever for the volume the old pod holds.
    """
    if svc.spec.gateway.batch_claim is None:
        return spread_over_nodes(svc, "gateway")
    return {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": names.selector_labels(svc, "gateway")}, "topologyKey": HOSTNAME}]}}}


def _secret_storage(volume: str, secret: str, path: str) -> volumes.Storage:
    return volumes.Storage(({"name": volume, "secret": {"secretName": secret}},),
                           ({"name": volume, "mountPath": path, "readOnly": True},))


def router_storage(svc: LLMService, images: names.Images) -> volumes.Storage:
    """The tokenizer (with the init container that fetches a hub model's), and TLS material."""
    storage = volumes.tokenizer_storage(svc)[0]
    tls = svc.spec.routing.tls
    if tls.mode == "Secret" and tls.secret_name:
        storage += _secret_storage("tls", tls.secret_name, args.TLS_DIR)
    if tls.client_ca_secret_name:
        storage += _secret_storage("client-ca", tls.client_ca_secret_name, args.CLIENT_CA_DIR)
    if render_peers.enabled(svc, "router"):
        storage += render_peers.storage(svc)
    return volumes.with_image(storage, images.kvflow, NON_ROOT)


def router_objects(svc: LLMService, images: names.Images) -> list[Obj]:
    name = names.child_name(svc, "router")
    config_text, config, volume, mount = config_file(svc, name, "router", names.ROUTER_CONFIG_FILE,
                                                     router_config(svc), names.CONFIG_DIR)
    command, arguments = args.router(svc)
    storage = router_storage(svc, images)
    container: Obj = {
        "name": "router", "image": images.kvflow, "command": command, "args": arguments,
        "env": [{"name": "PYTHONHASHSEED", "value": svc.spec.routing.hash_seed}],
        "ports": [*copy.deepcopy(PICKER_PORTS),
                  *([render_peers.container_port()] if render_peers.enabled(svc, "router") else [])],
        "readinessProbe": grpc_probe(5),
        "livenessProbe": grpc_probe(10),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [mount, *storage.mounts],
        "securityContext": NON_ROOT,
    }
    pod_spec: Obj = {
        "serviceAccountName": name,
        "containers": [container],
        "volumes": [volume, *storage.volumes],
        "terminationGracePeriodSeconds": 30,
    }
    if storage.init_containers:
        pod_spec["initContainers"] = list(storage.init_containers)
    # The router (and the gateway's embedded one) follow the pool's pods.
    return [*picker_rbac(svc, PICKER_RULES), config, picker_deployment(svc, pod_spec, config_text),
            picker_service(svc)]


def picker_objects(svc: LLMService, images: names.Images) -> list[Obj]:
    """The InferencePool's endpoint picker: kvflow's router, or GIE's EPP (routing.picker), and
    the disruption budget of its replicas."""
    objs = gie_objects(svc) if svc.spec.routing.picker == "gie" else router_objects(svc, images)
    return objs + replica_budget(svc, "router", svc.spec.routing.replicas)


def gateway_objects(svc: LLMService, images: names.Images) -> list[Obj]:
    gateway = svc.spec.gateway
    if gateway.mode == "none":
        return []
    if gateway.mode == "httpRoute":
        return [http_route(svc)]
    name = names.child_name(svc, "gateway")
    config_text, config, volume, mount = config_file(svc, name, "gateway", names.GATEWAY_CONFIG_FILE,
                                                     gateway_config(svc), names.CONFIG_DIR)
    command, arguments = args.gateway(svc)
    storage = volumes.with_image(volumes.tokenizer_storage(svc)[0], images.kvflow, NON_ROOT)
    ports: list[Obj] = [{"name": "http", "containerPort": gateway.port, "protocol": "TCP"}]
    if render_peers.enabled(svc, "gateway"):
        storage += render_peers.storage(svc)
        ports.append(render_peers.container_port())
    batch_volume, batch_mount = _batch_volume(svc)
    deployment = new(svc, "apps/v1", "Deployment", name, "gateway")
    deployment["spec"] = {
        "replicas": gateway.replicas,
        "strategy": rolling_update(),
        "selector": {"matchLabels": names.selector_labels(svc, "gateway")},
        "template": {
            "metadata": {"labels": names.labels(svc, "gateway"),
                         "annotations": {"kvflow.io/config-hash": content_hash(config_text)}},
            "spec": {
                # The gateway's embedded router follows the pool's pods with the router's Role.
                "serviceAccountName": names.child_name(svc, "router"),
                "containers": [{
                    "name": "gateway", "image": images.kvflow, "command": command, "args": arguments,
                    "env": [{"name": "PYTHONHASHSEED", "value": svc.spec.routing.hash_seed}],
                    "ports": ports,
                    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
                    "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
                    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                    "volumeMounts": [mount, *storage.mounts, batch_mount],
                    "securityContext": NON_ROOT,
                }],
                "volumes": [volume, *storage.volumes, batch_volume],
                **({"initContainers": list(storage.init_containers)} if storage.init_containers else {}),
                "terminationGracePeriodSeconds": 30,
                **_gateway_placement(svc),
            },
        },
    }
    service = new(svc, "v1", "Service", name, "gateway")
    service["spec"] = {
        "type": gateway.service_type,
        "selector": names.selector_labels(svc, "gateway"),
        "ports": [{"name": "http", "port": gateway.port, "targetPort": "http", "protocol": "TCP"}],
    }
    return [config, deployment, service, *replica_budget(svc, "gateway", gateway.replicas)]


def http_route(svc: LLMService) -> Obj:
    parent = svc.spec.gateway.parent_ref
    assert parent is not None  # guaranteed by GatewaySpec validation
    ref: Obj = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": parent.name}
    if parent.namespace:
        ref["namespace"] = parent.namespace
    if parent.section_name:
        ref["sectionName"] = parent.section_name
    route = new(svc, "gateway.networking.k8s.io/v1", "HTTPRoute", svc.name, "gateway")
    route["spec"] = {
        "parentRefs": [ref],
        "rules": [{
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                             "name": names.pool_name(svc)}],
            "timeouts": {"request": "300s"},
        }],
    }
    if svc.spec.gateway.hostnames:
        route["spec"]["hostnames"] = list(svc.spec.gateway.hostnames)
    return route


QUEUE_METRIC = WAITING
QUEUE_METRIC_ADAPTED = WAITING.replace(":", "_")  # prometheus-adapter exposes it without colons


def autoscaler_objects(svc: LLMService) -> list[Obj]:
    mode = svc.spec.autoscaling.mode
    if mode not in ("hpa", "keda"):
        return []
    return [_hpa(svc, role) if mode == "hpa" else _scaled_object(svc, role) for role in rendered_roles(svc)]


def _bounds(svc: LLMService, role: PoolRole) -> tuple[int, int]:
    auto = svc.spec.pool(role).autoscaling
    assert auto is not None  # guaranteed by LLMServiceSpec validation
    return auto.min_replicas, auto.max_replicas


def _hpa(svc: LLMService, role: PoolRole) -> Obj:
    low, high = _bounds(svc, role)
    obj = new(svc, "autoscaling/v2", "HorizontalPodAutoscaler", names.child_name(svc, role), role)
    api_version, kind = workload_kind(svc, role)
    obj["spec"] = {
        "scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": names.child_name(svc, role)},
        "minReplicas": low, "maxReplicas": high,
        "metrics": [{"type": "Pods", "pods": {
            "metric": {"name": QUEUE_METRIC_ADAPTED},
            "target": {"type": "AverageValue", "averageValue": _quantity(svc.spec.autoscaling.target_queue_depth)},
        }}],
        "behavior": {"scaleDown": {
            "stabilizationWindowSeconds": svc.spec.autoscaling.scale_down_stabilization_seconds}},
    }
    return obj


HELD_METRIC = "kvflow_gateway_held_requests"  # requests the gateway holds for a pool with no ready pod


def scaling_query(svc: LLMService, role: PoolRole) -> str:
    """Prometheus query of a pool's demand: its engines' queues and, for the pool that serves
    requests, what the gateway holds for it, which is all there is to read while it has no pods."""
    waiting = (f'sum({QUEUE_METRIC}{{namespace="{svc.namespace}",'
               f'pod=~"{names.child_name(svc, role)}-.*"}}) or vector(0)')
    if role == "prefill":
        return waiting
    held = f'sum({HELD_METRIC}{{namespace="{svc.namespace}",model="{svc.spec.model.name}"}}) or vector(0)'
    return f"({waiting}) + ({held})"


def _scaled_object(svc: LLMService, role: PoolRole) -> Obj:
    low, high = _bounds(svc, role)
    obj = new(svc, "keda.sh/v1alpha1", "ScaledObject", names.child_name(svc, role), role)
    api_version, kind = workload_kind(svc, role)
    obj["spec"] = {
        "scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": names.child_name(svc, role)},
        "minReplicaCount": low, "maxReplicaCount": high, "cooldownPeriod": 300,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
            "stabilizationWindowSeconds": svc.spec.autoscaling.scale_down_stabilization_seconds}}}},
        "triggers": [{"type": "prometheus", "metadata": {
            "serverAddress": svc.spec.autoscaling.prometheus_address,
            "query": scaling_query(svc, role), "threshold": _quantity(svc.spec.autoscaling.target_queue_depth),
            # Any demand at all wakes a pool at zero.
            "activationThreshold": "0",
        }}],
    }
    return obj


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{int(value * 1000)}m"

