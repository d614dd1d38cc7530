"""Gray failures routed around: real simulated pods on 127.0.0.x whose metrics look healthy but
whose requests fail (one hangs, one serves another model), behind an in-process gateway with the
real router. The bad pod costs three failed attempts, each retried on another pod before anything
reached the client; then it is ejected, readmitted when its time is up, and ejected for longer
if it still fails."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import RunningGateway, start_gateway
from kvflow.router import Router, load_config
from tests.conftest import SimPod

MODEL = "tiny"


class Clock:
    """The router's clock: real time plus what the test skips ahead."""

    def __init__(self) -> None:
        import time

        self._monotonic, self.skipped = time.monotonic, 0.0

    def __call__(self) -> float:
        return self._monotonic() + self.skipped


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Any]]:
    started: list[RunningGateway] = []

    async def start(pods: list[SimPod], clock: Clock) -> tuple[RunningGateway, Router]:
        endpoints = [Endpoint(p.host, p.port, role=Role.BOTH, models=frozenset({MODEL})) for p in pods]
        router = Router(load_config({"pool": {"name": MODEL, "model": MODEL}}), endpoints, profile="round-robin",
                        clock=clock)
        config = GatewayConfig.model_validate({
            "port": 0, "pools": [{"model": MODEL, "endpoints": []}],
            "timeouts": {"first_byte": 1.0, "per_token": 0.1, "idle": 1.0},  # a stream's first chunk, or a gap: 1 s
        })
        running = await start_gateway(config, {MODEL: router})
        started.append(running)
        return running, router

    yield start
    for running in started:
        await running.close()


async def complete(session: aiohttp.ClientSession, running: RunningGateway, n: int, *, stream: bool) -> list[str]:
    """``n`` requests one after another: each one's status, or "cut" for a stream that ended with an error event."""
    outcomes = []
    for _ in range(n):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
        async with session.post(f"http://127.0.0.1:{running.port}/v1/completions", data=json.dumps(body)) as r:
            raw = await r.read()
            outcomes.append("cut" if b'"error"' in raw else str(r.status))
    return outcomes


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_pod_that_hangs_is_ejected_after_three_timeouts_and_readmitted_later(  # type: ignore[no-untyped-def]
        sim_pods, gateway, stream: bool) -> None:
    """Whole answers: the pod never answers, and each attempt there is retried on another pod.
    Streams: it stalls after its first token, which has reached the client, so those three
    streams end with an error event; none more is sent there."""
    good = sim_pods(2, "--model", MODEL, "--profile", "instant")
    [bad] = sim_pods(1, "--model", MODEL, "--profile", "instant", "--fault-stall-after", "0")
    clock = Clock()
    running, router = await gateway([*good, bad], clock)
    async with aiohttp.ClientSession() as session:
        outcomes = await complete(session, running, 12, stream=stream)
        assert outcomes.count("cut") == (3 if stream else 0) and outcomes.count("200") == (9 if stream else 12)
        health = router.outliers.pods[bad.id]
        assert (health.failures, health.ejections, router.datastore.view(bad.id).healthy) == (3, 1, False)
        assert sum(v.in_flight for v in router.datastore.snapshot()) == 0
        async with session.post(bad.url + "/_sim/faults", json={"stall_after_tokens": None}) as r:
            assert r.status == 200  # the pod recovers ...
        clock.skipped += router.outliers.policy.base_seconds  # ... and its ejection ends
        assert await complete(session, running, 6, stream=stream) == ["200"] * 6
    assert (health.failures, health.until, router.datastore.view(bad.id).healthy) == (0, 0.0, True)


async def test_a_pod_serving_another_model_is_ejected_and_its_404s_never_reach_clients(sim_pods, gateway) -> None:  # type: ignore[no-untyped-def]
    good = sim_pods(2, "--model", MODEL, "--profile", "instant")
    [bad] = sim_pods(1, "--model", "another-model", "--profile", "instant")
    clock = Clock()
    running, router = await gateway([*good, bad], clock)
    async with aiohttp.ClientSession() as session:
        assert await complete(session, running, 12, stream=False) == ["200"] * 12  # each 404 retried elsewhere
        health = router.outliers.pods[bad.id]
        assert (health.failures, health.ejections, router.datastore.view(bad.id).healthy) == (3, 1, False)
        first = health.until - clock()
        clock.skipped += router.outliers.policy.base_seconds  # readmitted: one more 404 ejects it, for longer
        assert await complete(session, running, 6, stream=True) == ["200"] * 6
    assert (health.ejections, router.datastore.view(bad.id).healthy) == (2, False)
    assert health.until - clock() > first
