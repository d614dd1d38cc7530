"""Gateway replicas, as a Deployment runs them behind a Service: one stopped under load (SIGTERM,
as Kubernetes stops a pod) loses no request, and one started later routes within seconds.

Real processes on 127.0.0.x: two simulated pods and gateway replicas with the real router. The
client spreads requests over the replicas round-robin and, as a Service's clients and Envoy do,
sends a request whose connection was refused to the next replica. Each request opens a
connection of its own, so a refused connect is the only way a request can miss a replica: one a
replica accepted must be answered in full.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.local.procs import Child, ProcessGroup, kvflow_argv
from tests.conftest import SimPod, free_port
from tests.waiting import eventually

pytestmark = pytest.mark.slow
MODEL = "tiny"
TOKENS = 100  # ~0.7 s on the h100-llama8b profile: streams are mid-way when the stop comes


@dataclass
class Seen:
    """What the client saw of one request."""

    status: int = 0
    chunks: int = 0
    done: bool = False
    replica: int = -1
    """Which replica answered it."""
    refused: int = 0
    """Connections refused before one was taken."""


class Client:
    """Round-robin over the replicas' URLs; a refused connection moves on to the next replica."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str]) -> None:
        self.session, self.urls = session, urls
        self.streaming: dict[int, asyncio.Semaphore] = {i: asyncio.Semaphore(0) for i in range(len(urls))}
        """Per replica, released when one of its streams has its first piece."""

    async def send(self, i: int) -> Seen:
        body = {"model": MODEL, "prompt": f"request {i} " + "tells a story " * 20, "max_tokens": TOKENS,
                "stream": True, "ignore_eos": True}  # a few KV blocks: the pods publish them
        seen = Seen()
        for attempt in range(2 * len(self.urls)):
            replica = (i + attempt) % len(self.urls)
            try:
                async with self.session.post(self.urls[replica] + "/v1/completions", json=body) as r:
                    seen.status, seen.replica = r.status, replica
                    async for line in r.content:
                        if line.startswith(b"data: [DONE]"):
                            seen.done = True
                        elif line.startswith(b"data: "):
                            seen.chunks += 1
                            if seen.chunks == 1:
                                self.streaming[replica].release()
                return seen
            except aiohttp.ClientConnectorError:
                seen.refused += 1
        return seen


def start_replica(group: ProcessGroup, name: str, pods: list[SimPod], config: Path) -> tuple[Child, str]:
    port = free_port()
    child = group.start(name, kvflow_argv(
        "gateway", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--no-batch",
        "--router-config", str(config), *[a for p in pods for a in ("--endpoint", p.id)]),
        ready_url=f"http://127.0.0.1:{port}/health")
    return child, f"http://127.0.0.1:{port}"


def router_config(tmp_path: Path, pods: list[SimPod]) -> Path:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"pool": {"endpoints": [{"address": p.id, "kvEvents": p.kv_events} for p in pods]}}))
    return path


def requests_served(pods: list[SimPod]) -> float:
    """Requests the pods finished, by their own ``vllm:request_success`` counters."""
    total = 0.0
    for pod in pods:
        for family in text_string_to_metric_families(pod.get("/metrics").decode()):
            if family.name == "vllm:request_success":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


async def test_a_replica_stopped_under_load_loses_no_request(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pods = sim_pods(2, "--model", MODEL, "--profile", "h100-llama8b", kv_events=True)
    config = router_config(tmp_path, pods)
    with ProcessGroup(tmp_path / "gw") as group:
        stopped, first = start_replica(group, "replica-0", pods, config)
        _, second = start_replica(group, "replica-1", pods, config)
        group.wait_ready(60)
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            client = Client(session, [first, second])
            sent: list[asyncio.Task[Seen]] = []

            async def send_while(condition: asyncio.Future[None] | None, count: int = 0) -> None:
                while (condition is not None and not condition.done()) or count > 0:
                    sent.append(asyncio.ensure_future(client.send(len(sent))))
                    count -= 1
                    await asyncio.sleep(0.05)

            await send_while(None, 12)
            for _ in range(3):  # stop only once streams are running on the replica
                await asyncio.wait_for(client.streaming[0].acquire(), 30)
            in_flight = len(sent)
            exited = asyncio.ensure_future(asyncio.to_thread(group.stop, stopped, grace=60))
            await send_while(exited)  # while it drains
            await send_while(None, 10)  # and after it is gone
            seen = await asyncio.gather(*sent)
        code = stopped.popen.returncode

    assert all(s.status == 200 and s.done and s.chunks == TOKENS for s in seen), seen
    assert code == 0  # it exited on its own once drained, not killed at the grace period
    assert any(s.replica == 0 for s in seen[:in_flight])  # it finished the streams it had at the stop
    late = seen[-10:]  # sent once it had exited: its share refused at connect, served by the other
    assert all(s.replica == 1 for s in late) and sum(s.refused for s in late) >= 5
    # each reached a pod once: none was taken by a replica, dropped and resent
    await eventually(lambda: requests_served(pods) == len(seen), timeout=5,
                     what=lambda: f"the pods to count {len(seen)} requests, not {requests_served(pods)}")


async def test_a_replica_started_later_routes_within_seconds(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pods = sim_pods(2, "--model", MODEL, "--profile", "h100-llama8b", kv_events=True)
    config = router_config(tmp_path, pods)
    with ProcessGroup(tmp_path / "gw") as group:
        _, first = start_replica(group, "replica-0", pods, config)
        group.wait_ready(60)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            client = Client(session, [first])
            assert all(s.done for s in await asyncio.gather(*(client.send(i) for i in range(4))))

            began = time.monotonic()
            late, later = start_replica(group, "replica-1", pods, config)
            await asyncio.to_thread(group.wait_ready, 60, [late])
            answered = await Client(session, [later]).send(100)
            assert answered.status == 200 and answered.done and answered.chunks == TOKENS

            async def knows_the_pods() -> dict[str, dict[str, object]] | None:
                """The new replica's view, once it has scraped every pod and heard each one's KV
                events (from requests the other replica routes too)."""
                # two at once through the other replica: its load spreads them over both pods
                await asyncio.gather(*(client.send(int(time.monotonic() * 1000) + k) for k in (0, 1)))
                async with session.get(f"{later}/v1/kvflow/status") as r:
                    (model,) = (await r.json())["models"]
                view = {p["id"]: p for p in model["pods"]}
                ready = set(view) == {p.id for p in pods} and all(
                    p["healthy"] and p["last_scrape_s"] is not None and p["kv_events"] for p in view.values())
                return view if ready else None

            await eventually(knows_the_pods, timeout=30, what="the new replica to know every pod")
            took = time.monotonic() - began
            async with session.get(f"{later}/v1/kvflow/status") as r:
                (model,) = (await r.json())["models"]
    # its decision weighed both pods
    assert {c["id"] for c in model["decisions"][0]["candidates"]} == {p.id for p in pods}
    assert took < 30
