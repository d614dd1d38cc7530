"""vLLM 0.32's KV-lease heartbeats: a decode pod keeps the prefill blocks of its waiting requests alive.

Decode side: every ``pin_timeout_s / 6`` one NIXL notification ``b"HB:<id>,<id>"`` per prefill
engine, naming each request tracked from ``Engine.submit`` until its pull ends (or it is aborted).
Prefill side: each named pin expires at the later of its deadline and now + 2/3 × pin_timeout_s.
The pods here use a 0.6 s pin timeout: heartbeats every 0.1 s, each extending a lease to 0.4 s.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest

from kvflow.sim.engine import Engine
from kvflow.sim.kv_transfer import NoTransfer, PullResult, TransferConfig
from kvflow.sim.nixl_transfer import NixlTransfer, heartbeat_ids, heartbeat_message
from kvflow.sim.profiles import PROFILES
from tests.sim.helpers import make_request, make_scheduler

PIN_S = 0.6  # heartbeat interval 0.1 s, lease extension 0.4 s
TOKENS = list(range(100, 116))  # one block of 16


def _nixl_importable() -> bool:
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        return False
    return True


needs_nixl = pytest.mark.skipif(not _nixl_importable(), reason="nixl is not installed (pip install nixl nixl-cu12)")


def sample(metric: Any) -> float:
    return float(metric.value)


async def until(predicate: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def pd_params(prefill: Any, request_id: str, block_ids: list[int] | None = None) -> dict[str, Any]:
    """What a prefill pod answers (its blocks exported and pinned): the decode request's params."""
    block_ids = block_ids or [3]
    return {"do_remote_prefill": True, "remote_block_ids": [block_ids], "remote_request_id": request_id,
            **prefill.export(request_id, block_ids, TOKENS)}


def address(engine_id: str, request_id: str, port: int = 20001) -> dict[str, Any]:
    return {"do_remote_prefill": True, "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
            "remote_port": port, "remote_request_id": request_id, "tp_size": 1}


# -- the message (pure) ---------------------------------------------------------------------------


def test_a_heartbeat_is_HB_and_the_comma_joined_request_ids() -> None:
    assert heartbeat_message(["req-b", "req-a"]) == b"HB:req-a,req-b"
    assert heartbeat_ids("HB:req-a,req-b") == ["req-a", "req-b"]
    assert heartbeat_ids(heartbeat_message(["cmpl-1-0-x"]).decode()) == ["cmpl-1-0-x"]
    assert heartbeat_ids("HB:") == []


def test_a_done_notification_is_not_a_heartbeat() -> None:
    assert heartbeat_ids("req-a:1") is None
    assert heartbeat_ids("cmpl-HB:2") is None


# -- tracking (no NIXL needed) --------------------------------------------------------------------


def test_tracked_requests_are_grouped_by_prefill_engine_until_untracked() -> None:
    decode = NixlTransfer(TransferConfig(engine_id="decode-a", pin_timeout_s=PIN_S))
    decode.track("local-1", address("prefill-a", "req-1"))
    decode.track("local-2", address("prefill-a", "req-2"))
    decode.track("local-3", address("prefill-b", "req-3", port=20002))
    decode.track("local-4", address("prefill-a", "req-1"))  # the same params sent twice
    decode.track("local-5", {"do_remote_prefill": True, "remote_request_id": "req-5"})  # no address: untracked

    assert decode.tracked == {"prefill-a": ["req-1", "req-2"], "prefill-b": ["req-3"]}
    decode.untrack("local-1")
    assert decode.tracked == {"prefill-a": ["req-1", "req-2"], "prefill-b": ["req-3"]}  # local-4 still waits
    for request_id in ("local-4", "local-2", "local-3", "local-3", "never-tracked"):
        decode.untrack(request_id)
    assert decode.tracked == {}


def test_the_heartbeat_interval_is_a_sixth_of_the_lease() -> None:
    assert NixlTransfer(TransferConfig(pin_timeout_s=30.0)).heartbeat_interval == 5.0
    assert NixlTransfer(TransferConfig(pin_timeout_s=0.0)).heartbeat_interval > 0  # never a busy loop


