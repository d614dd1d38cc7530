"""vLLM 0.32's KV-lease heartbeats: a decode pod keeps the prefill blocks of its waiting requests alive.

Decode side: every ``pin_timeout_s / 6`` one NIXL notification ``b"HB:<id>,<id>"`` per prefill
engine, naming each request tracked from ``Engine.submit`` until its pull ends (or it is aborted).
Prefill side: each named pin expires at the later of its deadline and now + 2/3 × pin_timeout_s.
The pods here share a fake clock the tests step, and a 0.75 s pin timeout: heartbeats every
0.125 s, each extending a lease to 0.5 s from now (binary fractions: every deadline is exact).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from kvflow.protocol.kv_transfer import KvTransferParams, PrefillEngine
from kvflow.sim.clock import FakeClock
from kvflow.sim.engine import Engine
from kvflow.sim.kv_transfer import NoTransfer, PullResult, TransferConfig
from kvflow.sim.nixl import NixlTransfer
from kvflow.sim.nixl.heartbeats import EngineLeases, Heartbeats
from kvflow.sim.nixl.notifications import heartbeat_ids, heartbeat_message
from kvflow.sim.profiles import PROFILES
from tests.sim.helpers import make_request, make_scheduler
from tests.waiting import eventually

PIN_S = 0.75  # heartbeat interval 0.125 s, lease extension 0.5 s
INTERVAL = PIN_S / 6
TOKENS = list(range(100, 116))  # one block of 16
ENGINE_A, ENGINE_B = PrefillEngine("prefill-a", "127.0.0.1", 20001), PrefillEngine("prefill-b", "127.0.0.1", 20002)


def _nixl_importable() -> bool:
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        return False
    return True


needs_nixl = pytest.mark.skipif(not _nixl_importable(), reason="nixl is not installed (pip install nixl nixl-cu12)")


def sample(metric: Any) -> float:
    return float(metric.value)


def pd_params(prefill: Any, request_id: str, block_ids: list[int] | None = None) -> KvTransferParams:
    """What a prefill pod answers (its blocks exported and pinned): the decode request's params."""
    block_ids = block_ids or [3]
    return replace(prefill.export(request_id, block_ids, TOKENS), do_remote_prefill=True,
                   remote_block_ids=(tuple(block_ids),), remote_request_id=request_id)


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


# -- tracking and timing (no NIXL needed) ---------------------------------------------------------


def test_tracked_requests_are_grouped_by_prefill_engine_until_untracked() -> None:
    decode = NixlTransfer(TransferConfig(engine_id="decode-a", pin_timeout_s=PIN_S))
    decode.track("local-1", KvTransferParams.from_wire(address("prefill-a", "req-1")))
    decode.track("local-2", KvTransferParams.from_wire(address("prefill-a", "req-2")))
    decode.track("local-3", KvTransferParams.from_wire(address("prefill-b", "req-3", port=20002)))
    decode.track("local-4", KvTransferParams.from_wire(address("prefill-a", "req-1")))  # the same params twice
    decode.track("local-5", KvTransferParams(do_remote_prefill=True, remote_request_id="req-5"))  # no address

    assert decode.tracked == {"prefill-a": ["req-1", "req-2"], "prefill-b": ["req-3"]}
    decode.untrack("local-1")
    assert decode.tracked == {"prefill-a": ["req-1", "req-2"], "prefill-b": ["req-3"]}  # local-4 still waits
    for request_id in ("local-4", "local-2", "local-3", "local-3", "never-tracked"):
        decode.untrack(request_id)
    assert decode.tracked == {}


def test_the_heartbeat_interval_is_a_sixth_of_the_lease() -> None:
    assert NixlTransfer(TransferConfig(pin_timeout_s=30.0)).heartbeat_interval == 5.0
    assert NixlTransfer(TransferConfig(pin_timeout_s=0.0)).heartbeat_interval > 0  # never a busy loop


