"""NixlTransfer between two in-process pods: real NIXL READs of real bytes, verified, and freed."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed (pip install nixl nixl-cu12)")

from kvflow.protocol.kv_transfer import KvTransferParams
from kvflow.sim.clock import FakeClock
from kvflow.sim.nixl.layout import block_digests, mismatched_blocks
from tests.waiting import eventually

TOKENS = list(range(100, 140))  # 40 tokens: 3 blocks of 16, the last one partial


def sample(metric: Any) -> float:
    return float(metric.value)


def hist_count(metric: Any) -> float:
    return float(metric.count)


def pd_params(prefill: Any, request_id: str, block_ids: list[int], tokens: list[int]) -> KvTransferParams:
    """What the engine answers a prefill request with: the transfer's fields plus its own."""
    return replace(prefill.export(request_id, block_ids, tokens), do_remote_prefill=True,
                   remote_block_ids=(tuple(block_ids),), remote_request_id=request_id)


async def test_export_answers_with_vllm_shaped_fields(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a")
    extra = prefill.export("req-1", [3, 4, 5], TOKENS)
    assert extra == KvTransferParams(remote_engine_id="prefill-a", remote_host="127.0.0.1",
                                     remote_port=prefill.side_channel_port, tp_size=1)


async def test_a_pull_reads_exactly_what_prefill_wrote_then_frees_it(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3, 4, 5], TOKENS)

    result = await decode.pull(params, [7, 8, 9], TOKENS)

    assert (result.ok, result.nbytes, result.reason) == (True, 3 * 4096, "")
    assert result.seconds > 0
    assert mismatched_blocks(decode.agent.regions, [7, 8, 9], block_digests(TOKENS, 16)) == []
    assert not decode.agent.regions[:, [3, 4, 5, 6, 10]].any()  # nothing else was written
    await eventually(lambda: p_host.unpinned == ["req-1"])
    assert sample(prefill.metrics.released["notified"]) == 1
    assert hist_count(decode.metrics.xfer_time) == 1
    assert decode.metrics.bytes.sum == 3 * 4096
    assert sample(decode.metrics.blocks_verified) == 3
    assert sample(decode.metrics.handshakes["ok"]) == 1


async def test_blocks_cached_on_decode_are_not_pulled(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3, 4, 5], TOKENS)

    result = await decode.pull(params, [9], TOKENS)  # the first two blocks hit decode's prefix cache

    assert (result.ok, result.nbytes) == (True, 4096)
    assert mismatched_blocks(decode.agent.regions, [9], block_digests(TOKENS, 16)[2:]) == []
    await eventually(lambda: p_host.unpinned == ["req-1"])


async def test_concurrent_pulls_share_one_handshake(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    prompts = {f"req-{i}": [1000 * i + t for t in range(48)] for i in range(8)}
    params = {rid: pd_params(prefill, rid, [3 * i + 1, 3 * i + 2, 3 * i + 3], tokens)
              for i, (rid, tokens) in enumerate(prompts.items())}

    results = await asyncio.gather(*(decode.pull(params[rid], [30 + 3 * i, 31 + 3 * i, 32 + 3 * i], tokens)
                                     for i, (rid, tokens) in enumerate(prompts.items())))

    assert [r.ok for r in results] == [True] * 8
    assert sample(decode.metrics.handshakes["ok"]) == 1
    assert sample(decode.metrics.blocks_verified) == 24
    await eventually(lambda: sorted(p_host.unpinned) == sorted(prompts))


async def test_a_pull_from_a_pod_nobody_answers_falls_back(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a", handshake_timeout=0.3)
    params = replace(pd_params(prefill, "req-1", [3, 4, 5], TOKENS), remote_port=prefill.side_channel_port + 1)

    result = await decode.pull(params, [7, 8, 9], TOKENS)

    assert (result.ok, result.nbytes) == (False, 0)
    assert result.reason.startswith("prefill_unreachable: no answer from 127.0.0.1:")
    assert result.seconds < 1.0
    assert sample(decode.metrics.fallbacks["prefill_unreachable"]) == 1
    assert sample(decode.metrics.handshakes["failed"]) == 1


async def test_the_wrong_engine_behind_a_side_channel_is_refused(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = replace(pd_params(prefill, "req-1", [3], TOKENS[:16]), remote_engine_id="prefill-b")

    result = await decode.pull(params, [7], TOKENS[:16])

    assert result.reason == "prefill_unreachable: expected engine prefill-b, side channel serves prefill-a"


async def test_blocks_expired_and_reused_on_prefill_are_caught_not_served(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3, 4], TOKENS[:32])
    prefill.release("req-1")  # e.g. the pin timed out ...
    prefill.export("req-2", [3, 4], [7] * 32)  # ... and another request computed into the blocks

    result = await decode.pull(params, [7, 8], TOKENS[:32])

    assert result.ok is False
    assert result.reason.startswith("content_mismatch")
    assert sample(decode.metrics.blocks_mismatched) == 2
    assert sample(decode.metrics.fallbacks["content_mismatch"]) == 1
    assert p_host.unpinned == ["req-1"]


async def test_pinned_blocks_expire_and_a_late_notification_is_counted(nixl_pods: Any, clock: FakeClock) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=0.1)
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3], TOKENS[:16])
    clock.advance(0.099)
    await asyncio.sleep(0)  # whatever the clock woke runs now
    assert p_host.unpinned == []
    clock.advance(0.001)
    await eventually(lambda: p_host.unpinned == ["req-1"])

    result = await decode.pull(params, [7], TOKENS[:16])  # nothing reused the block yet: still right

    assert result.ok
    await eventually(lambda: sample(prefill.metrics.late_notifications) == 1)
    assert sample(prefill.metrics.released["expired"]) == 1
    assert sample(prefill.metrics.expired) == 1
    assert p_host.unpinned == ["req-1"]