class RecordingTransfer(NoTransfer):
    """Records what the engine asks of it; a pull waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(TransferConfig())
        self.calls: list[tuple[str, str]] = []
        self.pulling = asyncio.Event()
        self.finish_pull = asyncio.Event()

    def track(self, request_id: str, params: dict[str, Any]) -> None:
        self.calls.append(("track", params["remote_request_id"]))

    def untrack(self, request_id: str) -> None:
        self.calls.append(("untrack", request_id))

    async def pull(self, params: dict[str, Any], local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        self.calls.append(("pull", params["remote_request_id"]))
        self.pulling.set()
        await self.finish_pull.wait()
        return PullResult(False, 0.0, 0, "test")


async def test_the_engine_tracks_a_remote_prefill_request_from_submit_until_its_pull_ends() -> None:
    transfer = RecordingTransfer()
    engine = Engine(make_scheduler(), PROFILES["instant"], transfer=transfer)
    await engine.start()
    try:
        engine.submit(make_request("plain", [1, 2, 3], max_tokens=1))
        req = make_request("d-1", list(range(8)), max_tokens=1, kv=address("prefill-a", "req-1"))
        engine.submit(req)
        await asyncio.wait_for(transfer.pulling.wait(), 2)
        assert transfer.calls == [("track", "req-1"), ("pull", "req-1")]  # still tracked while pulling

        transfer.finish_pull.set()
        await until(lambda: req.finished)
        assert transfer.calls == [("track", "req-1"), ("pull", "req-1"), ("untrack", "d-1")]
    finally:
        await engine.stop()


async def test_the_engine_untracks_an_aborted_request_that_never_got_blocks() -> None:
    transfer = RecordingTransfer()
    engine = Engine(make_scheduler(), PROFILES["instant"], transfer=transfer)
    await engine.start()
    try:
        engine.submit(make_request("d-1", list(range(100)), kv=address("prefill-a", "req-1")))  # 25 blocks of 17
        await asyncio.sleep(0.02)
        engine.abort("d-1")
        assert transfer.calls == [("track", "req-1"), ("untrack", "d-1")]
    finally:
        await engine.stop()


# -- between two pods over NIXL -------------------------------------------------------------------


@needs_nixl
async def test_heartbeats_keep_a_pin_alive_past_its_timeout_until_the_done_notification(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    params = pd_params(prefill, "req-1")
    decode.track("local-1", params)  # e.g. the decode request waits for free blocks

    await asyncio.sleep(2 * PIN_S)

    assert p_host.unpinned == []
    assert sample(decode.metrics.heartbeats_sent["ok"]) >= 6  # ~12: one per 0.1 s
    assert sample(prefill.metrics.leases_extended) >= 3  # those after the first 0.2 s moved the deadline
    result = await decode.pull(params, [7], TOKENS)
    decode.untrack("local-1")
    assert result.ok
    await until(lambda: p_host.unpinned == ["req-1"])
    assert sample(prefill.metrics.released["notified"]) == 1
    assert sample(prefill.metrics.expired) == 0
    assert sample(decode.metrics.handshakes["ok"]) == 1  # the pull used the heartbeats' handshake


@needs_nixl
async def test_without_heartbeats_a_pin_expires_after_its_timeout(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    pd_params(prefill, "req-1")
    start = asyncio.get_running_loop().time()

    await until(lambda: p_host.unpinned == ["req-1"])

    assert asyncio.get_running_loop().time() - start >= PIN_S - 0.05
    assert sample(prefill.metrics.expired) == 1
    assert sample(prefill.metrics.heartbeats_received) == 0
    assert sample(decode.metrics.heartbeats_sent["ok"]) + sample(decode.metrics.heartbeats_sent["failed"]) == 0


@needs_nixl
async def test_a_heartbeat_in_a_batch_extends_what_it_names_and_ignores_unknown_ids(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    pd_params(prefill, "req-1", [3])
    pd_params(prefill, "req-2", [4])

    prefill._on_notifs({"decode-agent": [b"HB:ghost,req-1,req-2", b"req-2:1", b"HB:"]})

    assert p_host.unpinned == ["req-2"]  # the done notification released; no heartbeat did
    assert sample(prefill.metrics.released["notified"]) == 1
    assert sample(prefill.metrics.heartbeats_received) == 2
    assert sample(prefill.metrics.late_notifications) == 0  # "HB:…" is not mistaken for "<id>:<tp>"
    assert "req-1" in prefill._pins


@needs_nixl
async def test_a_heartbeat_moves_a_deadline_later_never_earlier(nixl_pods: Any) -> None:
    prefill, _ = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    loop = asyncio.get_running_loop()
    pd_params(prefill, "req-1")
    exported_deadline = prefill._pins["req-1"].when()

    prefill._on_notifs({"decode-agent": [b"HB:req-1"]})  # now + 0.4 s is before the export's now + 0.6 s
    assert prefill._pins["req-1"].when() == exported_deadline
    await asyncio.sleep(0.3)
    prefill._on_notifs({"decode-agent": [b"HB:req-1"]})

    assert prefill._pins["req-1"].when() == pytest.approx(loop.time() + 2 * PIN_S / 3, abs=0.02)
    assert prefill._pins["req-1"].when() > exported_deadline
    assert sample(prefill.metrics.leases_extended) == 1


@needs_nixl
async def test_once_untracked_no_more_heartbeats_are_sent_and_the_pin_expires(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    decode.track("local-1", pd_params(prefill, "req-1"))
    await until(lambda: sample(prefill.metrics.leases_extended) >= 2)

    decode.untrack("local-1")
    untracked_at = asyncio.get_running_loop().time()
    await until(lambda: p_host.unpinned == ["req-1"])

    assert asyncio.get_running_loop().time() - untracked_at >= 2 * PIN_S / 3 - 0.15  # the last extension ran out
    assert sample(prefill.metrics.expired) == 1
    sent = sample(decode.metrics.heartbeats_sent["ok"])
    await asyncio.sleep(3 * decode.heartbeat_interval)
    assert sample(decode.metrics.heartbeats_sent["ok"]) == sent  # the heartbeat task is parked


@needs_nixl
async def test_a_heartbeat_to_an_unreachable_engine_is_counted_not_raised(nixl_pods: Any) -> None:
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S, handshake_timeout=0.2)
    decode.track("local-1", address("prefill-gone", "req-1", port=decode.side_channel_port + 1))

    await until(lambda: sample(decode.metrics.heartbeats_sent["failed"]) >= 2)

    assert sample(decode.metrics.heartbeats_sent["ok"]) == 0
    assert sample(decode.metrics.handshakes["failed"]) >= 2
    assert decode.tracked == {"prefill-gone": ["req-1"]}  # it goes on trying until untracked
