"""The engine's timeline, on a fake clock: steps last their modelled time whenever they are polled.

Most tests drive ``Engine.poll()`` by hand: set the clock, poll, read what the engine did. A late
poll is the event loop being busy (a /metrics render, a burst of requests): it must delay
delivery only, never the simulated steps.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from kvflow.protocol.kv_transfer import KvTransferParams
from kvflow.sim.clock import FakeClock
from kvflow.sim.engine import Engine, default_max_lag
from kvflow.sim.kv_transfer import NoTransfer, PullResult, TransferConfig
from kvflow.sim.metrics import SimMetrics, cache_config_info
from kvflow.sim.profiles import PROFILES, Profile
from kvflow.sim.request import SimRequest

from .helpers import make_request, make_scheduler

H100 = PROFILES["h100-llama8b"]


def make_engine(profile: Profile = H100, *, metrics: bool = False, transfer: Any = None,
                **scheduler: Any) -> tuple[Engine, FakeClock]:
    clock = FakeClock()
    sim_metrics = None
    if metrics:
        info = cache_config_info(block_size=4, num_blocks=17, num_blocks_override=None, enable_prefix_caching=True,
                                 hash_algo="sha256", max_model_len=8192)
        sim_metrics = SimMetrics("m", max_model_len=8192, cache_info=info, runtime=False)
    engine = Engine(make_scheduler(**scheduler), profile, transfer=transfer or NoTransfer(TransferConfig()),
                    metrics=sim_metrics, clock=clock)
    if sim_metrics is not None:
        sim_metrics.bind(engine.gauges())
    return engine, clock


def run_on_time(engine: Engine, clock: FakeClock) -> None:
    """Poll at every deadline until the engine is idle: a loop that is never late."""
    while (deadline := engine.poll()) is not None:
        clock.set(max(clock.now(), deadline))


def prefill(n: int, profile: Profile = H100) -> float:
    return profile.step_seconds(0, 0, n)


def decode(ctx: int, profile: Profile = H100) -> float:
    return profile.step_seconds(1, ctx, 0)


def test_a_request_gets_its_first_token_one_prefill_step_after_arrival_and_the_rest_one_decode_step_apart() -> None:
    engine, clock = make_engine()
    clock.set(1.0)
    req = make_request("a", list(range(8)), max_tokens=3)
    engine.submit(req)
    run_on_time(engine, clock)
    t1 = 1.0 + prefill(8)
    t2 = t1 + decode(8)
    t3 = t2 + decode(9)
    assert (req.arrival, req.scheduled_at, req.first_token_at, req.finished_at) == (1.0, 1.0, t1, t3)
    assert (engine.steps, engine.now, engine.busy_seconds) == (3, t3, t3 - 1.0)


def test_a_late_poll_delays_delivery_but_not_the_next_step() -> None:
    engine, clock = make_engine()
    engine.submit(make_request("a", list(range(8)), max_tokens=3))
    t1 = engine.poll()
    assert t1 == prefill(8)
    clock.set(t1 + 0.015)  # the loop was busy for 15 ms past the step's end
    assert engine.poll() == t1 + decode(8)  # the next step began when the first ended
    assert engine.slipped_seconds == 0


def test_steps_missed_during_a_stall_are_replayed_one_per_poll_at_their_own_times() -> None:
    engine, clock = make_engine()
    req = make_request("a", list(range(8)), max_tokens=4)
    engine.submit(req)
    engine.poll()
    clock.set(0.030)  # four steps' worth of stall
    deadlines = [engine.poll() for _ in range(4)]
    t1 = prefill(8)
    t2 = t1 + decode(8)
    t3 = t2 + decode(9)
    t4 = t3 + decode(10)
    assert deadlines == [t2, t3, t4, None]
    assert (req.first_token_at, req.finished_at, len(req.output_ids)) == (t1, t4, 4)


def test_a_request_that_arrives_while_the_engine_catches_up_joins_the_first_step_that_starts_after_it() -> None:
    engine, clock = make_engine()
    a, b = make_request("a", list(range(8)), max_tokens=5), make_request("b", list(range(100, 108)), max_tokens=1)
    engine.submit(a)
    t1 = engine.poll()
    assert t1 is not None
    clock.set(t1 + 0.003)  # during the second step, in simulated time; the loop is still stalled
    engine.submit(b)
    clock.set(t1 + 0.020)
    t2 = engine.poll()  # completes step 1 and plans step 2, which started before b arrived
    assert t2 == t1 + decode(8) and b.scheduled_at is None
    engine.poll()  # completes step 2; step 3 starts at its end, after b's arrival
    assert b.scheduled_at == t2


def test_an_idle_engine_parks_and_its_next_step_starts_when_work_arrives() -> None:
    engine, clock = make_engine()
    engine.submit(make_request("a", [1, 2, 3], max_tokens=1))
    run_on_time(engine, clock)
    steps = engine.steps
    clock.set(5.0)
    assert engine.poll() is None and engine.steps == steps  # nothing to do: no step, no time
    clock.set(7.0)
    b = make_request("b", [4, 5, 6], max_tokens=1)
    engine.submit(b)
    clock.set(7.010)  # the loop noticed 10 ms later
    assert engine.poll() == 7.0 + prefill(3)  # the step began when b arrived
    assert b.scheduled_at == 7.0


def test_a_process_too_far_behind_slips_its_timeline_and_counts_the_slip() -> None:
    engine, clock = make_engine()
    assert engine.max_lag_s == default_max_lag(H100) == 0.096  # 16 steps of 6 ms
    engine.submit(make_request("a", list(range(8)), max_tokens=3))
    t1 = engine.poll()
    assert t1 is not None
    clock.set(t1 + 0.2)
    assert engine.poll() == t1 + 0.2 + decode(8)  # the next step starts now, not 200 ms ago
    assert math.isclose(engine.slipped_seconds, 0.2)


def test_a_negative_lag_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match="max lag must be a number of seconds >= 0, got -1"):
        Engine(make_scheduler(), H100, transfer=NoTransfer(TransferConfig()), max_lag_s=-1)


def test_the_instant_profile_keeps_no_timeline_its_steps_happen_when_polled() -> None:
    engine, clock = make_engine(PROFILES["instant"])
    assert engine.max_lag_s == 0
    req = make_request("a", [1, 2, 3], max_tokens=2)
    engine.submit(req)
    assert engine.poll() == 0.0
    clock.set(0.5)
    assert engine.poll() == 0.5  # the first step is done; the second starts when polled, not at 0.0
    assert (req.first_token_at, engine.slipped_seconds) == (0.0, 0.0)
    engine.poll()
    assert req.finished_at == 0.5


def replay(arrivals: list[tuple[float, SimRequest]], stall: Callable[[], float]) -> Engine:
    """Submit each request at its exact time; poll at every deadline plus ``stall()`` when the
    engine is on time (so the stalls never pile up beyond the engine's tolerance)."""
    engine, clock = make_engine(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32)
    pending = deque(arrivals)
    deadline = engine.poll()
    while pending or deadline is not None:
        poll_at = math.inf if deadline is None else max(deadline + stall(), clock.now())
        if pending and pending[0][0] <= poll_at:
            at, req = pending.popleft()
            clock.set(max(clock.now(), at))
            engine.submit(req)
            if deadline is None:
                deadline = engine.poll()
            continue
        clock.set(poll_at)
        deadline = engine.poll()
    return engine


def workload(seed: int) -> list[tuple[float, SimRequest]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(30):
        t += rng.expovariate(1 / 0.01)
        prompt = [rng.randrange(5000) for _ in range(rng.randrange(1, 60))]
        out.append((t, make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20))))
    return out


