"""What a real cluster does besides the API server, faked just enough for the operator tests.

* ``FakeDeploymentController`` plays the Deployment/ReplicaSet controllers and the kubelet:
  it keeps ``spec.replicas`` Running pods per engine Deployment (each with its own 127.0.0.x
  IP), takes ``rollout_ticks`` ticks to roll a new pod template out, and writes the status
  fields the operator reads (``observedGeneration``, ``updatedReplicas``, ...). Like a kubelet,
  it cannot pull images whose registry host is in ``unpullable``: such pods stay Pending with
  the container waiting in ``ImagePullBackOff``, and never count as ready.
* ``FakeEngines`` serves ``/metrics`` on every pod IP at one port, with per-IP counters the test
  controls, so the operator's scraping runs over real sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, Self

import aiohttp.web
from operator_emulator import Cluster

DEPLOYMENTS = "apps/v1/deployments"
PODS = "v1/pods"
HASH = "kvflow.io/template-hash"


@dataclasses.dataclass
class EngineState:
    running: float = 0.0
    waiting: float = 0.0
    generated: float = 0.0
    stuck: bool = False  # stuck engines stop counting tokens while requests run
    blocked: bool = False  # a NetworkPolicy keeps the operator out: /metrics does not answer


class FakeEngines:
    def __init__(self, ips: list[str]) -> None:
        self.ips = ips
        self.state: dict[str, EngineState] = {}
        self.port = 0
        self._runner: aiohttp.web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        first = aiohttp.web.TCPSite(self._runner, self.ips[0], 0)
        await first.start()
        self.port = self._runner.addresses[0][1]  # the port the OS chose
        for ip in self.ips[1:]:
            await aiohttp.web.TCPSite(self._runner, ip, self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        assert request.transport is not None
        ip = request.transport.get_extra_info("sockname")[0]
        state = self.state.setdefault(ip, EngineState())
        if state.blocked:
            raise aiohttp.web.HTTPServiceUnavailable()
        if not state.stuck:
            state.generated += 10 if state.running else 0
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {state.running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {state.waiting}\n'
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {state.generated}\n'
        )
        return aiohttp.web.Response(text=text)


@dataclasses.dataclass
class _Rollout:
    template_hash: str | None = None
    ticks_left: int = 0


class FakeDeploymentController:
    def __init__(self, k8s: Cluster, engines: FakeEngines, *, rollout_ticks: int = 4,
                 tick: float = 0.05) -> None:
        self.k8s = k8s
        self.engines = engines
        self.rollout_ticks = rollout_ticks
        self.tick = tick
        self.free_ips = list(engines.ips)
        self.unpullable: set[str] = {"registry.invalid"}
        self.rollouts: dict[tuple[str, str], _Rollout] = {}
        # (deployment name, new hash, snapshot of every other deployment: name -> (hash, settled))
        self.template_changes: list[tuple[str, str | None, dict[str, tuple[str | None, bool]]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _loop(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.tick)  # a controller's resync period: a rollout takes time to go out

    def _settled(self, dep: dict[str, Any]) -> bool:
        status = dep.get("status") or {}
        replicas = int(dep["spec"].get("replicas", 1))
        return (status.get("observedGeneration") == dep["metadata"]["generation"]
                and status.get("updatedReplicas") == replicas)

    async def step(self) -> None:
        self.reap()
        deployments = self.k8s.items(DEPLOYMENTS)
        for dep in deployments:
            meta = dep["metadata"]
            key = (meta["namespace"], meta["name"])
            rollout = self.rollouts.setdefault(key, _Rollout())
            template_hash = (meta.get("annotations") or {}).get(HASH)
            if template_hash != rollout.template_hash:
                snapshot = {
                    other["metadata"]["name"]: ((other["metadata"].get("annotations") or {}).get(HASH),
                                                self._settled(other))
                    for other in deployments if other["metadata"]["name"] != meta["name"]
                }
                if rollout.template_hash is not None:
                    self.template_changes.append((meta["name"], template_hash, snapshot))
                rollout.template_hash = template_hash
                rollout.ticks_left = self.rollout_ticks
            elif rollout.ticks_left > 0:
                rollout.ticks_left -= 1
            replicas = int(dep["spec"].get("replicas", 1))
            pullable = not self._bad_images(dep["spec"]["template"])
            done = rollout.ticks_left == 0 and pullable  # a pod that cannot start holds the rollout
            if "kvflow.io/engine" in (dep["spec"]["template"]["metadata"].get("labels") or {}):
                await self._sync_pods(dep, replicas, template_hash if done else None)
            status = {
                "observedGeneration": meta["generation"], "replicas": replicas,
                "readyReplicas": replicas, "availableReplicas": replicas,
                "updatedReplicas": replicas if done else 0,
            }
            if dep.get("status") != status:
                await self.k8s.patch_status(DEPLOYMENTS, meta["namespace"], meta["name"], status)

    def _bad_images(self, template: dict[str, Any]) -> list[str]:
        return [c["image"] for c in template["spec"]["containers"] if c["image"].split("/")[0] in self.unpullable]

    def _pod_status(self, template: dict[str, Any], ip: str) -> dict[str, Any]:
        bad = self._bad_images(template)
        if not bad:
            return {"phase": "Running", "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}]}
        return {"phase": "Pending", "podIP": ip, "containerStatuses": [{
            "name": "engine", "image": bad[0], "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                  "message": f'Back-off pulling image "{bad[0]}"'}}}]}

    async def _sync_pods(self, dep: dict[str, Any], replicas: int, template_hash: str | None) -> None:
        meta = dep["metadata"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        # A surge pod of the new template, as the ReplicaSet controller would start first: with an
        # image that cannot be pulled it waits, and tells why.
        newest = (meta.get("annotations") or {}).get(HASH)
        if template_hash is None and self._bad_images(dep["spec"]["template"]):
            await self._surge(dep, newest)
            return
        mine = [p for p in self.k8s.items(PODS, meta["namespace"])
                if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences", []))]
        if template_hash is not None:  # rolled out: replace pods of older templates
            for pod in mine:
                if pod["metadata"]["annotations"].get(HASH) != template_hash:
                    await self._delete_pod(pod)
            mine = [p for p in mine if p["metadata"]["annotations"].get(HASH) == template_hash]
        for pod in mine[replicas:]:
            await self._delete_pod(pod)
        for _ in range(replicas - len(mine)):
            ip = self.free_ips.pop(0)
            self.engines.state[ip] = EngineState()
            name = f"{meta['name']}-{uuid.uuid4().hex[:5]}"
            await self.k8s.put_object(PODS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": name, "namespace": meta["namespace"], "labels": dict(labels),
                    "annotations": {HASH: (meta.get("annotations") or {}).get(HASH)},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                         "uid": meta["uid"], "controller": True}],
                },
                "spec": dep["spec"]["template"]["spec"],
                "status": self._pod_status(dep["spec"]["template"], ip),
            })

    async def _surge(self, dep: dict[str, Any], template_hash: str | None) -> None:
        meta = dep["metadata"]
        mine = [p for p in self.k8s.items(PODS, meta["namespace"])
                if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences", []))]
        if any(p["metadata"]["annotations"].get(HASH) == template_hash for p in mine):
            return
        ip = self.free_ips.pop(0)
        await self.k8s.put_object(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{uuid.uuid4().hex[:5]}", "namespace": meta["namespace"],
                "labels": dict(dep["spec"]["template"]["metadata"]["labels"]),
                "annotations": {HASH: template_hash},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True}],
            },
            "spec": dep["spec"]["template"]["spec"],
            "status": self._pod_status(dep["spec"]["template"], ip),
        })

    async def _delete_pod(self, pod: dict[str, Any]) -> None:
        await self.k8s.remove_object(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.free_ips.append(pod["status"]["podIP"])

    def reap(self) -> None:
        """Return the IPs of pods deleted by someone else (the operator) to the free list."""
        live = {p["status"]["podIP"] for p in self.k8s.items(PODS)}
        used = set(self.engines.ips) - set(self.free_ips)
        self.free_ips += sorted(used - live)
