"""The batch band of flow control: batch lines take only the capacity interactive traffic leaves."""

from __future__ import annotations

import pytest

from kvflow.gateway.flow import BandLimits, InteractiveWatch, PodLoad, batch_room

LIMITS = BandLimits(per_pod=100, busy_per_pod=4, max_waiting=0, max_kv_usage=0.85, quiet_s=1.0)
IDLE = PodLoad(waiting=0, kv_usage=0.1)


@pytest.mark.parametrize(("pods", "inflight", "interactive", "waiting", "room"), [
    ([IDLE, IDLE], 0, False, 0, 200),
    ([IDLE, IDLE], 150, False, 0, 50),
    ([IDLE, IDLE], 250, False, 0, 0),
    ([IDLE, IDLE], 0, True, 0, 8),
    ([IDLE, IDLE], 6, True, 0, 2),
    ([IDLE, IDLE], 50, True, 0, 0),
    ([IDLE, IDLE], 0, False, 1, 0),
    ([IDLE, PodLoad(waiting=3, kv_usage=0.1)], 0, False, 0, 100),
    ([IDLE, PodLoad(waiting=0, kv_usage=0.9)], 0, False, 0, 100),
    ([IDLE, PodLoad(waiting=0, kv_usage=0.1, healthy=False)], 0, False, 0, 100),
    ([], 0, False, 0, 0),
], ids=["idle", "partly-used", "over-share", "interactive", "interactive-partly-used", "interactive-over-share",
        "gate-queue", "pod-queueing", "pod-kv-full", "pod-unhealthy", "no-pods"])
def test_room_for_batch_lines(pods: list[PodLoad], inflight: int, interactive: bool, waiting: int, room: int) -> None:
    assert batch_room(pods, inflight, LIMITS, interactive=interactive, interactive_waiting=waiting) == room


def test_interactive_traffic_counts_as_around_for_quiet_seconds_after_it_was_seen() -> None:
    watch = InteractiveWatch(quiet_s=1.0)
    assert not watch.around(0, now=10.0)
    assert watch.around(2, now=10.0)
    assert watch.around(0, now=10.9)
    assert not watch.around(0, now=11.0)
