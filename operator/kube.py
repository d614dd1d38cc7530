"""The operator's thin Kubernetes client: server-side apply, get, list, delete. Nothing else.

It speaks plain HTTP through aiohttp with the credentials kopf logged in with, so the operator
needs no second Kubernetes library and every call it makes is visible here (and in the RBAC
audit of the tests). Paths come from ``objects.RESOURCES``; there is no discovery except
``has_api`` for optional CRDs (InferencePool, HTTPRoute, ScaledObject).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from kvflow.operator.names import FIELD_MANAGER
from kvflow.operator.objects import RESOURCES, Obj

TRANSPORT_ATTEMPTS = 3


class ApiError(Exception):
    """An API call failed: an HTTP error status, or 503 when the server could not be reached."""


    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


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


def _ssl_context(conn: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not conn.server.startswith("https"):
        return False
    ca_data = conn.ca_data.decode() if isinstance(conn.ca_data, bytes) else conn.ca_data
    context = ssl.create_default_context(cafile=conn.ca_path, cadata=ca_data)
    if conn.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    cert, key = conn.certificate_path, conn.private_key_path
    if conn.certificate_data or conn.private_key_data:
        cert = _tempfile(conn.certificate_data) if conn.certificate_data else cert
        key = _tempfile(conn.private_key_data) if conn.private_key_data else key
    if cert:
        context.load_cert_chain(certfile=cert, keyfile=key)
    return context


def _tempfile(data: str | bytes) -> str:
    with tempfile.NamedTemporaryFile("wb", delete=False, suffix=".pem") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        return f.name


class KubeClient:
    """One session against one API server; create it from kopf's ``ConnectionInfo``."""

    def __init__(self, conn: kopf.ConnectionInfo) -> None:
        self.server = conn.server.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "kvflow-operator"}
        headers.update(conn.as_http_headers())
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=_ssl_context(conn)),
            timeout=aiohttp.ClientTimeout(total=30),
        )
        self._apis: dict[str, set[str]] = {}

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                    body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        for attempt in range(TRANSPORT_ATTEMPTS):
            if self._session.closed:  # the operator is shutting down, or logged in anew
                raise ApiError(503, f"{method} {path}: the client is closed")
            try:
                async with self._session.request(method, self.server + path, params=params, data=data,
                                                 headers=headers) as response:
                    text = await response.text()
                    status = response.status
                break
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                # A keep-alive connection the server just closed, or a blip: every call here is
                # idempotent (apply, get, list, delete), so trying again is safe.
                if attempt + 1 == TRANSPORT_ATTEMPTS:
                    raise ApiError(503, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(0.2 * (attempt + 1))
        if status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                message = text
            raise ApiError(status, f"{method} {path}: {message}")
        return json.loads(text) if text else None

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

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: Mapping[str, str] | None = None) -> list[Obj]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())} if selector else None
        result = await self._call("GET", resource_path(api_version, kind, namespace), params=params)
        items: list[Obj] = result.get("items") or []
        for item in items:  # list items carry no apiVersion/kind; callers key objects by them
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        if selector:  # defensive: never act on objects the selector should have excluded
            items = [i for i in items if all(
                (i.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        return items

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     *, uid: str | None = None) -> bool:
        """Delete one object (only that exact ``uid`` if given); False if it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}  # type: ignore[assignment]
        try:
            await self._call("DELETE", resource_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiError as exc:
            if exc.status in (404, 409):
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