def test_the_timeline_is_the_same_however_late_the_loop_polls() -> None:
    rng = random.Random(7)
    calm, busy = workload(1), workload(1)
    on_time = replay(calm, lambda: 0.0)
    stalled = replay(busy, lambda: rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 0.09)]))

    def timeline(arrivals: list[tuple[float, SimRequest]]) -> list[tuple[Any, ...]]:
        return [(r.arrival, r.scheduled_at, r.first_token_at, r.finished_at, r.output_ids, r.num_preemptions)
                for _, r in arrivals]

    assert stalled.slipped_seconds == 0
    assert on_time.steps > 100 and on_time.scheduler.num_preemptions > 0  # a workload with some contention
    assert (stalled.steps, stalled.busy_seconds, stalled.now) == (on_time.steps, on_time.busy_seconds, on_time.now)
    assert timeline(busy) == timeline(calm)
    assert all(r.finished for _, r in busy)


def test_an_aborted_request_is_neither_delivered_nor_counted_as_finished() -> None:
    engine, clock = make_engine(metrics=True)
    delivered: list[int] = []
    req = make_request("a", list(range(8)), max_tokens=10)
    req.notify = lambda: delivered.append(len(req.output_ids))
    engine.submit(req)
    t1 = engine.poll()
    assert t1 is not None
    clock.set(t1)
    t2 = engine.poll()
    assert t2 is not None and delivered == [1]
    clock.set(t1 + 0.001)
    engine.abort("a")  # mid-step: the step still runs on the simulated GPU
    clock.set(t2)
    assert engine.poll() is None  # the abort took effect at the step's end; nothing else to do
    assert delivered == [1] and engine.scheduler.pool.usage == 0.0
    metrics = engine.metrics
    assert metrics is not None
    assert metrics.h_ttft.count == 1  # counted when its first token came, as vLLM does
    assert metrics.generation_tokens.value == 1  # the aborted step's token is not
    assert sum(c.value for c in metrics.request_success.values()) == 0
    assert metrics.h_e2e.count == 0