class Recorder:
    """A heartbeat ``send`` that records each one; engines in ``held`` wait until released."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[str] = asyncio.Queue()
        self.held: dict[str, asyncio.Event] = {}
        self.released: asyncio.Queue[str] = asyncio.Queue()

    async def send(self, leases: EngineLeases) -> None:
        self.sent.put_nowait(f"{leases.engine.engine_id} {heartbeat_message(leases.request_ids).decode()}")
        if leases.engine.engine_id in self.held:
            await self.held[leases.engine.engine_id].wait()
            self.released.put_nowait(leases.engine.engine_id)

    async def take(self, count: int) -> list[str]:
        """The next ``count`` heartbeats, sorted (a round's order is not specified)."""
        return sorted([await asyncio.wait_for(self.sent.get(), 2) for _ in range(count)])


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def beating(clock: FakeClock, recorder: Recorder) -> AsyncIterator[Heartbeats]:
    """Started heartbeats on ``clock`` into ``recorder``, tracking one request on each of two
    engines; the first round (sent at once) is taken."""
    heartbeats = Heartbeats(clock, INTERVAL, recorder.send)
    heartbeats.start()
    try:
        heartbeats.track("local-1", ENGINE_A, "req-1")
        heartbeats.track("local-2", ENGINE_B, "req-2")
        assert await recorder.take(2) == ["prefill-a HB:req-1", "prefill-b HB:req-2"]
        yield heartbeats
    finally:
        await heartbeats.stop()


async def test_heartbeats_go_out_each_interval_and_stop_with_the_last_untrack(
        beating: Heartbeats, clock: FakeClock, recorder: Recorder) -> None:
    clock.advance(INTERVAL / 2)
    beating.track("local-3", ENGINE_A, "req-3")  # joins the next round: no extra heartbeat
    clock.advance(INTERVAL / 2)
    assert await recorder.take(2) == ["prefill-a HB:req-1,req-3", "prefill-b HB:req-2"]
    assert recorder.sent.empty()

    for request_id in ("local-1", "local-2", "local-3"):
        beating.untrack(request_id)
    clock.advance(INTERVAL)  # the task wakes, finds nothing tracked, and waits on an event
    await asyncio.sleep(0)
    assert (recorder.sent.empty(), clock.sleepers) == (True, 0)


async def test_an_engine_whose_heartbeat_is_still_in_flight_is_skipped_that_round(
        beating: Heartbeats, clock: FakeClock, recorder: Recorder) -> None:
    recorder.held["prefill-a"] = asyncio.Event()  # e.g. its handshake hangs
    clock.advance(INTERVAL)
    assert await recorder.take(2) == ["prefill-a HB:req-1", "prefill-b HB:req-2"]  # prefill-a's is held
    clock.advance(INTERVAL)
    assert await recorder.take(1) == ["prefill-b HB:req-2"]
    assert beating.in_flight == ["prefill-a"]
    recorder.held["prefill-a"].set()
    assert await asyncio.wait_for(recorder.released.get(), 2) == "prefill-a"
    await asyncio.sleep(0)  # the send's done callback
    assert beating.in_flight == []
    clock.advance(INTERVAL)
    assert await recorder.take(2) == ["prefill-a HB:req-1", "prefill-b HB:req-2"]


class RecordingTransfer(NoTransfer):
    """Records what the engine asks of it; a pull waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(TransferConfig())
        self.calls: list[tuple[str, str | None]] = []
        self.pulling = asyncio.Event()
        self.finish_pull = asyncio.Event()

    def track(self, request_id: str, params: KvTransferParams) -> None:
        self.calls.append(("track", params.remote_request_id))

    def untrack(self, request_id: str) -> None:
        self.calls.append(("untrack", request_id))

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        self.calls.append(("pull", params.remote_request_id))
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
        finished = asyncio.Event()
        req.notify = finished.set
        engine.submit(req)
        await asyncio.wait_for(transfer.pulling.wait(), 2)
        assert transfer.calls == [("track", "req-1"), ("pull", "req-1")]  # still tracked while pulling

        transfer.finish_pull.set()
        await asyncio.wait_for(finished.wait(), 2)
        assert req.finished
        assert transfer.calls == [("track", "req-1"), ("pull", "req-1"), ("untrack", "d-1")]
    finally:
        await engine.stop()


def test_the_engine_untracks_an_aborted_request_that_never_got_blocks() -> None:
    transfer = RecordingTransfer()
    engine = Engine(make_scheduler(), PROFILES["instant"], transfer=transfer)
    engine.submit(make_request("d-1", list(range(100)), kv=address("prefill-a", "req-1")))  # 25 blocks of 17
    assert engine.poll() is None  # it waits for blocks: no pull
    engine.abort("d-1")
    assert transfer.calls == [("track", "req-1"), ("untrack", "d-1")]


async def test_params_the_engine_cannot_parse_are_not_tracked_and_prefill_locally() -> None:
    transfer = RecordingTransfer()
    engine = Engine(make_scheduler(), PROFILES["instant"], transfer=transfer)
    await engine.start()
    try:
        req = make_request("d-1", list(range(8)), max_tokens=1, kv={**address("prefill-a", "req-1"), "remote_port": "x"})
        finished = asyncio.Event()
        req.notify = finished.set
        engine.submit(req)
        await asyncio.wait_for(finished.wait(), 2)
        assert (req.finished, req.pull_ok, transfer.calls) == (True, False, [("untrack", "d-1")])
    finally:
        await engine.stop()


# -- between two pods over NIXL -------------------------------------------------------------------


async def beats_received(prefill: Any, count: int) -> None:
    """Wait until the prefill pod has taken in ``count`` heartbeats (real NIXL notifications)."""
    await eventually(lambda: sample(prefill.metrics.heartbeats_received) == count)


async def beats_landed(prefill: Any, decode: Any, count: int) -> None:
    """Wait until the prefill pod has taken in ``count`` heartbeats and the decode pod's sends have
    returned: a round that starts while a send is still in flight skips that engine, so the clock
    may step only after this (a NIXL call took 0.43 s once under the whole suite's load)."""
    await beats_received(prefill, count)
    await eventually(lambda: sample(decode.metrics.heartbeats_sent["ok"]) == count and not decode.heartbeats.in_flight)


@needs_nixl
async def test_heartbeats_keep_a_pin_alive_past_its_timeout_until_the_done_notification(
        nixl_pods: Any, clock: FakeClock) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    params = pd_params(prefill, "req-1")
    decode.track("local-1", params)  # e.g. the decode request waits for free blocks

    for beat in range(1, 13):  # at 0, 0.125, …, 1.375 s
        await beats_landed(prefill, decode, beat)
        clock.advance(INTERVAL)
    await beats_landed(prefill, decode, 13)  # at 1.5 s = twice the pin timeout

    assert p_host.unpinned == []
    assert sample(prefill.metrics.leases_extended) == 10  # from 0.375 s on, now + 0.5 s is past the deadline
    assert prefill.exports.pins.deadline("req-1") == 2.0
    result = await decode.pull(params, [7], TOKENS)
    decode.untrack("local-1")
    assert result.ok
    await eventually(lambda: p_host.unpinned == ["req-1"])
    assert sample(prefill.metrics.released["notified"]) == 1
    assert sample(prefill.metrics.expired) == 0
    assert sample(decode.metrics.handshakes["ok"]) == 1  # the pull used the heartbeats' handshake


@needs_nixl
async def test_without_heartbeats_a_pin_expires_after_its_timeout(nixl_pods: Any, clock: FakeClock) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    pd_params(prefill, "req-1")

    clock.advance(PIN_S - INTERVAL)
    await asyncio.sleep(0)  # whatever the clock woke runs now
    assert p_host.unpinned == []
    clock.advance(INTERVAL)
    await eventually(lambda: p_host.unpinned == ["req-1"])

    assert sample(prefill.metrics.expired) == 1
    assert sample(prefill.metrics.heartbeats_received) == 0
    assert sample(decode.metrics.heartbeats_sent["ok"]) + sample(decode.metrics.heartbeats_sent["failed"]) == 0


@needs_nixl
async def test_a_heartbeat_in_a_batch_extends_what_it_names_and_ignores_unknown_ids(nixl_pods: Any) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    pd_params(prefill, "req-1", [3])
    pd_params(prefill, "req-2", [4])

    prefill.exports.on_notifications({"decode-agent": [b"HB:ghost,req-1,req-2", b"req-2:1", b"HB:"]})

    assert p_host.unpinned == ["req-2"]  # the done notification released; no heartbeat did
    assert sample(prefill.metrics.released["notified"]) == 1
    assert sample(prefill.metrics.heartbeats_received) == 2
    assert sample(prefill.metrics.late_notifications) == 0  # "HB:…" is not mistaken for "<id>:<tp>"
    assert "req-1" in prefill.exports.pins


@needs_nixl
async def test_a_heartbeat_moves_a_deadline_later_never_earlier(nixl_pods: Any, clock: FakeClock) -> None:
    prefill, _ = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    pd_params(prefill, "req-1")
    exported_deadline = prefill.exports.pins.deadline("req-1")

    prefill.exports.on_notifications({"decode-agent": [b"HB:req-1"]})  # now + 0.5 s is before the export's 0.75 s
    assert prefill.exports.pins.deadline("req-1") == exported_deadline == PIN_S
    clock.advance(0.375)
    prefill.exports.on_notifications({"decode-agent": [b"HB:req-1"]})

    assert prefill.exports.pins.deadline("req-1") == clock.now() + 2 * PIN_S / 3 == 0.875
    assert sample(prefill.metrics.leases_extended) == 1


@needs_nixl
async def test_once_untracked_no_more_heartbeats_are_sent_and_the_pin_expires(nixl_pods: Any, clock: FakeClock) -> None:
    prefill, p_host = await nixl_pods("prefill-a", pin_timeout_s=PIN_S)
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S)
    decode.track("local-1", pd_params(prefill, "req-1"))
    for beat in range(1, 5):  # at 0, 0.125, 0.25, 0.375 s
        await beats_landed(prefill, decode, beat)
        clock.advance(INTERVAL)
    await beats_landed(prefill, decode, 5)  # at 0.5 s: the lease now ends at 1.0 s
    assert sample(prefill.metrics.leases_extended) == 2

    decode.untrack("local-1")
    clock.advance(1.0 - clock.now() - INTERVAL)
    await asyncio.sleep(0)  # whatever the clock woke runs now
    assert p_host.unpinned == []
    clock.advance(INTERVAL)  # the last extension runs out
    await eventually(lambda: p_host.unpinned == ["req-1"])

    assert sample(prefill.metrics.expired) == 1
    assert sample(decode.metrics.heartbeats_sent["ok"]) == 5
    assert clock.sleepers == 0  # neither pod runs a timer: the heartbeat task waits on an event


@needs_nixl
async def test_a_heartbeat_to_an_unreachable_engine_is_counted_not_raised(nixl_pods: Any, clock: FakeClock) -> None:
    decode, _ = await nixl_pods("decode-a", pin_timeout_s=PIN_S, handshake_timeout=0.2)
    decode.track("local-1", KvTransferParams.from_wire(address("prefill-gone", "req-1",
                                                               port=decode.side_channel_port + 1)))

    await eventually(lambda: sample(decode.metrics.heartbeats_sent["failed"]) == 1 and not decode.heartbeats.in_flight)
    clock.advance(INTERVAL)
    await eventually(lambda: sample(decode.metrics.heartbeats_sent["failed"]) == 2)

    assert sample(decode.metrics.heartbeats_sent["ok"]) == 0
    assert sample(decode.metrics.handshakes["failed"]) == 2
    assert decode.tracked == {"prefill-gone": ["req-1"]}  # it goes on trying until untracked
