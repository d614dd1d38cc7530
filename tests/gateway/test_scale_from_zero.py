"""Scale from zero: a pool with no ready pod holds its requests until one is ready, then serves them.

The gateway follows its pool's pods as it does on a cluster: its router watches the InferencePool's
pods through the Kubernetes API (the operator tests' emulated API server, reached through a
kubeconfig). The pool starts with no pod; requests sent then are held
(``kvflow_gateway_held_requests``); a real ``kvflow sim`` process is started and its Pod, ready,
is written to the API server, and the held requests are answered by it. A request held past the
pool's ``hold_when_empty_seconds`` gets a 503 with ``Retry-After``; a client that leaves while
held is forgotten and never sent upstream. Every wait is on an event: the hold's own change
notification or an answer arriving.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.errors import NoCapacityError
from kvflow.gateway.cli import config_from_args, parser
from kvflow.gateway.config import GatewayConfig, PoolConfig
from kvflow.gateway.hold import Hold
from kvflow.gateway.server import RunningGateway, start_gateway
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router.datastore import Datastore
from kvflow.router.router import Router

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import kmock  # noqa: E402
import kube_emulator  # noqa: E402  (the operator tests' emulated API server)
from operator_emulator import point_kubernetes_clients_at  # noqa: E402

MODEL = "tiny"
NS = "ml"
POD_HOST = "127.0.0.2"
PODS = f"/api/v1/namespaces/{NS}/pods"


@dataclass
class Cluster:
    """The emulated API server with the pool's InferencePool, and where its pod will listen."""

    server: Any
    port: int
    logs: Path

    async def create(self, path: str, obj: dict[str, Any]) -> None:
        async with self.server.client.post(path, json=obj) as resp:
            assert resp.status < 400, await resp.text()

    async def add_ready_pod(self, name: str, role: str = "both", host: str = POD_HOST) -> None:
        await self.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": MODEL, "llm-d.ai/role": role}},
            "status": {"podIP": host, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })

    async def delete_pod(self, name: str) -> None:
        async with self.server.client.delete(f"{PODS}/{name}") as resp:
            assert resp.status < 400, await resp.text()


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    port = free_port(POD_HOST)
    async with kube_emulator.Cluster() as k8s, kmock.Server(k8s) as server:
        point_kubernetes_clients_at(str(server.url), tmp_path, monkeypatch)
        found = Cluster(server, port, tmp_path / "sim-logs")
        await found.create(f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", {
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": MODEL},
            "spec": {"selector": {"matchLabels": {"app": MODEL}}, "targetPorts": [{"number": port}]},
        })
        yield found


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[ProcessGroup]:
    with ProcessGroup(cluster.logs) as group:
        yield group


async def start_sim(group: ProcessGroup, cluster: Cluster) -> None:
    """A real simulated pod where the InferencePool's port says (not yet in the API server)."""
    child = group.start("sim", kvflow_argv("sim", "--host", POD_HOST, "--port", str(cluster.port), "--model", MODEL,
                                           "--profile", "instant"),
                        env={"PYTHONHASHSEED": "0"}, ready_url=f"http://{POD_HOST}:{cluster.port}/health")
    await asyncio.to_thread(group.wait_ready, 30, [child])


def gateway_config(hold: float, **flow: Any) -> GatewayConfig:
    router = {"kvEvents": {"enabled": False}, "pool": {"kubernetes": {"namespace": NS, "inferencePool": MODEL}}}
    return GatewayConfig(host="127.0.0.1", port=0, access_log=False, flow=flow, pools=[PoolConfig(
        model=MODEL, router_config=router, tokenizer="builtin", hold_when_empty_seconds=hold)])


@pytest.fixture
async def gateway(cluster: Cluster, request: pytest.FixtureRequest) -> AsyncIterator[RunningGateway]:
    hold, flow = getattr(request, "param", (60.0, {}))
    running = await start_gateway(gateway_config(hold, **flow))
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def the_hold(gateway: RunningGateway) -> Hold:
    hold = gateway.gateway.pools[MODEL].hold
    assert hold is not None
    return hold


async def until_held(hold: Hold, n: int) -> None:
    while hold.held != n:
        await hold.changed()


def endpoint_changes(gateway: RunningGateway) -> asyncio.Queue[tuple[str, bool]]:
    """(endpoint id, added) for every change of the set the gateway's router routes over."""
    changes: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
    router = gateway.routers[MODEL]
    assert isinstance(router, Router)
    router.datastore.subscribe(lambda endpoint, added: changes.put_nowait((endpoint.id, added)))
    return changes


