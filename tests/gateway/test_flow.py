"""Admission, priorities, shedding and rate limits: pure decisions, driven with a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.errors import RateLimitError
from kvflow.gateway.flow import AdmissionQueue, Decision, Gate, Rate, RateLimiter, TokenBucket


def run_script(queue: AdmissionQueue[str], script: list[tuple[str, int, str]]) -> list[str]:
    """('admit', priority, name) or ('release', 0, '') steps; the outcome of each as text."""
    out = []
    for op, priority, name in script:
        if op == "admit":
            a = queue.admit(priority, name)
            out.append(a.decision.value + (f" displacing {a.displaced}" if a.displaced else ""))
        elif op == "cancel":
            queue.cancel(name)
            out.append("cancelled")
        else:
            out.append(f"wake {queue.release()}")
    return out


@pytest.mark.parametrize(("script", "expected"), [
    pytest.param([("admit", 0, "a"), ("admit", 0, "b")], ["admitted", "admitted"], id="under-the-limit"),
    pytest.param([("admit", 0, "a"), ("admit", 0, "b"), ("admit", 0, "c"), ("admit", 0, "d"), ("admit", 0, "e")],
                 ["admitted", "admitted", "queued", "queued", "shed"], id="full-queue-sheds"),
    pytest.param([("admit", 0, "a"), ("admit", 0, "b"), ("admit", 0, "c"), ("admit", 5, "d"),
                  ("release", 0, ""), ("release", 0, "")],
                 ["admitted", "admitted", "queued", "queued", "wake d", "wake c"], id="priority-first"),
    pytest.param([("admit", 0, "a"), ("admit", 0, "b"), ("admit", 1, "c"), ("admit", 0, "d"),
                  ("admit", 2, "e"), ("release", 0, ""), ("release", 0, "")],
                 ["admitted", "admitted", "queued", "queued", "queued displacing d", "wake e", "wake c"],
                 id="outranking-newcomer-displaces-lowest"),
    pytest.param([("admit", 0, "a"), ("admit", 0, "b"), ("admit", 0, "c"), ("admit", 0, "d"),
                  ("release", 0, ""), ("release", 0, "")],
                 ["admitted", "admitted", "queued", "queued", "wake c", "wake d"], id="fifo-within-a-priority"),
    pytest.param([("admit", 0, "a"), ("admit", 0, "b"), ("admit", 0, "c"), ("cancel", 0, "c"),
                  ("release", 0, ""), ("admit", 0, "d")],
                 ["admitted", "admitted", "queued", "cancelled", "wake None", "admitted"], id="cancelled-waiter"),
])
def test_admission(script, expected) -> None:  # type: ignore[no-untyped-def]
    queue: AdmissionQueue[str] = AdmissionQueue(max_inflight=2, max_queue=2)
    assert run_script(queue, script) == expected


def test_unlimited_queue_admits_everything() -> None:
    queue: AdmissionQueue[int] = AdmissionQueue(max_inflight=None, max_queue=0)
    assert {queue.admit(0, i).decision for i in range(1000)} == {Decision.ADMITTED}
    assert queue.inflight == 1000


@pytest.mark.parametrize(("rate", "burst", "times", "expected"), [
    (10.0, 2, [0.0, 0.0, 0.0], [0.0, 0.0, 0.1]),
    (10.0, 2, [0.0, 0.0, 0.05], [0.0, 0.0, 0.05]),
    (10.0, 2, [0.0, 0.0, 0.1, 0.1], [0.0, 0.0, 0.0, 0.1]),
    (1.0, 1, [0.0, 10.0, 10.0], [0.0, 0.0, 1.0]),  # saved tokens never exceed the burst
])
def test_token_bucket(rate, burst, times, expected) -> None:  # type: ignore[no-untyped-def]
    bucket = TokenBucket(rate, burst, now=0.0)
    assert [pytest.approx(bucket.take(t)) for t in times] == expected


def test_rate_limiter_per_key_with_default() -> None:
    now = [0.0]
    limiter = RateLimiter({"gold": Rate(100, 3)}, Rate(1, 1), clock=lambda: now[0])
    outcomes = []
    for key in ["gold", "gold", "gold", "gold", "free", "free"]:
        try:
            limiter.check(key)
            outcomes.append("ok")
        except RateLimitError as exc:
            outcomes.append(f"429 retry {exc.headers()['Retry-After']}")
    assert outcomes == ["ok", "ok", "ok", "429 retry 1", "ok", "429 retry 1"]


def test_no_limit_without_a_rate() -> None:
    limiter = RateLimiter({}, None)
    for _ in range(1000):
        limiter.check("anyone")


async def test_gate_wakes_waiters_in_priority_order_and_sheds_on_timeout() -> None:
    gate = Gate(max_inflight=1, max_queue=2, queue_timeout=0.2)
    order: list[str] = []
    await gate.acquire(0)

    async def wait(name: str, priority: int) -> None:
        await gate.acquire(priority)
        order.append(name)

    low, high = asyncio.ensure_future(wait("low", 0)), asyncio.ensure_future(wait("high", 9))
    await asyncio.sleep(0)
    with pytest.raises(RateLimitError):
        await gate.acquire(-1)  # the queue is full and -1 outranks nobody
    gate.release()
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(low, high)
    assert order == ["high", "low"]
    with pytest.raises(RateLimitError, match="waited 0.2s"):
        await gate.acquire(0)
    gate.release()
    assert (gate.queue.inflight, gate.queue.waiting) == (0, 0)


async def test_gate_passes_the_slot_on_when_a_waiter_is_cancelled() -> None:
    gate = Gate(max_inflight=1, max_queue=4, queue_timeout=5)
    await gate.acquire(0)
    gone = asyncio.ensure_future(gate.acquire(0))
    stays = asyncio.ensure_future(gate.acquire(0))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    gate.release()
    await asyncio.wait_for(stays, 1)
    assert (gate.queue.inflight, gate.queue.waiting) == (1, 0)


def test_a_client_with_a_backlog_does_not_starve_the_others() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_inflight=1, max_queue=10)
    outcomes = [queue.admit(0, w, client=w[0]).decision.value for w in ("a1", "a2", "a3", "a4", "b1", "c1", "b2")]
    assert outcomes == ["admitted"] + ["queued"] * 6
    woken = []
    for done in ("a1", "b1", "c1", "a2", "b2", "a3"):  # each release names who finished
        woken.append(queue.release(client=done[0]))
    assert woken == ["b1", "c1", "a2", "b2", "a3", "a4"]


def test_a_client_at_its_cap_waits_while_others_use_free_slots() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_inflight=3, max_queue=10, max_per_client=1)
    steps = [queue.admit(0, "a1", "a").decision, queue.admit(0, "a2", "a").decision, queue.admit(0, "b1", "b").decision]
    assert steps == [Decision.ADMITTED, Decision.QUEUED, Decision.ADMITTED]
    assert queue.release(client="b") is None  # b's slot frees nothing for a: a is at its cap
    assert queue.release(client="a") == "a2"
    assert (queue.inflight, queue.waiting) == (1, 0)


async def test_gate_per_client_cap_with_real_waiters() -> None:
    gate = Gate(max_inflight=4, max_queue=4, queue_timeout=5, max_per_client=1)
    await gate.acquire(0, "a")
    second = asyncio.ensure_future(gate.acquire(0, "a"))
    await gate.acquire(0, "b")  # not behind a's second request
    await asyncio.sleep(0)
    assert not second.done()
    gate.release("a")
    await asyncio.wait_for(second, 1)
    assert gate.queue.inflight == 2
