"""Small, pure helpers for raw Kubernetes bodies: metadata, owner references, merging, hashing."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import yaml

from kvflow.operator import names
from kvflow.operator.spec import API_VERSION, KIND, LLMService

Obj = dict[str, Any]

# apiVersion/kind -> (API path prefix, plural, namespaced). The operator never needs discovery.
RESOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "ConfigMap"): ("/api/v1", "configmaps"),
    ("v1", "Secret"): ("/api/v1", "secrets"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("v1", "Event"): ("/api/v1", "events"),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("rbac.authorization.k8s.io/v1", "Role"): ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    ("inference.networking.k8s.io/v1", "InferencePool"):
        ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    ("keda.sh/v1alpha1", "ScaledObject"): ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    ("v1", "PersistentVolumeClaim"): ("/api/v1", "persistentvolumeclaims"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("coordination.k8s.io/v1", "Lease"): ("/apis/coordination.k8s.io/v1", "leases"),
    (API_VERSION, KIND): (f"/apis/{API_VERSION}", "llmservices"),
}

# The order in which children are applied: what others reference comes first.
APPLY_ORDER = [
    "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "Deployment",
    "LeaderWorkerSet",
    "PodDisruptionBudget", "NetworkPolicy", "InferencePool", "HTTPRoute", "HorizontalPodAutoscaler", "ScaledObject",
]


def key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """Identity of a child within one namespace: (apiVersion, kind, name)."""
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def owner_reference(svc: LLMService) -> Obj:
    return {
        "apiVersion": API_VERSION, "kind": KIND, "name": svc.name, "uid": svc.uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def new(svc: LLMService, api_version: str, kind: str, name: str, component: names.Component,
        *, annotations: Mapping[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": svc.namespace, "labels": names.labels(svc, component)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if svc.uid:  # a rendered-from-file object has no owner yet; the handlers always know it
        meta["ownerReferences"] = [owner_reference(svc)]
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


class ConfigFile(NamedTuple):
    """A component's config file: its text, the ConfigMap that holds it, and the pod's volume and mount."""

    text: str
    config_map: Obj
    volume: Obj
    mount: Obj


def config_file(svc: LLMService, name: str, component: names.Component, file_name: str, data: Any,
                mount_path: str) -> ConfigFile:
    """``data`` as YAML in ConfigMap ``name`` under ``file_name``, mounted read-only at ``mount_path``."""
    text = yaml.safe_dump(data, sort_keys=False)
    config_map = new(svc, "v1", "ConfigMap", name, component)
    config_map["data"] = {file_name: text}
    return ConfigFile(text, config_map, {"name": "config", "configMap": {"name": name}},
                      {"name": "config", "mountPath": mount_path, "readOnly": True})


def content_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


# Lists whose items merge field by field (a container named "engine" is amended); every other
# list of named items is merged item by item, each item *replaced* whole: a volume or an env
# variable has exactly one source, and merging two would give an object the API server refuses.
DEEP_MERGED_LISTS = frozenset({"containers", "initContainers"})
LIST_KEYS = {"volumeMounts": "mountPath", "ports": "containerPort"}


def merge(base: Any, override: Any, field: str | None = None) -> Any:
    """Merge ``override`` into ``base``: dicts by key, lists of named items by name.

    This is how a pool's ``podTemplate`` override lands on the rendered pod template: a
    container named ``engine`` in the override amends the rendered one; a volume named
    ``model-cache`` or an env variable ``HF_TOKEN`` replaces the rendered one of that name;
    volume mounts are matched by path. Other lists (args, tolerations) are replaced.
    """
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for k, v in override.items():
            out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    key = LIST_KEYS.get(field or "", "name")
    if isinstance(base, list) and isinstance(override, list) and _keyed(base, key) and _keyed(override, key):
        out_list = copy.deepcopy(base)
        index = {item[key]: i for i, item in enumerate(out_list)}
        for item in override:
            if item[key] not in index:
                out_list.append(copy.deepcopy(item))
            elif field in DEEP_MERGED_LISTS:
                out_list[index[item[key]]] = merge(out_list[index[item[key]]], item)
            else:
                out_list[index[item[key]]] = copy.deepcopy(item)
        return out_list
    return copy.deepcopy(override)


def _keyed(items: list[Any], key: str) -> bool:
    return all(isinstance(item, dict) and key in item for item in items)


def sort_for_apply(objs: list[Obj]) -> list[Obj]:
    return sorted(objs, key=lambda o: (APPLY_ORDER.index(o["kind"]), o["metadata"]["name"]))
