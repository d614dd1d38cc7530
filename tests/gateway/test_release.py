"""Every path that starts a request releases it: whatever step fails, the router's accounting and
the admission gate end where they began, and the client gets an OpenAI error, never a hang."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.gateway import app as gateway_app
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.proxy import AttemptFailed
from kvflow.gateway.server import start_gateway
from kvflow.router import Router, load_config
from tests.gateway.fakes import FakePod

MODEL = "tiny"
STEPS = ["tokenize", "decide", "prefill", "prefill_unreachable", "try_targets", "stream_response"]


@pytest.fixture
async def pods() -> AsyncIterator[tuple[FakePod, FakePod]]:
    decode, prefill = FakePod("decode", "ok"), FakePod("prefill", "ok")
    await decode.start("127.0.0.31")
    await prefill.start("127.0.0.32")
    yield decode, prefill
    await decode.stop()
    await prefill.stop()


def counters(router: Router) -> list[tuple[int, int, int]]:
    out = []
    for ep in router.endpoints:
        c = router.datastore.counter(ep.id)
        assert c is not None
        out.append((c.in_flight, c.prefilling, c.tokens))
    return out


@pytest.mark.parametrize("step", STEPS)
async def test_a_failure_at_any_step_releases_everything(step: str, pods: tuple[FakePod, FakePod],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    decode, prefill = pods
    assert decode.endpoint is not None and prefill.endpoint is not None
    prefill_pod = Endpoint(prefill.endpoint.host, prefill.endpoint.port, role=Role.PREFILL)
    router = Router(load_config({"kvEvents": {"enabled": False}, "pd": {"threshold": 4}}),
                    [decode.endpoint, prefill_pod], profile="default")

    def boom(*args: Any, **kw: Any) -> Any:
        if step == "prefill_unreachable":
            raise AttemptFailed("connect", "injected: the prefill pod is gone", dead=True)
        raise RuntimeError(f"injected failure in {step}")

    async def aboom(*args: Any, **kw: Any) -> Any:
        boom()

    if step == "tokenize":  # inside the router's one call, before its decision
        monkeypatch.setattr(router.tokenizer, "encode", boom)
    elif step == "decide":
        monkeypatch.setattr(router, step, boom)
    else:
        monkeypatch.setattr(gateway_app, step.removesuffix("_unreachable"), aboom)
    config = GatewayConfig.model_validate({"port": 0, "pools": [{"model": MODEL, "endpoints": []}]})
    running = await start_gateway(config, {MODEL: router})
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "a prompt well over the P/D threshold " * 4, "max_tokens": 2,
                    "stream": True}
            async with session.post(f"http://127.0.0.1:{running.port}/v1/completions", json=body) as r:
                text = await r.text()
        if step == "prefill_unreachable":  # a failed prefill leg is not the client's problem: decode computes it
            assert r.status == 200, text
        else:
            assert r.status == 500, text
            assert json.loads(text)["error"]["type"] == "InternalServerError"
        assert counters(router) == [(0, 0, 0), (0, 0, 0)]
        pool = running.gateway.pools[MODEL]
        assert (pool.gate.queue.inflight, pool.gate.queue.waiting) == (0, 0)
    finally:
        await running.close()