async def metric(http: aiohttp.ClientSession, gateway: RunningGateway, name: str, **labels: str) -> float:
    async with http.get(f"http://127.0.0.1:{gateway.port}/metrics") as resp:
        text = await resp.text()
    want = {"model": MODEL, **labels}
    total = 0.0
    for line in text.splitlines():
        found = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if found and dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) == want:
            total += float(found.group(2))
    return total


async def post(http: aiohttp.ClientSession, gateway: RunningGateway, path: str,
               body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with http.post(f"http://127.0.0.1:{gateway.port}{path}", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


COMPLETION = {"model": MODEL, "prompt": "hello from zero", "max_tokens": 4}
CHAT_STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


async def test_requests_held_at_zero_are_served_once_the_first_pod_is_ready(
        cluster: Cluster, gateway: RunningGateway, pods: ProcessGroup, http: aiohttp.ClientSession) -> None:
    hold = the_hold(gateway)
    assert hold.empty()
    plain = asyncio.create_task(post(http, gateway, "/v1/completions", COMPLETION))
    streamed = asyncio.create_task(post(http, gateway, "/v1/chat/completions", CHAT_STREAM))
    await until_held(hold, 2)
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 2
    assert not plain.done() and not streamed.done()

    await start_sim(pods, cluster)  # the pod runs, but the gateway learns of it only from the API server
    assert hold.held == 2
    await cluster.add_ready_pod("tiny-0")

    status, _, body = await plain
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"]
    status, headers, body = await streamed
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
    assert hold.held == 0
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 0
    assert await metric(http, gateway, "kvflow_gateway_inflight_requests") == 0
    assert await metric(http, gateway, "kvflow_gateway_routed_total", mode="aggregated") == 2

    # with a pod there, a request goes straight through
    status, _, body = await post(http, gateway, "/v1/completions", COMPLETION)
    assert status == 200, body
    assert not hold.empty()


async def test_a_pd_pool_waits_for_a_decode_pod_not_a_prefill_one(
        cluster: Cluster, gateway: RunningGateway, pods: ProcessGroup, http: aiohttp.ClientSession) -> None:
    hold, changes = the_hold(gateway), endpoint_changes(gateway)
    held = asyncio.create_task(post(http, gateway, "/v1/completions", COMPLETION))
    await until_held(hold, 1)
    await cluster.add_ready_pod("tiny-prefill-0", role="prefill", host="127.0.0.3")
    assert await changes.get() == (f"127.0.0.3:{cluster.port}", True)
    assert hold.held == 1 and hold.empty()
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 1

    await start_sim(pods, cluster)
    await cluster.add_ready_pod("tiny-decode-0", role="decode")
    status, _, body = await held
    assert status == 200, body
    # a short prompt is not worth a prefill pod (the router's threshold): served by the decode pod
    assert await metric(http, gateway, "kvflow_gateway_routed_total", mode="aggregated") == 1


async def test_a_pool_scaled_back_to_zero_holds_again(
        cluster: Cluster, gateway: RunningGateway, pods: ProcessGroup, http: aiohttp.ClientSession) -> None:
    hold, changes = the_hold(gateway), endpoint_changes(gateway)
    await start_sim(pods, cluster)
    await cluster.add_ready_pod("tiny-0")
    assert await changes.get() == (f"{POD_HOST}:{cluster.port}", True)
    status, _, _ = await post(http, gateway, "/v1/completions", COMPLETION)
    assert status == 200 and hold.held == 0

    await cluster.delete_pod("tiny-0")  # the autoscaler took the pool back to zero
    assert await changes.get() == (f"{POD_HOST}:{cluster.port}", False)
    assert hold.empty()
    again = asyncio.create_task(post(http, gateway, "/v1/completions", COMPLETION))
    await until_held(hold, 1)
    await cluster.add_ready_pod("tiny-1")
    status, _, body = await again
    assert status == 200, body
    assert await metric(http, gateway, "kvflow_gateway_routed_total", mode="aggregated") == 2


@pytest.mark.parametrize("gateway", [(0.2, {})], indirect=True)
async def test_a_request_held_past_the_timeout_gets_a_503_with_retry_after(
        gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    status, headers, body = await post(http, gateway, "/v1/completions", COMPLETION)
    assert status == 503
    assert headers["Retry-After"] == "1"
    error = json.loads(body)["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert error["message"].startswith(f"no ready pod for model '{MODEL}' within 0.2 s")
    assert the_hold(gateway).held == 0
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 0
    assert await metric(http, gateway, "kvflow_gateway_failures_total", reason="hold_timeout") == 1
    assert await metric(http, gateway, "kvflow_gateway_requests_total", status="503") == 1


async def test_a_client_that_leaves_while_held_is_forgotten_and_never_sent(
        cluster: Cluster, gateway: RunningGateway, pods: ProcessGroup, http: aiohttp.ClientSession) -> None:
    hold = the_hold(gateway)
    leaving = asyncio.create_task(post(http, gateway, "/v1/completions", COMPLETION))
    await until_held(hold, 1)
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 1
    leaving.cancel()  # aiohttp closes the connection: the gateway cancels the request's handler
    await until_held(hold, 0)
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 0
    assert await metric(http, gateway, "kvflow_gateway_requests_total", status="499") == 1

    await start_sim(pods, cluster)
    await cluster.add_ready_pod("tiny-0")
    status, _, body = await post(http, gateway, "/v1/completions", COMPLETION)  # held until the pod is seen
    assert status == 200, body
    assert await metric(http, gateway, "kvflow_gateway_routed_total", mode="aggregated") == 1
    assert await metric(http, gateway, "kvflow_gateway_inflight_requests") == 0
    async with http.get(f"http://{POD_HOST}:{cluster.port}/metrics") as resp:
        served = sum(float(line.rsplit(" ", 1)[1]) for line in (await resp.text()).splitlines()
                     if line.startswith("vllm:request_success_total"))
    assert served == 1


@pytest.mark.parametrize("gateway", [(60.0, {"max_queue": 1})], indirect=True)
async def test_held_requests_are_bounded_by_the_flow_queue(
        gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    hold = the_hold(gateway)
    first = asyncio.create_task(post(http, gateway, "/v1/completions", COMPLETION))
    await until_held(hold, 1)
    status, headers, body = await post(http, gateway, "/v1/completions", COMPLETION)
    assert (status, headers["Retry-After"], json.loads(body)["error"]["type"]) == (429, "1", "RateLimitError")
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 1
    first.cancel()
    await until_held(hold, 0)


@pytest.mark.parametrize("gateway", [(0.0, {})], indirect=True)
async def test_with_holding_off_an_empty_pool_answers_503_at_once(
        gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    assert gateway.gateway.pools[MODEL].hold is None
    status, _, body = await post(http, gateway, "/v1/completions", COMPLETION)
    assert (status, json.loads(body)["error"]["type"]) == (503, "ServiceUnavailableError")
    assert await metric(http, gateway, "kvflow_gateway_held_requests") == 0


# -- the hold itself, on a real datastore ---------------------------------------------------


def pod(n: int, role: Role) -> Endpoint:
    return Endpoint(f"10.0.0.{n}", 8000, role=role, models=frozenset({MODEL}))


def datastore_hold(datastore: Datastore, seconds: float = 30.0, limit: int = 8) -> Hold:
    decoders = datastore.by_role
    hold = Hold(MODEL, seconds, limit, lambda: bool(decoders()[0]))
    datastore.subscribe(hold.endpoint_changed)
    return hold


async def test_a_prefill_pod_alone_does_not_release_held_requests() -> None:
    """A P/D pool whose decode pods are at zero cannot answer: its prefill pods do not count."""
    datastore = Datastore()
    hold = datastore_hold(datastore)
    waiter = asyncio.create_task(hold.wait())
    await until_held(hold, 1)
    datastore.set_endpoints([pod(1, Role.PREFILL)])
    assert hold.empty()
    datastore.set_endpoints([pod(1, Role.PREFILL), pod(2, Role.DECODE)])
    await waiter
    assert hold.held == 0 and not hold.empty()


async def test_a_pod_that_comes_and_goes_before_the_waiter_runs_keeps_it_held() -> None:
    datastore = Datastore()
    hold = datastore_hold(datastore, seconds=0.2)
    waiter = asyncio.create_task(hold.wait())
    await until_held(hold, 1)
    datastore.set_endpoints([pod(1, Role.BOTH)])
    datastore.set_endpoints([])  # gone again before the woken waiter looks
    with pytest.raises(NoCapacityError, match="within 0.2 s"):
        await waiter
    assert hold.held == 0


def test_the_hold_timeout_is_a_validated_pool_key_and_a_flag() -> None:
    assert PoolConfig(model=MODEL).hold_when_empty_seconds == 300.0
    with pytest.raises(ValueError, match="hold_when_empty_seconds"):
        PoolConfig(model=MODEL, hold_when_empty_seconds=-1)
    args = parser().parse_args(["--model", MODEL, "--endpoint", "127.0.0.2:8000", "--hold-when-empty", "600"])
    assert config_from_args(args).pools[0].hold_when_empty_seconds == 600.0
