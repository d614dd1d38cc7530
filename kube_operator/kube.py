"""The operator's thin Kubernetes client: server-side apply, get, list, create, replace, delete,
evict. Nothing else.

It is kubernetes_asyncio's ``ApiClient`` (the one Kubernetes library kvflow uses: the router's
pod watcher and the gateway's token review use it too), configured from the credentials kopf
logged in with. Paths come from ``objects.RESOURCES``; there is no discovery except
``has_api`` for optional CRDs (InferencePool, HTTPRoute, ScaledObject). Every call the
operator makes is visible here (and in the RBAC audit of the tests).

Credentials never touch the disk: Python's ``ssl`` loads client certificates and CA bundles
from files only, so certificate and key *data* (a kubeconfig's ``client-key-data``) go through
anonymous in-memory files (``memfd``) that exist just while the library builds its SSL context.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvflow.operator.names import FIELD_MANAGER
from kvflow.operator.objects import RESOURCES, Obj

TRANSPORT_ATTEMPTS = 3
LIST_PAGE = 500
REQUEST_TIMEOUT = 30.0
_JSON_TYPES = {200: "object", 201: "object", 202: "object"}


class ApiError(Exception):
    """An API call failed: an HTTP error status, or 503 when the server could not be reached."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.reason = reason


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    try:
        prefix, plural = RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {api_version} {kind}") from None
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _pem(data: str | bytes) -> bytes:
    """kubeconfig ``*-data`` fields are base64 of PEM; kopf may hand over either form."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if b"-----BEGIN" in raw else base64.b64decode(raw)


@contextlib.contextmanager
def memory_files() -> Iterator[Any]:
    """``add(data) -> path`` of a file that lives in memory only, closed when the block ends."""
    fds: list[int] = []

    def add(data: bytes) -> str:
        if hasattr(os, "memfd_create"):  # Linux: anonymous memory, never on a filesystem
            fd = os.memfd_create("kvflow-credential", os.MFD_CLOEXEC)
            os.write(fd, data)
            fds.append(fd)
            return f"/proc/self/fd/{fd}"
        raise OSError("in-memory credential files need Linux (memfd_create); "
                      "use certificate and key paths instead of inline data")

    try:
        yield add
    finally:
        for fd in fds:
            os.close(fd)


def connection_info(server: str | None, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's credentials: an explicit (development) server, else in-cluster, else kubeconfig."""
    if server:
        return kopf.ConnectionInfo(server=server, insecure=True)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def configuration(conn: kopf.ConnectionInfo) -> tuple[client.Configuration, dict[str, str], list[Any]]:
    """The library configuration for kopf's credentials, plus headers and in-memory file jobs."""
    config = client.Configuration(host=conn.server.rstrip("/"))
    config.verify_ssl = not conn.insecure
    if conn.proxy_url:
        config.proxy = conn.proxy_url
    jobs: list[Any] = []  # (attribute, path or data) resolved while the SSL context is built
    for attr, path, data in (("ssl_ca_cert", conn.ca_path, conn.ca_data),
                             ("cert_file", conn.certificate_path, conn.certificate_data),
                             ("key_file", conn.private_key_path, conn.private_key_data)):
        if path:
            setattr(config, attr, os.fsdecode(path))
        elif data:
            jobs.append((attr, _pem(data)))
    return config, conn.as_http_headers(), jobs