async def test_bad_params_fall_back_without_any_io(nixl_pods: Any) -> None:
    decode, _ = await nixl_pods("decode-a")
    result = await decode.pull(KvTransferParams(do_remote_prefill=True), [1], TOKENS[:16])
    assert result.reason == ("bad_params: kv_transfer_params lack remote_engine_id, remote_host, remote_port, "
                             "remote_request_id")
    assert sample(decode.metrics.fallbacks["bad_params"]) == 1


async def test_metrics_use_vllm_names_and_kvflow_names_for_the_rest(nixl_pods: Any) -> None:
    from prometheus_client import generate_latest

    decode, _ = await nixl_pods("decode-a", model_name="m")
    text = generate_latest(decode.metrics.registry).decode()
    for name in ("vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_post_time_seconds_count",
                 "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_descriptors_count",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
                 "vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total",
                 'kvflow_sim:nixl_pull_fallbacks_total{engine="0",model_name="m",reason="transfer_timeout"} 0.0',
                 "kvflow_sim:nixl_pinned_exports"):
        assert name in text, name


async def test_the_advertised_side_channel_host_can_differ_from_the_bound_one(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a", advertise_host="10.1.2.3")
    assert prefill.export("req-1", [3], TOKENS[:16]).remote_host == "10.1.2.3"


async def test_an_export_with_fewer_blocks_than_the_prompt_is_caught_by_the_pull(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3, 4], TOKENS)  # 3 blocks of prompt, 2 exported

    result = await decode.pull(params, [7, 8, 9], TOKENS)

    assert result.reason == "bad_params: 3 local and 2 remote blocks for a 3-block prompt"


async def test_a_read_is_verified_on_the_nixl_thread_and_its_errors_reach_the_caller(nixl_pods: Any) -> None:
    import threading

    prefill, _ = await nixl_pods("prefill-a")
    decode, _ = await nixl_pods("decode-a")
    params = pd_params(prefill, "req-1", [3, 4], TOKENS[:32])
    assert (await decode.pull(params, [7, 8], TOKENS[:32])).ok  # handshake done, peer cached
    agent, peer = decode.agent, decode.peers.cached("prefill-a")
    threads: list[str] = []

    def verify() -> list[int]:
        threads.append(threading.current_thread().name)
        return [8]

    result = await agent.read(peer.agent_name, [7, 8], [3, 4], verify=verify)
    assert (result.mismatched, threads) == ((8,), [f"nixl-{agent.name}"])
    assert (await agent.read(peer.agent_name, [7], [3])).mismatched is None  # not asked to verify

    def broken() -> list[int]:
        raise ZeroDivisionError("verify failed")

    with pytest.raises(ZeroDivisionError):
        await agent.read(peer.agent_name, [7], [3], verify=broken)
    assert (await agent.read(peer.agent_name, [7], [3], verify=list)).mismatched == ()  # thread lives on


async def test_the_kv_buffer_starts_zeroed_and_page_aligned(nixl_pods: Any) -> None:
    decode, _ = await nixl_pods("decode-a")
    buffer = decode.agent.buffer
    assert buffer.nbytes == decode.agent.layout.total_bytes and not buffer.any()
    assert buffer.flags.writeable and buffer.ctypes.data % 4096 == 0