def test_the_engine_metrics_record_simulated_times() -> None:
    engine, clock = make_engine(metrics=True)
    engine.submit(make_request("a", list(range(8)), max_tokens=3))
    clock.set(0.002)
    engine.submit(make_request("b", list(range(20, 28)), max_tokens=1))
    run_on_time(engine, clock)
    metrics = engine.metrics
    assert metrics is not None
    t1 = prefill(8)
    t2 = t1 + H100.step_seconds(1, 8, 8)  # a decodes while b prefills
    t3 = t2 + decode(9)
    assert metrics.h_ttft.sum == t1 + (t2 - 0.002)
    assert (metrics.h_itl.count, metrics.h_itl.sum) == (2, (t2 - t1) + (t3 - t2))
    assert (metrics.h_e2e.count, metrics.h_e2e.sum) == (2, t3 + (t2 - 0.002))
    assert metrics.request_success["length"].value == 2


async def test_started_on_a_fake_clock_the_engine_runs_in_virtual_time_and_parks_when_idle() -> None:
    engine, clock = make_engine()
    await engine.start()
    try:
        a, b = make_request("a", list(range(8)), max_tokens=3), make_request("b", [4, 5], max_tokens=1)
        await finish(engine, a, b)
        t1 = prefill(10)  # a and b prefill together
        assert (a.first_token_at, b.finished_at) == (t1, t1)
        assert a.finished_at == t1 + decode(8) + decode(9)
        assert engine.poll() is None and engine.steps == 3
    finally:
        await engine.stop()


class HeldPull(NoTransfer):
    """A pull that succeeds when the test lets it."""

    def __init__(self) -> None:
        super().__init__(TransferConfig())
        self.finish = asyncio.Event()

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        await self.finish.wait()
        return PullResult(True, 0.5, 0)


async def test_a_kv_pull_that_ends_while_the_engine_waits_restarts_the_timeline_at_its_end() -> None:
    transfer = HeldPull()
    engine, clock = make_engine(transfer=transfer)
    await engine.start()
    try:
        req = make_request("d", list(range(8)), max_tokens=1, kv={"do_remote_prefill": True})
        done = asyncio.Event()
        req.notify = done.set
        engine.submit(req)
        clock.set(2.0)  # the pull takes two seconds of wall time
        transfer.finish.set()
        await done.wait()
        assert req.first_token_at == 2.0 + prefill(1)  # only the last prompt token is recomputed
    finally:
        await engine.stop()


async def finish(engine: Engine, *reqs: SimRequest) -> None:
    events = []
    for req in reqs:
        event = asyncio.Event()
        req.notify = event.set
        events.append((req, event))
        engine.submit(req)
    for req, event in events:
        while not req.finished:
            await event.wait()
            event.clear()


class RecordingPublisher:
    """Stands in for the ZMQ publisher: notes in ``log`` when a batch of KV events went out."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def start(self) -> None:
        pass

    def publish(self, events: list[Any], *, ts: float | None = None) -> None:
        self.log.append("kv events")

    async def close(self) -> None:
        pass


async def test_a_steps_tokens_are_written_before_its_kv_events_go_out_and_the_next_step_is_planned() -> None:
    # vLLM's engine core hands a step's outputs to its output thread and goes on scheduling: the
    # API server writes the first token while the next step is planned and the KV events of the
    # last one are published. A simulator that published and planned first made every first
    # token wait for it (the prompts' block hashing included).
    log: list[str] = []
    clock = FakeClock()
    scheduler = make_scheduler()
    planned = scheduler.schedule

    def schedule(now: float) -> Any:
        log.append("planned")
        return planned(now)

    scheduler.schedule = schedule  # type: ignore[method-assign]
    engine = Engine(scheduler, H100, transfer=NoTransfer(TransferConfig()), clock=clock,
                    publisher=RecordingPublisher(log))  # type: ignore[arg-type]
    await engine.start()
    try:
        req = make_request("a", list(range(8)), max_tokens=2)  # two blocks of 4, then two tokens
        woken = asyncio.Event()
        req.notify = woken.set

        async def handler() -> None:  # the request's handler: writes out each token it is woken for
            while not req.finished:
                await woken.wait()
                woken.clear()
                log.append("token written")

        task = asyncio.create_task(handler())
        engine.submit(req)
        await task
        assert log == ["planned", "token written", "kv events", "planned", "token written"]
    finally:
        await engine.stop()