class KubeClient:
    """One connection pool against one API server; create it from kopf's ``ConnectionInfo``."""

    def __init__(self, conn: kopf.ConnectionInfo, *, user_agent: str = "kvflow-operator") -> None:
        config, headers, jobs = configuration(conn)
        with memory_files() as add:
            for attr, data in jobs:
                setattr(config, attr, add(data))
            self._api = client.ApiClient(config)  # builds its SSL context from them, here
        for attr, _ in jobs:  # the paths die with the block: never reuse them
            setattr(config, attr, None)
        self._api.user_agent = user_agent
        for header, value in headers.items():
            self._api.set_default_header(header, value)
        self._apis: dict[str, set[str]] = {}
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        await self._api.close()

    async def _call(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                    body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        for attempt in range(TRANSPORT_ATTEMPTS):
            if self._closed:  # the operator is shutting down, or logged in anew
                raise ApiError(503, f"{method} {path}: the client is closed")
            try:
                return await self._api.call_api(
                    path, method, query_params=list((params or {}).items()), header_params=headers,
                    body=body, response_types_map=_JSON_TYPES, _return_http_data_only=True,
                    _request_timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                raise _api_error(method, path, exc) from None
            except Exception as exc:
                if self._closed:  # closed under a call in flight (shutdown, or a new login)
                    raise ApiError(503, f"{method} {path}: the client is closed") from exc
                if not isinstance(exc, (TimeoutError, aiohttp.ClientConnectionError)):
                    raise
                # A keep-alive connection the server just closed, or a blip: every call here is
                # idempotent or guarded (apply, get, list, delete with a uid, replace with a
                # resourceVersion), so trying again is safe.
                if attempt + 1 == TRANSPORT_ATTEMPTS:
                    raise ApiError(503, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def apply(self, obj: Obj, *, field_manager: str = FIELD_MANAGER, force: bool = True) -> Obj:
        """Server-side apply: create or update the fields this manager owns; keep all others."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        result: Obj = await self._call("PATCH", path, params=params, body=obj,
                                       content_type="application/apply-patch+yaml")
        return result

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            result: Obj = await self._call("GET", resource_path(api_version, kind, namespace, name))
            return result
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        result: Obj = await self._call("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")),
                                       body=obj)
        return result

    async def replace(self, obj: Obj) -> Obj:
        """PUT the whole object; its ``metadata.resourceVersion`` makes a stale write a 409."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        result: Obj = await self._call("PUT", path, body=obj)
        return result

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: Mapping[str, str] | None = None) -> list[Obj]:
        """Every object (page by page), with apiVersion and kind set as list items lack them."""
        params = {"limit": str(LIST_PAGE)}
        if selector:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in selector.items())
        items: list[Obj] = []
        while True:
            result = await self._call("GET", resource_path(api_version, kind, namespace), params=params)
            items += result.get("items") or []
            token = (result.get("metadata") or {}).get("continue")
            if not token:
                break
            params["continue"] = token
        for item in items:
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        if selector:  # defensive: never act on objects the selector should have excluded
            items = [i for i in items if all(
                (i.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        return items

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     *, uid: str | None = None) -> bool:
        """Delete one object (only that exact ``uid`` if given); False if it was already gone."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._call("DELETE", resource_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise

    async def evict(self, namespace: str, name: str, *, uid: str) -> bool:
        """Ask the Eviction API to remove a pod; it refuses (429) when a PodDisruptionBudget
        would be broken. True if evicted, False if refused or already gone."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}
        try:
            await self._call("POST", resource_path("v1", "Pod", namespace, name, "eviction"), body=body)
            return True
        except ApiError as exc:
            if exc.status in (404, 409, 429):
                return False
            raise

    async def has_api(self, api_version: str, kind: str) -> bool:
        """Is this (optional, CRD-provided) resource served? Cached per group/version."""
        if api_version not in self._apis:
            prefix = RESOURCES[(api_version, kind)][0]
            try:
                result = await self._call("GET", prefix)
                self._apis[api_version] = {r.get("kind", "") for r in result.get("resources", [])}
            except ApiError as exc:
                if exc.status != 404:
                    raise
                return False  # not cached: the CRD may be installed later
        return kind in self._apis[api_version]


def _api_error(method: str, path: str, exc: ApiException) -> ApiError:
    body = exc.body.decode() if isinstance(exc.body, bytes) else (exc.body or "")
    try:
        parsed = json.loads(body)
        message, reason = parsed.get("message", body), parsed.get("reason", "")
    except (ValueError, AttributeError):
        message, reason = body or str(exc.reason), ""
    return ApiError(int(exc.status or 0), f"{method} {path}: {message}", reason)
