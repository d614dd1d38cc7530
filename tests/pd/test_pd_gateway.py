"""The stack `kvflow up --prefill 1 --decode 2` runs, end to end through the gateway, with NIXL.

One prefill pod (127.0.0.2) and two decode pods (127.0.0.3, 127.0.0.4) as `kvflow sim
--kv-transfer nixl`, and the gateway in front; prompts are long enough for the router's P/D
threshold. Killing the prefill pod during a run must cost fallbacks, never a client error.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed (pip install nixl nixl-cu12)")

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port
from tests.pd.pods import MODEL, Pod, metrics, start_pod

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ProcessGroup, list[Pod], str]]:
    with ProcessGroup(tmp_path / "logs") as group:
        pods = [start_pod(group, "prefill", "127.0.0.2"), start_pod(group, "decode", "127.0.0.3"),
                start_pod(group, "decode", "127.0.0.4")]
        group.wait_ready(60)
        port = free_port()
        argv = kvflow_argv("gateway", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                           "--prefill-endpoint", f"{pods[0].host}:{pods[0].port}",
                           *(a for p in pods[1:] for a in ("--endpoint", f"{p.host}:{p.port}")))
        group.start("gateway", argv, ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(60)
        yield group, pods, f"http://127.0.0.1:{port}"


def long_prompt(i: int) -> str:
    return f"conversation {i}: " + "the quick brown fox jumps over the lazy dog " * 40  # ~370 tokens


async def ask(session: aiohttp.ClientSession, gateway: str, i: int) -> int | str:
    body = {"model": MODEL, "prompt": long_prompt(i), "max_tokens": 8}
    try:
        async with session.post(gateway + "/v1/completions", json=body) as response:
            await response.read()
            return response.status
    except TimeoutError:
        return "timeout"


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))  # a hang fails, not stalls


async def test_one_wave_through_the_gateway_moves_kv_over_nixl(stack: tuple[ProcessGroup, list[Pod], str]) -> None:
    _, pods, gateway = stack
    async with client() as session:
        statuses = await asyncio.gather(*(ask(session, gateway, i) for i in range(8)))
        decoded = [await metrics(session, p) for p in pods[1:]]
    assert statuses == [200] * 8
    assert sum(m["vllm:nixl_xfer_time_seconds_count"] for m in decoded) == 8
    assert sum(m["kvflow_sim:nixl_blocks_mismatched_total"] for m in decoded) == 0
    assert sum(m["kvflow_sim:nixl_pull_fallbacks_total"] for m in decoded) == 0


async def test_waves_through_the_gateway_move_kv_over_nixl(stack: tuple[ProcessGroup, list[Pod], str]) -> None:
    _, pods, gateway = stack
    statuses: list[int | str] = []
    async with client() as session:
        for wave in range(3):
            statuses += await asyncio.gather(*(ask(session, gateway, 100 * wave + i) for i in range(8)))
        decoded = [await metrics(session, p) for p in pods[1:]]
    assert statuses == [200] * 24
    assert sum(m["kvflow_sim:nixl_blocks_mismatched_total"] for m in decoded) == 0
    assert sum(m["vllm:nixl_xfer_time_seconds_count"] for m in decoded) == 24


async def test_killing_the_prefill_pod_costs_fallbacks_not_errors(stack: tuple[ProcessGroup, list[Pod], str]) -> None:
    group, pods, gateway = stack
    async with client() as session:
        statuses = await asyncio.gather(*(ask(session, gateway, i) for i in range(8)))  # P/D works
        group.stop(pods[0].child, sig=signal.SIGKILL)
        for wave in range(1, 3):  # the gateway finds the prefill pod dead, then serves aggregated
            statuses += await asyncio.gather(*(ask(session, gateway, 100 * wave + i) for i in range(8)))
        decoded = [await metrics(session, p) for p in pods[1:]]
    assert statuses == [200] * 24
    assert sum(m["vllm:nixl_xfer_time_seconds_count"] for m in decoded) == 8
    assert sum(m["kvflow_sim:nixl_blocks_mismatched_total"] for m in decoded) == 0
