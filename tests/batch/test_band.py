"""The batch band of flow control: batch lines take only the capacity interactive traffic leaves."""

from __future__ import annotations

import pytest

from kvflow.gateway.flow import BandLimits, InteractiveWatch, PodLoad, batch_room, next_cap

LIMITS = BandLimits(per_pod=100, first_cap=16, idle_waiting=4, busy_per_pod=4, max_waiting=0, max_kv_usage=0.85)


def pod(in_flight: int = 0, cap: int = 20, waiting: int = 0, kv: float = 0.1, healthy: bool = True) -> PodLoad:
    return PodLoad(waiting=waiting, kv_usage=kv, in_flight=in_flight, cap=cap, healthy=healthy)


@pytest.mark.parametrize(("pods", "batch", "interactive", "gate_waiting", "room"), [
    ([pod(), pod()], 0, False, 0, 40),
    ([pod(in_flight=15), pod(in_flight=25)], 40, False, 0, 5),
    ([pod(), pod(kv=0.9)], 0, False, 0, 20),
    ([pod(), pod(healthy=False)], 0, False, 0, 20),
    ([pod(), pod()], 0, True, 0, 8),
    ([pod(), pod()], 6, True, 0, 2),
    ([pod(), pod()], 50, True, 0, 0),
    ([pod(), pod(waiting=1)], 0, True, 0, 4),
    ([pod(), pod()], 0, False, 1, 0),
    ([], 0, False, 0, 0),
], ids=["idle-pods-fill-to-their-caps", "some-in-flight", "kv-nearly-full", "unhealthy", "interactive-around",
        "interactive-partly-used", "interactive-over-share", "interactive-and-an-engine-queues", "gate-queue",
        "no-pods"])
def test_room_for_batch_lines(pods: list[PodLoad], batch: int, interactive: bool, gate_waiting: int,
                              room: int) -> None:
    assert batch_room(pods, batch, LIMITS, interactive=interactive, interactive_waiting=gate_waiting) == room


@pytest.mark.parametrize(("cap", "running", "waiting", "after"), [
    (16, 16, 0, 32),    # runs all it is given, queues nothing: slow start doubles the cap
    (64, 64, 0, 100),   # ... up to per_pod
    (32, 16, 16, 20),   # queues: full at 16 running, plus a queue of idle_waiting
    (20, 16, 3, 20),    # a short queue: as intended
    (32, 3, 0, 32),     # little work: nothing learnt
], ids=["grows", "bounded", "full", "steady", "idle"])
def test_a_pods_cap_follows_what_its_engine_runs(cap: int, running: int, waiting: int, after: int) -> None:
    assert next_cap(cap, running, waiting, LIMITS) == after


def test_interactive_traffic_counts_as_around_for_quiet_seconds_after_it_was_seen() -> None:
    watch = InteractiveWatch(quiet_s=1.0)
    assert not watch.around(0, now=10.0)
    assert watch.around(2, now=10.0)
    assert watch.around(0, now=10.9)
    assert not watch.around(0, now=11.0)
