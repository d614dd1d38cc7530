"""A pod dies under load: requests that had not started streaming are served by the other pod,
the ones it was streaming end with a clean OpenAI error event, and none is lost.

Real processes: two simulated pods and the gateway (with the real router) on 127.0.0.x.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port

pytestmark = pytest.mark.slow
MODEL = "tiny"


TOKENS = 150  # ~1 s on the h100-llama8b profile: long enough to be mid-stream at the kill


async def stream_one(session: aiohttp.ClientSession, url: str, i: int,
                     streaming: asyncio.Semaphore | None = None) -> dict[str, object]:
    """What one client saw: chunks of text, whether it got [DONE], an error event, the HTTP status.

    ``streaming`` is released once the first chunk is in.
    """
    body = {"model": MODEL, "prompt": f"request {i} tells a story", "max_tokens": TOKENS, "stream": True,
            "ignore_eos": True}
    seen: dict[str, object] = {"chunks": 0, "done": False, "error": None, "status": None}
    async with session.post(url + "/v1/completions", json=body) as r:
        seen["status"] = r.status
        if r.status != 200:
            seen["error"] = (await r.json())["error"]["type"]
            return seen
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                seen["done"] = True
            elif b'"error"' in data[:20]:
                seen["error"] = json.loads(data)["error"]["type"]
            else:
                seen["chunks"] = int(seen["chunks"]) + 1  # type: ignore[call-overload]
                if seen["chunks"] == 1 and streaming is not None:
                    streaming.release()
    return seen


async def test_killing_a_pod_under_load(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pods = sim_pods(2, "--model", MODEL, "--profile", "h100-llama8b")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        gw = group.start("gateway", kvflow_argv(
            "gateway", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
            "--endpoint", pods[0].id, "--endpoint", pods[1].id, "--profile", "round-robin"),
            ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            streaming = asyncio.Semaphore(0)
            before = [asyncio.ensure_future(stream_one(session, url, i, streaming)) for i in range(24)]
            for _ in before:  # kill only once every stream has begun
                await asyncio.wait_for(streaming.acquire(), 30)
            group.stop(pods[0].child, sig=signal.SIGKILL)
            after = [asyncio.ensure_future(stream_one(session, url, 100 + i)) for i in range(24)]
            results_before = await asyncio.gather(*before)
            results_after = await asyncio.gather(*after)
            async with session.get(url + "/metrics") as r:
                metrics = await r.text()
        assert gw.alive()

    # Requests sent after the kill never started on the dead pod: all succeed on the other one.
    assert all(r["done"] and r["error"] is None and r["chunks"] == TOKENS for r in results_after), results_after
    # Requests running at the kill either finished on the live pod or ended with a clean error event.
    finished = [r for r in results_before if r["error"] is None]
    cut = [r for r in results_before if r["error"] is not None]
    assert all(r["done"] and r["chunks"] == TOKENS for r in finished)
    assert all(r["status"] == 200 and r["error"] == "BadGatewayError" and r["done"] for r in cut)
    assert all(0 < int(r["chunks"]) < TOKENS for r in cut)  # type: ignore[call-overload]
    assert len(cut) == 12  # round-robin gave the dead pod half of them
    assert f'kvflow_gateway_failures_total{{model="{MODEL}",reason="midstream"}} {float(len(cut))}' in metrics
