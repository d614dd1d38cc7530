"""Kubernetes as an endpoint source: the pods an InferencePool (or a label selector) selects.

Pure parts first (``pool_selector``, ``pod_endpoint``), then ``PodWatcher``, the thin I/O edge:
it lists the pods, hands the ready ones to the router, and follows a watch, relisting when the
watch expires. Only this module imports the Kubernetes client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvflow.router.config import KubernetesSpec
from kvflow.endpoints import Endpoint, Role

log = logging.getLogger(__name__)

MODELS_ANNOTATION = "kvflow.dev/models"
REVISION_LABEL = "kvflow.io/revision"
POOL_GROUPS = (("inference.networking.k8s.io", "v1"), ("inference.networking.x-k8s.io", "v1alpha2"))


def pool_selector(pool: Mapping[str, Any]) -> tuple[dict[str, str], int]:
    """(label selector, target port) of an InferencePool, v1 or v1alpha2."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, Mapping) else {}
    ports = spec.get("targetPorts") or []
    port = ports[0].get("number") if ports else spec.get("targetPortNumber")
    if not labels or not port:
        raise ValueError(f"InferencePool {pool.get('metadata', {}).get('name')!r} has no selector or port")
    return {str(k): str(v) for k, v in labels.items()}, int(port)


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_endpoint(pod: Mapping[str, Any], port: int, role_label: str = "llm-d.ai/role") -> Endpoint | None:
    """The endpoint a ready pod offers; None for pods that are not (yet, or any more) ready."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or not _ready(pod):
        return None
    meta = pod.get("metadata") or {}
    role_text = (meta.get("labels") or {}).get(role_label, "both")
    role = Role(role_text) if role_text in Role._value2member_map_ else Role.BOTH
    models = (meta.get("annotations") or {}).get(MODELS_ANNOTATION, "")
    revision = (meta.get("labels") or {}).get(REVISION_LABEL, "")
    return Endpoint(ip, port, role=role, models=frozenset(m for m in models.split(",") if m),
                    name=meta.get("name", ""), revision=revision)


def pod_endpoints(pods: Sequence[Mapping[str, Any]], port: int, role_label: str = "llm-d.ai/role") -> list[Endpoint]:
    return sorted((e for e in (pod_endpoint(p, port, role_label) for p in pods) if e), key=lambda e: e.id)


def selector_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


class PodWatcher:
    """Keeps ``on_change`` fed with the ready pods of the pool."""

    def __init__(
        self, spec: KubernetesSpec, on_change: Callable[[list[Endpoint]], None], *, api_url: str | None = None
    ) -> None:
        self.spec = spec
        self.on_change = on_change
        self.api_url = api_url
        """A plain-HTTP API server (tests); otherwise in-cluster config, else ~/.kube/config."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="k8s-pod-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        from kubernetes_asyncio import client, config, watch

        configuration = client.Configuration()
        if self.api_url:
            configuration.host = self.api_url
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                await config.load_kube_config(client_configuration=configuration)
        async with client.ApiClient(configuration) as api:
            core = client.CoreV1Api(api)
            while True:
                try:
                    labels, port = await self._selector(client.CustomObjectsApi(api))
                    await self._follow(api, core, watch, labels, port)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the API server restarts, watches expire: relist
                    log.warning("pod watch failed (%s); relisting", exc)
                    await asyncio.sleep(1.0)

    async def _selector(self, custom: Any) -> tuple[dict[str, str], int]:
        if not self.spec.inference_pool:
            return dict(self.spec.selector), self.spec.target_port
        for group, version in POOL_GROUPS:
            try:
                pool = await custom.get_namespaced_custom_object(
                    group, version, self.spec.namespace, "inferencepools", self.spec.inference_pool
                )
                return pool_selector(pool)
            except Exception:  # noqa: BLE001 - try the next API version
                continue
        raise LookupError(f"InferencePool {self.spec.namespace}/{self.spec.inference_pool} not found")

    async def _follow(self, api: Any, core: Any, watch: Any, labels: dict[str, str], port: int) -> None:
        selector = selector_text(labels)
        body = api.sanitize_for_serialization(
            await core.list_namespaced_pod(self.spec.namespace, label_selector=selector)
        )
        pods: dict[str, dict[str, Any]] = {p["metadata"]["name"]: p for p in body.get("items") or []}
        self.on_change(pod_endpoints(list(pods.values()), port, self.spec.role_label))
        version = (body.get("metadata") or {}).get("resourceVersion")
        async with watch.Watch().stream(
            core.list_namespaced_pod, self.spec.namespace, label_selector=selector, resource_version=version
        ) as stream:
            async for event in stream:
                obj = event["raw_object"]
                name = obj["metadata"]["name"]
                if event["type"] == "DELETED":
                    pods.pop(name, None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    pods[name] = obj
                self.on_change(pod_endpoints(list(pods.values()), port, self.spec.role_label))
