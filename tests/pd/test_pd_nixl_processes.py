"""Prefill and decode simulator pods as real processes moving real KV bytes over NIXL.

Prefill on 127.0.0.2, decode on 127.0.0.3 and 127.0.0.4; requests speak vLLM's two-step P/D
protocol directly (no gateway). Every decode pod verifies each pulled block against what the
prefill pod wrote, and counts the result in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed (pip install nixl nixl-cu12)")

from kvflow.local.procs import ProcessGroup
from tests.pd.pods import decode, metrics, prefill, start_pod
from tests.waiting import eventually

BLOCK = 16


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    with ProcessGroup(tmp_path / "logs") as g:
        yield g


def prompt(i: int, words: int = 60) -> str:
    """Distinct from the first word on, so no decode pod ever has a prefix-cache hit."""
    return f"request {i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words))


def blocks(prompt_tokens: int) -> int:
    return -(-prompt_tokens // BLOCK)


async def test_concurrent_pd_requests_pull_exactly_the_blocks_prefill_wrote(group: ProcessGroup) -> None:
    p = start_pod(group, "prefill", "127.0.0.2")
    decoders = [start_pod(group, "decode", "127.0.0.3"), start_pod(group, "decode", "127.0.0.4")]
    group.wait_ready(60)
    n = 48

    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> tuple[int, int]:
            params = await prefill(session, p, prompt(i))
            status, body = await decode(session, decoders[i % 2], prompt(i), params)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 4
            return i % 2, blocks(params["prompt_tokens"])

        done = await asyncio.gather(*(one(i) for i in range(n)))
        got = [await metrics(session, d) for d in decoders]

        async def released() -> dict[str, float] | None:
            now = await metrics(session, p)
            return None if now["kvflow_sim:nixl_pinned_exports"] else now

        # the last done notifications are still on their way
        prefilled = await eventually(released, timeout=5, what="the prefill pod to release every export")

    for k, m in enumerate(got):
        expected_blocks = sum(b for pod, b in done if pod == k)
        assert m["kvflow_sim:nixl_blocks_verified_total"] == expected_blocks
        assert m["kvflow_sim:nixl_blocks_mismatched_total"] == 0
        assert m["vllm:nixl_xfer_time_seconds_count"] == n / 2
        assert m["vllm:nixl_bytes_transferred_sum"] == expected_blocks * 4096
        assert m["kvflow_sim:nixl_pull_fallbacks_total"] == 0
        assert m["kvflow_sim:kv_pull_failures_total"] == 0
        assert m["kvflow_sim:nixl_handshakes_total[ok]"] == 1
    assert prefilled["kvflow_sim:nixl_exports_released_total[notified]"] == n
    assert prefilled["kvflow_sim:nixl_pinned_exports"] == 0


async def test_killing_the_prefill_pod_gives_fallbacks_not_errors(group: ProcessGroup) -> None:
    p = start_pod(group, "prefill", "127.0.0.2")
    d = start_pod(group, "decode", "127.0.0.3")
    group.wait_ready(60)

    async with aiohttp.ClientSession() as session:
        first = await prefill(session, p, prompt(0))
        status, _ = await decode(session, d, prompt(0), first)
        assert status == 200  # decode knows the prefill agent now
        pending = [await prefill(session, p, prompt(i)) for i in range(1, 9)]
        group.stop(p.child, sig=signal.SIGKILL)

        results = await asyncio.gather(*(decode(session, d, prompt(i + 1), params) for i, params in enumerate(pending)))
        m = await metrics(session, d)

    assert [status for status, _ in results] == [200] * 8
    assert [body["usage"]["completion_tokens"] for _, body in results] == [4] * 8
    assert m["kvflow_sim:kv_pull_failures_total"] == 8
    assert m["kvflow_sim:nixl_pull_fallbacks_total"] == 8
    assert m["kvflow_sim:nixl_pull_fallbacks_total[prefill_unreachable]"] == 8
    assert m["kvflow_sim:nixl_stale_peers_total"] == 1  # the dead agent's READs failed; dropped once
    assert m["kvflow_sim:nixl_handshakes_total[failed]"] == 1  # one re-handshake, shared by all eight
    assert m["kvflow_sim:nixl_blocks_mismatched_total"] == 0
    assert m["kvflow_sim:nixl_blocks_verified_total"] == blocks(first["prompt_tokens"])


async def test_a_restarted_prefill_pod_serves_new_requests_and_refuses_old_ones(group: ProcessGroup) -> None:
    p = start_pod(group, "prefill", "127.0.0.2")
    d = start_pod(group, "decode", "127.0.0.3")
    group.wait_ready(60)

    async with aiohttp.ClientSession() as session:
        first = await prefill(session, p, prompt(0))
        assert (await decode(session, d, prompt(0), first))[0] == 200
        stale = await prefill(session, p, prompt(1))
        group.stop(p.child, sig=signal.SIGKILL)
        p2 = start_pod(group, "prefill", "127.0.0.2", port=p.port, side_channel=p.side_channel)
        group.wait_ready(60, [p2.child])

        old_status, _ = await decode(session, d, prompt(1), stale)  # blocks of the dead incarnation
        fresh = await prefill(session, p2, prompt(2))
        new_status, _ = await decode(session, d, prompt(2), fresh)
        m = await metrics(session, d)

    assert (old_status, new_status) == (200, 200)
    assert fresh["remote_engine_id"] != stale["remote_engine_id"]
    # The stale READ fails; re-handshaking finds another engine behind the port: fall back.
    assert m["kvflow_sim:nixl_pull_fallbacks_total[prefill_unreachable]"] == 1
    assert m["kvflow_sim:nixl_stale_peers_total"] == 1
    assert m["kvflow_sim:nixl_handshakes_total[failed]"] == 1
    assert m["kvflow_sim:nixl_handshakes_total[ok]"] == 2  # the old engine, then the new one
    assert m["kvflow_sim:nixl_blocks_verified_total"] == blocks(first["prompt_tokens"]) + blocks(fresh["prompt_tokens"])
    assert m["kvflow_sim:nixl_blocks_mismatched_total"] == 0


@pytest.mark.slow
async def test_a_hung_prefill_pod_times_the_transfer_out(group: ProcessGroup) -> None:
    # Over UCX's TCP transport a READ needs the target to progress, so a stopped pod hangs it.
    env = {"UCX_TLS": "tcp", "KVFLOW_NIXL_TRANSFER_TIMEOUT": "1.0"}
    p = start_pod(group, "prefill", "127.0.0.2", env=env)
    d = start_pod(group, "decode", "127.0.0.3", env=env)
    group.wait_ready(60)

    async with aiohttp.ClientSession() as session:
        assert (await decode(session, d, prompt(0), await prefill(session, p, prompt(0))))[0] == 200
        params = await prefill(session, p, prompt(1))
        os.killpg(p.child.popen.pid, signal.SIGSTOP)
        try:
            status, body = await decode(session, d, prompt(1), params)
            m = await metrics(session, d)
        finally:
            os.killpg(p.child.popen.pid, signal.SIGCONT)

    assert status == 200, body
    assert m["kvflow_sim:nixl_pull_fallbacks_total[transfer_timeout]"] == 1
    assert m["vllm:nixl_num_failed_transfers_total"] == 1
