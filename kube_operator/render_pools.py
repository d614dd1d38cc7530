"""Pure renderers for the engine pools: Deployments (or LeaderWorkerSets for multi-node pools),
Services, PDBs, the model cache claim and the InferencePool.

A service renders one aggregated pool (role ``both``, named ``<service>-aggregated``) unless its
prefill pool has replicas; then a prefill and a decode pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.operator import args, names, volumes
from kvflow.operator.objects import Obj, content_hash, merge, new
from kvflow.operator.spec import ENGINE_CONTAINER, Engine, LLMService, PoolRole

NON_ROOT: Obj = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}
SIDECAR_CONTAINER = "routing-sidecar"
LWS_API = "leaderworkerset.x-k8s.io/v1"


def engine_image(svc: LLMService, images: names.Images) -> str:
    if svc.spec.engine.image:
        return svc.spec.engine.image
    if svc.spec.engine.kind == "sim":  # simulated P/D moves KV with real NIXL: the image that has it
        nixl = svc.spec.disaggregated and svc.spec.kv_transfer.connector == "NixlConnector"
        return images.kvflow_nixl if nixl else images.kvflow
    return images.vllm


def pool_replicas(svc: LLMService, role: PoolRole) -> int | None:
    """Replicas to render; None when an HPA or KEDA owns the field (server-side apply leaves it)."""
    pool = svc.spec.pool(role)
    mode = svc.spec.autoscaling.mode
    if mode in ("hpa", "keda"):
        return None
    if mode == "operator" and pool.autoscaling is not None:
        return max(pool.autoscaling.min_replicas, min(pool.replicas, pool.autoscaling.max_replicas))
    return pool.replicas


def rendered_roles(svc: LLMService) -> tuple[PoolRole, ...]:
    return svc.spec.roles


def workload_kind(svc: LLMService, role: PoolRole) -> tuple[str, str]:
    """(apiVersion, kind) of the pool's workload: a Deployment, or a LeaderWorkerSet when one
    engine spans several pods."""
    return (LWS_API, "LeaderWorkerSet") if svc.spec.engine_for(role).multi_node else ("apps/v1", "Deployment")


def _env(svc: LLMService, engine: Engine) -> list[Obj]:
    spec = svc.spec
    env: list[Obj] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # Prefix-block hashes must match between engines and the router.
        {"name": "PYTHONHASHSEED", "value": spec.routing.hash_seed},
    ]
    if spec.kv_transfer.connector == "NixlConnector" and spec.disaggregated:
        env += [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.kv_transfer.side_channel_port)},
        ]
    if spec.model.scheme == "hf":
        env.append({"name": "HF_HOME", "value": volumes.HF_CACHE_DIR})
    if spec.model.lora_adapters:  # the operator loads and unloads adapters through vLLM's API
        env.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"})
    env += [dict(item) for item in engine.env]
    return env


GIB = 1 << 30


def _resources(svc: LLMService, role: PoolRole, engine: Engine) -> Obj:
    """The pool's resources, with the accelerators its parallelism needs and the memory of its
    CPU KV tier added."""
    resources: Obj = {k: dict(v) for k, v in svc.spec.pool(role).resources.items()}
    if engine.accelerator is not None and engine.accelerator not in resources.get("limits", {}):
        resources.setdefault("limits", {})[engine.accelerator] = engine.parallelism.devices
    if engine.kv_offloading_size is not None:
        extra = int(engine.kv_offloading_size * GIB)
        for kind in ("requests", "limits"):
            if "memory" in resources.get(kind, {}):
                resources[kind]["memory"] = str(parse_bytes(resources[kind]["memory"]) + extra)
        resources.setdefault("requests", {}).setdefault("memory", str(extra))
    return resources


_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def parse_bytes(quantity: Any) -> int:
    """A Kubernetes memory quantity ("64Gi", "500M", 1024) in bytes."""
    text = str(quantity)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * _SUFFIXES[suffix])
    return int(float(text))


def _probe(port: str, *, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": "/health", "port": port},
        "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5,
    }


def engine_container(svc: LLMService, role: PoolRole, images: names.Images, *, worker: bool = False) -> Obj:
    """The engine container; ``worker``: a headless worker of a multi-node group (no API, no probes)."""
    spec = svc.spec
    engine = spec.engine_for(role)
    command, arguments = args.engine(svc, role, worker=worker)
    # With a sidecar in front, "http" (what Services and the InferencePool target) is the sidecar's.
    port_name = "engine" if names.uses_sidecar(svc, role) else "http"
    ports: list[Obj] = [] if worker else [
        {"name": port_name, "containerPort": names.engine_port(svc, role), "protocol": "TCP"}]
    if spec.kv_transfer.connector == "NixlConnector" and spec.disaggregated:
        ports.append({"name": "nixl", "containerPort": spec.kv_transfer.side_channel_port, "protocol": "TCP"})
    if spec.routing.kv_events and not worker:  # vLLM offsets the publisher's port by the data-parallel rank
        for rank in range(engine.parallelism.local_ranks):
            ports.append({"name": "kv-events" if rank == 0 else f"kv-events-{rank}",
                          "containerPort": names.KV_EVENTS_PORT + rank, "protocol": "TCP"})
    if engine.multi_node and not worker:
        ports.append({"name": "dp-rpc", "containerPort": names.DATA_PARALLEL_RPC_PORT, "protocol": "TCP"})
    container: Obj = {
        "name": ENGINE_CONTAINER,
        "image": engine_image(svc, images),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "args": arguments,
        "env": _env(svc, engine),
        "ports": ports,
        "resources": _resources(svc, role, engine),
        "volumeMounts": list(volumes.engine_storage(svc).mounts),
    }
    if spec.model.credentials_secret:  # every pod of a group loads its share of the weights
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
    if worker:
        return container
    return {
        **container,
        # Model loading can take many minutes: the startup probe covers it, then liveness is strict.
        "startupProbe": _probe(port_name, period=10, failures=180),
        "readinessProbe": _probe(port_name, period=5, failures=3),
        "livenessProbe": _probe(port_name, period=10, failures=6),
        # Let the endpoints controller and the router drop the pod before the engine stops.
        "lifecycle": {"preStop": {"sleep": {"seconds": 10}}},
    }


def sidecar_container(svc: LLMService, images: names.Images) -> Obj:
    command, arguments = args.routing_sidecar(svc)
    return {
        "name": SIDECAR_CONTAINER, "image": images.kvflow, "command": command, "args": arguments,
        "ports": [{"name": "http", "containerPort": svc.spec.engine.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": NON_ROOT,
    }


def revision(svc: LLMService, images: names.Images) -> str:
    """What decides whether two engines' KV caches are interchangeable: a prefill pod and a decode
    pod of different revisions must not be paired (the router reads ``kvflow.io/revision``).
    A pool's own parallelism and arguments are not part of it: NIXL moves KV between engines of
    different tensor-parallel sizes."""
    spec = svc.spec
    engine = spec.engine
    return content_hash({
        "model": spec.model.model_dump(mode="json", exclude={"lora_adapters", "credentials_secret"}),
        "engine": engine.model_dump(mode="json", exclude={"port", "image_pull_policy"}, exclude_none=True),
        "image": engine_image(svc, images), "hashSeed": spec.routing.hash_seed,
        # what a decode pod does when a pull fails changes no KV (nor, so, any revision)
        "kvTransfer": spec.kv_transfer.model_dump(mode="json", exclude={"load_failure_policy"}),
    })[:12]


def pod_template(svc: LLMService, role: PoolRole, images: names.Images, *, worker: bool = False) -> Obj:
    pool = svc.spec.pool(role)
    storage = volumes.with_image(volumes.engine_storage(svc), images.kvflow, NON_ROOT)
    containers = [engine_container(svc, role, images, worker=worker)]
    if names.uses_sidecar(svc, role) and not worker:
        containers.append(sidecar_container(svc, images))
    pod_spec: Obj = {
        "containers": containers,
        "volumes": list(storage.volumes),
        "terminationGracePeriodSeconds": svc.spec.lifecycle.termination_grace_period_seconds,
    }
    if storage.init_containers:
        pod_spec["initContainers"] = list(storage.init_containers)
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in pool.tolerations]
    labels = {**pool.pod_template.labels, **names.labels(svc, role), names.LABEL_REVISION: revision(svc, images)}
    if worker:  # the router and the pool's Service address only the group's leader
        labels[names.LABEL_ENGINE] = "worker"
    metadata: Obj = {
        # Spec labels first: the operator's (selectors, role, revision) always win.
        "labels": labels,
        "annotations": {
            "prometheus.io/scrape": "false" if worker else "true",
            "prometheus.io/port": str(names.engine_port(svc, role)),
            "prometheus.io/path": "/metrics", **pool.pod_template.annotations,
        },
    }
    return {"metadata": metadata, "spec": merge(pod_spec, pool.pod_template.spec)}


def deployment(svc: LLMService, role: PoolRole, images: names.Images) -> Obj:
    template = pod_template(svc, role, images)
    obj = new(svc, "apps/v1", "Deployment", names.child_name(svc, role), role,
              annotations={names.ANNOTATION_TEMPLATE_HASH: content_hash(template)})
    spec: Obj = {
        "selector": {"matchLabels": names.selector_labels(svc, role)},
        # By default never below the available replicas: surge a new pod, then retire an old one.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {
            "maxUnavailable": svc.spec.rollout.max_unavailable, "maxSurge": svc.spec.rollout.max_surge}},
        "revisionHistoryLimit": 5,
        "progressDeadlineSeconds": 3600,
        "template": template,
    }
    replicas = pool_replicas(svc, role)
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    obj["spec"] = spec
    return obj


def leader_worker_set(svc: LLMService, role: PoolRole, images: names.Images) -> Obj:
    """A multi-node pool: each replica is a group of ``parallelism.data / dataLocal`` pods (one
    engine), recreated whole when one of its pods restarts."""
    engine = svc.spec.engine_for(role)
    leader = pod_template(svc, role, images)
    worker = pod_template(svc, role, images, worker=True)
    obj = new(svc, LWS_API, "LeaderWorkerSet", names.child_name(svc, role), role,
              annotations={names.ANNOTATION_TEMPLATE_HASH: content_hash([leader, worker])})
    spec: Obj = {
        "leaderWorkerTemplate": {
            "size": engine.parallelism.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
        "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
            "maxUnavailable": svc.spec.rollout.max_unavailable, "maxSurge": svc.spec.rollout.max_surge}},
        "startupPolicy": "LeaderCreated",
    }
    replicas = pool_replicas(svc, role)
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    obj["spec"] = spec
    return obj


def service(svc: LLMService, role: PoolRole) -> Obj:
    obj = new(svc, "v1", "Service", names.child_name(svc, role), role)
    obj["spec"] = {
        "clusterIP": "None",  # headless: the router and Prometheus address pods directly
        "publishNotReadyAddresses": False,
        "selector": {**names.selector_labels(svc, role), names.LABEL_ENGINE: "true"},
        "ports": [{"name": "http", "port": svc.spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
    }
    return obj


def disruption_budget(svc: LLMService, role: PoolRole) -> Obj:
    obj = new(svc, "policy/v1", "PodDisruptionBudget", names.child_name(svc, role), role)
    obj["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(svc, role)}}
    return obj


def model_cache_claim(svc: LLMService) -> Obj | None:
    """The hub download cache every engine pod of the service shares (model.cacheSize)."""
    model = svc.spec.model
    if not model.cache_size:
        return None
    obj = new(svc, "v1", "PersistentVolumeClaim", volumes.cache_claim_name(svc), "both")
    obj["spec"] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": model.cache_size}}}
    if model.cache_storage_class:
        obj["spec"]["storageClassName"] = model.cache_storage_class
    return obj


def inference_pool(svc: LLMService) -> Obj:
    obj = new(svc, "inference.networking.k8s.io/v1", "InferencePool", names.pool_name(svc), "router")
    obj["spec"] = {
        "selector": {"matchLabels": names.engine_pool_selector(svc)},
        "targetPorts": [{"number": svc.spec.engine.port}],
        "endpointPickerRef": {
            "group": "", "kind": "Service", "name": names.child_name(svc, "router"),
            "port": {"number": names.ROUTER_GRPC_PORT},
            "failureMode": svc.spec.routing.failure_mode,
        },
    }
    return obj


def render_pools(svc: LLMService, images: names.Images) -> list[Obj]:
    out: list[Obj] = []
    for role in rendered_roles(svc):
        workload = leader_worker_set if svc.spec.engine_for(role).multi_node else deployment
        out += [workload(svc, role, images), service(svc, role), disruption_budget(svc, role)]
    claim = model_cache_claim(svc)
    if claim is not None:
        out.append(claim)
    out.append(inference_pool(svc))
    return out


def template_hash(obj: Mapping[str, Any]) -> str | None:
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH)
    return value if isinstance(value, str) else None
