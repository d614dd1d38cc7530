"""The engine loop in-process: real time, instant profile, no sockets."""

from __future__ import annotations

import asyncio

from kvflow.sim.engine import Engine
from kvflow.sim.kv_transfer import NoTransfer, TransferConfig
from kvflow.sim.profiles import PROFILES

from .helpers import make_request, make_scheduler


async def finish(engine: Engine, *reqs: object) -> None:
    events = []
    for req in reqs:
        event = asyncio.Event()
        req.notify = event.set  # type: ignore[attr-defined]
        events.append((req, event))
    for req, _ in events:
        engine.submit(req)  # type: ignore[arg-type]
    for req, event in events:
        while not req.finished:  # type: ignore[attr-defined]
            await asyncio.wait_for(event.wait(), 5)
            event.clear()


async def test_the_loop_runs_requests_to_completion_and_then_waits() -> None:
    engine = Engine(make_scheduler(), PROFILES["instant"], transfer=NoTransfer(TransferConfig()))
    await engine.start()
    try:
        a, b = make_request("a", [1, 2, 3], max_tokens=3), make_request("b", [4, 5], max_tokens=5)
        await finish(engine, a, b)
        assert (a.output_ids, b.output_ids) == ([1000, 1001, 1002], [1000, 1001, 1002, 1003, 1004])
        steps_before = engine.steps
        await asyncio.sleep(0.05)
        assert engine.steps == steps_before  # idle: the loop is parked on its event, not stepping
        c = make_request("c", [7], max_tokens=2)
        await finish(engine, c)
        assert c.finish_reason == "length"
    finally:
        await engine.stop()


async def test_time_to_first_token_follows_the_profile() -> None:
    profile = PROFILES["cpu-tiny"]
    engine = Engine(make_scheduler(), profile, transfer=NoTransfer(TransferConfig()))
    await engine.start()
    try:
        req = make_request("a", list(range(40)), max_tokens=2)
        req.arrival = asyncio.get_running_loop().time()
        await finish(engine, req)
        assert req.first_token_at is not None and req.scheduled_at is not None
        # a lower bound: a step never ends before its modelled time
        assert req.first_token_at - req.scheduled_at >= profile.step_seconds(0, 0, 40)
    finally:
        await engine.stop()
