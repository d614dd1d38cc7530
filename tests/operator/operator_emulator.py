"""A stricter Kubernetes emulator on top of kmock's, for the operator's end-to-end tests.

kmock's ``KubernetesEmulator`` stores objects and streams watch events. This subclass adds what
the operator relies on from a real API server:

* metadata stamping: uid, resourceVersion, generation (bumped on spec changes only),
  creationTimestamp, generateName;
* server-side apply (``PATCH`` with ``application/apply-patch+yaml``): create when missing,
  otherwise merge (lists replaced, which is what a sole field manager sees);
* the status subresource: ``/status`` writes touch only ``.status``, main writes never do;
* label selectors on lists, delete preconditions (uid), optimistic concurrency (a write that
  carries a stale ``metadata.resourceVersion`` gets 409 Conflict), and the garbage collector's
  background cascade over ownerReferences;
* an audit log of every API call (verb, group, resource, subresource, namespace) for the
  RBAC audit.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import itertools
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import rendering
from kmock._internal.k8s import KubernetesError, KubernetesObjectNotFoundError

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status", "eviction"}},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/persistentvolumeclaims": {"kind": "PersistentVolumeClaim", "namespaced": True},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status"}},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "autoscaling/v2/horizontalpodautoscalers": {"kind": "HorizontalPodAutoscaler", "namespaced": True},
    "inference.networking.k8s.io/v1/inferencepools": {"kind": "InferencePool", "namespaced": True,
                                                       "subresources": {"status"}},
    "gateway.networking.k8s.io/v1/httproutes": {"kind": "HTTPRoute", "namespaced": True},
    "coordination.k8s.io/v1/leases": {"kind": "Lease", "namespaced": True},
    "kvflow.io/v1alpha1/llmservices": {"kind": "LLMService", "namespaced": True, "subresources": {"status"},
                                        "shortnames": {"llms"}},
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


@dataclasses.dataclass(frozen=True)
class AuditEntry:
    verb: str
    group: str
    resource: str
    subresource: str | None
    namespace: str | None
    name: str | None
    user_agent: str = ""


class Cluster(kmock.KubernetesEmulator):  # type: ignore[misc]
    """Use as ``async with Cluster() as k8s, kmock.Server(k8s) as server: ...``."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.audit: list[AuditEntry] = []
        self._rv = itertools.count(1)
        for key, info in RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)

    # -- reads: kmock serves them; we only add label selectors to lists ----------------------

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        selector = _parse_selector(request.params.get("labelSelector", ""))
        if selector:
            result["items"] = [i for i in result["items"] if _matches(i, selector)]
        return result

    # -- writes: handled here entirely ----------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or not request.resource.plural:
            return await super()._handle(request)  # discovery: no RBAC needed (system:discovery)
        self.audit.append(_audit_entry(request))
        method = request.method.value
        try:
            if method == "POST" and request.subresource == "eviction":
                return await self._evict(request)
            if method == "POST":
                return await self._create(request, dict(request.data or {}))
            if method == "PATCH":
                return await self._patch(request)
            if method == "PUT":
                return await self._put(request)
            if method == "DELETE" and request.name:
                return await self._delete(request)
        except KubernetesError as exc:
            return await self._render_error(exc)
        return await super()._handle(request)

    def _now(self) -> str:
        return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _stamp_new(self, obj: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)), generation=1,
                    creationTimestamp=self._now())
        meta.pop("managedFields", None)
        return obj

    async def _publish(self, request: rendering.Request, kind: str, raw: dict[str, Any]) -> None:
        assert request.resource is not None
        await self._buses[request.resource].put({"type": kind, "object": copy.deepcopy(raw)})

    async def _create(self, request: rendering.Request, obj: dict[str, Any]) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        obj = self._stamp_new(copy.deepcopy(obj), request)
        key = (request.resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        async with self._lock:
            if key in self._objects and not self._objects[key].deleted:
                raise KubernetesError(status=409, reason="AlreadyExists", message=f"{key[2]} already exists")
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._publish(request, "ADDED", obj)
        return aiohttp.web.json_response(obj, status=201)

    def _existing(self, request: rendering.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    async def _store(self, request: rendering.Request, old: dict[str, Any], new: dict[str, Any]) -> Any:
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "name", "namespace"):
            if field in old.get("metadata", {}):
                meta[field] = old["metadata"][field]
        generation = int(old["metadata"].get("generation", 1))
        if _spec_of(old) != _spec_of(new):
            generation += 1
        meta["generation"] = generation
        meta["resourceVersion"] = str(next(self._rv))
        key = (request.resource, request.namespace, request.name)
        gone = bool(meta.get("deletionTimestamp")) and not meta.get("finalizers")
        self._objects[key].create(new)
        await self._publish(request, "MODIFIED", new)
        if gone:
            await self._remove(request.resource, request.namespace, request.name)
        return aiohttp.web.json_response(new)

    async def _patch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        content_type = request.headers.get("Content-Type", "")
        async with self._lock:
            old = self._existing(request)
        if old is None:
            if "apply-patch" in content_type and not request.subresource:
                # Creating through apply needs the create permission too.
                self.audit.append(dataclasses.replace(self.audit[-1], verb="create"))
                return await self._create(request, dict(request.data or {}))
            raise KubernetesObjectNotFoundError()
        async with self._lock:
            if "json-patch+json" in content_type:
                try:
                    new = jsonpatch.apply_patch(old, request.data or [])
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                    raise KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
                if request.subresource == "status":
                    new = {**old, "status": new.get("status")}
                elif "status" in old:
                    new["status"] = old["status"]
                return await self._store(request, old, new)
            patch = dict(request.data or {})
            patch.pop("apiVersion", None) if "apply-patch" not in content_type else None
            if request.subresource == "status":
                new = copy.deepcopy(old)
                new["status"] = _merge(old.get("status") or {}, patch.get("status") or {})
            else:
                patch.pop("status", None)
                patch.get("metadata", {}).pop("managedFields", None)
                new = _merge(old, patch)
                if "status" in old:
                    new["status"] = old["status"]
            return await self._store(request, old, new)

    async def _put(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        async with self._lock:
            old = self._existing(request)
            if old is None:
                raise KubernetesObjectNotFoundError()
            body = dict(request.data or {})
            _check_version(old, body)
            if request.subresource == "status":
                new = copy.deepcopy(old)
                new["status"] = body.get("status")
            else:
                new = {**body, "status": old.get("status")} if "status" in old else body
            return await self._store(request, old, new)

    async def _delete(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        async with self._lock:
            old = self._existing(request)
            if old is None:
                raise KubernetesObjectNotFoundError()
            wanted_uid = ((request.data or {}).get("preconditions") or {}).get("uid")
            if wanted_uid and wanted_uid != old["metadata"].get("uid"):
                raise KubernetesError(status=409, reason="Conflict", message="uid precondition failed")
            if old["metadata"].get("finalizers"):
                if not old["metadata"].get("deletionTimestamp"):
                    old["metadata"]["deletionTimestamp"] = self._now()
                    old["metadata"]["resourceVersion"] = str(next(self._rv))
                    self._objects[(request.resource, request.namespace, request.name)].create(old)
                    await self._publish(request, "MODIFIED", old)
                return aiohttp.web.json_response(old)
            await self._remove(request.resource, request.namespace, request.name)
        return aiohttp.web.json_response(old)

    async def _evict(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """The Eviction API: refused (429) while a matching PodDisruptionBudget allows no
        disruption (``status.disruptionsAllowed``, which the disruption controller keeps)."""
        assert request.resource is not None
        async with self._lock:
            pod = self._existing(request)
            if pod is None:
                raise KubernetesObjectNotFoundError()
            wanted_uid = (((request.data or {}).get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
            if wanted_uid and wanted_uid != pod["metadata"].get("uid"):
                raise KubernetesError(status=409, reason="Conflict", message="uid precondition failed")
            for budget in self.items("policy/v1/poddisruptionbudgets", request.namespace):
                selector = ((budget.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
                allowed = (budget.get("status") or {}).get("disruptionsAllowed")
                if selector and _matches(pod, selector) and allowed == 0:
                    raise KubernetesError(status=429, reason="TooManyRequests",
                                          message="Cannot evict pod as it would violate the pod's disruption "
                                                  f"budget {budget['metadata']['name']}")
            await self._remove(request.resource, request.namespace, request.name or "")
        return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success"}, status=201)

    async def _remove(self, resource: Any, namespace: str | None, name: str) -> None:
        """Delete one object and, like the garbage collector, everything it owns."""
        key = (resource, namespace, name)
        raw = self._objects[key].raw
        self._objects[key].delete()
        await self._buses[resource].put({"type": "DELETED", "object": raw})
        uid = raw["metadata"].get("uid")
        dependents = [
            k for k, obj in list(self._objects.items())
            if not obj.deleted and any(ref.get("uid") == uid for ref in
                                       (obj.raw.get("metadata", {}).get("ownerReferences") or []))
        ]
        for dep_resource, dep_ns, dep_name in dependents:
            await self._remove(dep_resource, dep_ns, dep_name)

    # -- helpers for tests -----------------------------------------------------------------

    def read(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def items(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(resource)
        return [copy.deepcopy(obj.raw) for (r, ns, _), obj in list(self._objects.items())
                if r == res and not obj.deleted and (namespace is None or ns == namespace)]

    async def put_object(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object the way a controller would (status included)."""
        res = kmock.resource(resource)
        meta = obj["metadata"]
        key = (res, meta.get("namespace"), meta["name"])
        async with self._lock:
            exists = key in self._objects and not self._objects[key].deleted
            if exists:
                old = self._objects[key].raw
                meta.setdefault("uid", old["metadata"]["uid"])
                meta.setdefault("generation", old["metadata"].get("generation", 1))
                meta.setdefault("creationTimestamp", old["metadata"].get("creationTimestamp"))
            else:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", self._now())
            meta["resourceVersion"] = str(next(self._rv))
            if key in self._objects:
                self._objects[key].create(copy.deepcopy(obj))
            else:
                self._objects[key] = copy.deepcopy(obj)
            await self._buses[res].put({"type": "MODIFIED" if exists else "ADDED", "object": copy.deepcopy(obj)})
        return obj

    async def patch_status(self, resource: str, namespace: str | None, name: str,
                           status: dict[str, Any]) -> None:
        """Replace only ``.status`` of the latest version, as a controller's status write does."""
        res = kmock.resource(resource)
        key = (res, namespace, name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return
            new = copy.deepcopy(self._objects[key].raw)
            new["status"] = copy.deepcopy(status)
            new["metadata"]["resourceVersion"] = str(next(self._rv))
            self._objects[key].create(new)
            await self._buses[res].put({"type": "MODIFIED", "object": copy.deepcopy(new)})

    async def remove_object(self, resource: str, namespace: str | None, name: str) -> None:
        res = kmock.resource(resource)
        async with self._lock:
            if (res, namespace, name) in self._objects and not self._objects[(res, namespace, name)].deleted:
                await self._remove(res, namespace, name)


def _check_version(old: dict[str, Any], new: dict[str, Any]) -> None:
    wanted = (new.get("metadata") or {}).get("resourceVersion")
    if wanted and wanted != old["metadata"].get("resourceVersion"):
        raise KubernetesError(status=409, reason="Conflict",
                              message="the object has been modified; please apply your changes to the latest version")


def _spec_of(obj: dict[str, Any]) -> Any:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null deletes)."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v) if isinstance(v, dict) else copy.deepcopy(v)
    return out


def _parse_selector(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = v.strip().lstrip("=")
    return out


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _audit_entry(request: rendering.Request) -> AuditEntry:
    method = request.method.value
    watching = request.params.get("watch") in ("true", "1")
    if method == "GET":
        verb = "watch" if watching else ("get" if request.name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
        if method == "DELETE" and not request.name:
            verb = "deletecollection"
    assert request.resource is not None
    return AuditEntry(verb=verb, group=request.resource.group or "", resource=request.resource.plural or "",
                      subresource=request.subresource, namespace=request.namespace, name=request.name,
                      user_agent=request.headers.get("User-Agent", ""))


def write_kubeconfig(server_url: str, path: Path) -> Path:
    """A kubeconfig whose one context reaches the emulated API server without credentials."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server_url.rstrip("/")}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
        "users": [{"name": "test", "user": {}}],
    }))
    return path


def point_kubernetes_clients_at(server_url: str, directory: Path, monkeypatch: Any) -> Path:
    """Make kubernetes_asyncio's default kubeconfig (what a router or gateway outside a cluster
    loads) one that names ``server_url``, as a pod's in-cluster config names its API server."""
    from kubernetes_asyncio.config import kube_config  # reads KUBECONFIG at import: point it here

    kubeconfig = write_kubeconfig(server_url, directory / "kubeconfig")
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kubeconfig
