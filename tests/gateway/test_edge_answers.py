"""Answers on their way back, with real simulated pods on 127.0.0.x behind an in-process gateway
(the real router): an answer of any size is relayed whole, and a client that leaves, before the
first token or mid-stream, makes the pod stop generating and the accounting settle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import RunningGateway, start_gateway
from kvflow.protocol.vllm_metrics import parse_metrics
from tests.conftest import SimPod
from tests.waiting import eventually

MODEL = "tiny"


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Any]]:
    started: list[RunningGateway] = []

    async def start(pods: list[SimPod], **config: Any) -> RunningGateway:
        pool = {"model": MODEL, "endpoints": [p.id for p in pods]}
        running = await start_gateway(GatewayConfig.model_validate({"port": 0, "pools": [pool], **config}))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.close()


async def running_on(session: aiohttp.ClientSession, pod: SimPod) -> int:
    """The pod's own count of requests it is generating for (``vllm:num_requests_running``)."""
    async with session.get(pod.url + "/metrics") as r:
        return parse_metrics(await r.text()).running


async def eventually_running(session: aiohttp.ClientSession, pod: SimPod, n: int) -> None:
    """Until the pod (another process) says it runs ``n`` requests."""
    async def runs_n() -> bool:
        return await running_on(session, pod) == n

    await eventually(runs_n, what=f"the pod to run {n} requests")


def in_flight(running: RunningGateway) -> int:
    return sum(v.in_flight for v in running.routers[MODEL].datastore.snapshot())  # type: ignore[attr-defined]


async def test_a_non_streamed_answer_of_several_megabytes_is_relayed_whole(sim_pods, gateway) -> None:  # type: ignore[no-untyped-def]
    """6,000 tokens with 20 logprobs each: a 3.66 MB answer, past the pause mark of the pod connection."""
    pods = sim_pods(1, "--model", MODEL, "--profile", "instant", "--max-model-len", "8192")
    running = await gateway(pods)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6000, "logprobs": 20}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{running.port}/v1/completions", json=body) as r:
            raw = await r.read()
    answer = json.loads(raw)
    assert (r.status, len(raw) > 3_000_000) == (200, True)
    assert answer["usage"]["completion_tokens"] == len(answer["choices"][0]["logprobs"]["tokens"]) == 6000
    assert in_flight(running) == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_client_that_leaves_before_the_first_token_aborts_the_pods_generation(  # type: ignore[no-untyped-def]
        sim_pods, gateway, stream: bool) -> None:
    # each engine step takes ~3 s: the first token is seconds away, the whole answer minutes
    pods = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b", "--fault-slow-factor", "500")
    running = await gateway(pods)
    raw = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 100, "stream": stream}).encode()
    async with aiohttp.ClientSession() as session:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw))
        await eventually_running(session, pods[0], 1)
        assert in_flight(running) == 1
        writer.close()  # gone before the first token
        await eventually_running(session, pods[0], 0)
    assert in_flight(running) == 0


async def test_a_client_that_leaves_mid_stream_aborts_the_pods_generation(sim_pods, gateway) -> None:  # type: ignore[no-untyped-def]
    pods = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b", "--fault-slow-factor", "20")
    running = await gateway(pods)
    raw = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2000, "stream": True}).encode()
    async with aiohttp.ClientSession() as session:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw))
        head = await reader.readuntil(b"data: ")  # the stream has begun
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()
        await eventually_running(session, pods[0], 0)
    assert in_flight(running) == 0


@pytest.fixture
async def sidecar() -> AsyncIterator[Callable[..., Any]]:
    """A sidecar (``kvflow sidecar``'s handler on kvflow's server) in front of one pod."""
    from kvflow.endpoints import Endpoint, parse_host_port
    from kvflow.gateway.server import limits_of, listen
    from kvflow.sidecar.server import Sidecar

    started: list[tuple[asyncio.AbstractServer, Sidecar]] = []

    async def start(pod: SimPod) -> int:
        config = GatewayConfig()
        side = Sidecar(config, Endpoint(*parse_host_port(pod.id)))
        server, port = await listen(side.handle, "127.0.0.1", 0, limits_of(config))
        started.append((server, side))
        return port

    yield start
    for server, side in started:
        server.close()
        await side.upstream.stop()


async def test_the_sidecar_passes_a_stream_through_whole(sim_pods, sidecar) -> None:  # type: ignore[no-untyped-def]
    [pod] = sim_pods(1, "--model", MODEL)
    port = await sidecar(pod)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}) as r:
            text = await r.text()
            assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 2


async def test_a_client_that_leaves_the_sidecar_mid_stream_aborts_the_pods_generation(sim_pods, sidecar) -> None:  # type: ignore[no-untyped-def]
    [pod] = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b", "--fault-slow-factor", "20")
    port = await sidecar(pod)
    raw = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2000, "stream": True}).encode()
    async with aiohttp.ClientSession() as session:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: pod\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw))
        head = await reader.readuntil(b"data: ")  # the stream has begun
        assert head.startswith(b"HTTP/1.1 200")
        await eventually_running(session, pod, 1)
        writer.close()
        await eventually_running(session, pod, 0)
