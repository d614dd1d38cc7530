"""Kubernetes as an endpoint source: InferencePool selectors and pod readiness, as pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.router import load_config
from kvflow.router.k8s import pod_endpoints, pool_selector, selector_text
from kvflow.endpoints import Role


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    phase: str = "Running",
    role: str | None = None,
    deleting: bool = False,
    models: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app": "llm"}}
    if role:
        meta["labels"]["llm-d.ai/role"] = role
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if models:
        meta["annotations"] = {"kvflow.dev/models": models}
    return {
        "metadata": meta,
        "status": {
            "podIP": ip,
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_ready_pods_become_endpoints() -> None:
    pods = [
        pod("a", "10.0.0.2", role="prefill", models="llama,lora-a"),
        pod("b", "10.0.0.1", role="decode"),
        pod("c", "10.0.0.3", ready=False),
        pod("d", None),
        pod("e", "10.0.0.5", phase="Pending"),
        pod("f", "10.0.0.6", deleting=True),
        pod("g", "10.0.0.7", role="weird"),
    ]
    got = pod_endpoints(pods, 8000)
    assert [(e.id, e.role, e.name) for e in got] == [
        ("10.0.0.1:8000", Role.DECODE, "b"),
        ("10.0.0.2:8000", Role.PREFILL, "a"),
        ("10.0.0.7:8000", Role.BOTH, "g"),
    ]
    assert got[1].models == frozenset({"llama", "lora-a"})


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        (
            {"spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]}},
            ({"app": "llm"}, 8000),
        ),
        ({"spec": {"selector": {"app": "llm"}, "targetPortNumber": 8001}}, ({"app": "llm"}, 8001)),
    ],
    ids=["v1", "v1alpha2"],
)
def test_inference_pool_selector(pool: dict[str, Any], expected: tuple[dict[str, str], int]) -> None:
    assert pool_selector(pool) == expected


def test_pool_without_selector_is_an_error() -> None:
    with pytest.raises(ValueError, match="no selector"):
        pool_selector({"metadata": {"name": "p"}, "spec": {}})


def test_selector_text_and_config() -> None:
    assert selector_text({"b": "2", "a": "1"}) == "a=1,b=2"
    config = load_config({"pool": {"kubernetes": {"namespace": "ml", "inferencePool": "llama"}}})
    assert config.kubernetes is not None and config.kubernetes.inference_pool == "llama"
    with pytest.raises(ValueError, match="needs a selector or an inferencePool"):
        load_config({"pool": {"kubernetes": {"namespace": "ml"}}})


async def test_watcher_follows_pods_on_an_api_server() -> None:
    """Against the operator tests' Kubernetes emulator (kmock), when it is there."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
    emulator = pytest.importorskip("kube_emulator")
    import kmock

    from kvflow.router.config import KubernetesSpec
    from kvflow.router.k8s import PodWatcher

    seen: asyncio.Queue[list[str]] = asyncio.Queue()

    async def until_seen(wanted: list[str]) -> None:
        """The watcher's ``on_change`` calls, read until one reports ``wanted``."""
        async with asyncio.timeout(10):
            while await seen.get() != wanted:
                pass
    async with emulator.Cluster() as k8s, kmock.Server(k8s) as server:
        url = str(server.url).rstrip("/")

        async def create(path: str, obj: dict[str, Any]) -> None:
            async with server.client.post(path, json=obj) as resp:
                assert resp.status < 400, await resp.text()

        pool = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama"},
            "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]},
        }
        await create("/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools", pool)
        await create("/api/v1/namespaces/ml/pods", {"apiVersion": "v1", "kind": "Pod", **pod("a", "10.0.0.1")})
        spec = KubernetesSpec(namespace="ml", inferencePool="llama")
        watcher = PodWatcher(spec, lambda eps: seen.put_nowait([e.id for e in eps]), api_url=url)
        await watcher.start()
        try:
            await until_seen(["10.0.0.1:8000"])
            await create("/api/v1/namespaces/ml/pods", {"apiVersion": "v1", "kind": "Pod", **pod("b", "10.0.0.2")})
            await until_seen(["10.0.0.1:8000", "10.0.0.2:8000"])
        finally:
            await watcher.stop()
