"""A request's load follows the pod that serves it: attempts, failovers, P/D legs, first tokens."""

from __future__ import annotations

from kvflow.endpoints import Endpoint, Role
from kvflow.router import Router, SchedulingRequest, load_config
from kvflow.router.flight import SPEED_STEP, SPEED_WEIGHT

A, B, C = (Endpoint(f"127.0.0.{i}", 8000) for i in (2, 3, 4))
P = Endpoint("127.0.0.9", 8000, role=Role.PREFILL)
PROMPT = list(range(1000, 1512))  # 32 blocks of 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_for(*pods: Endpoint, profile: str = "prefix-approx") -> tuple[Router, Clock]:
    clock = Clock()
    config = load_config({"kvEvents": {"enabled": False}, "prefillTokensPerSecond": 1000})
    return Router(config, list(pods), profile=profile, clock=clock), clock


def load(router: Router) -> dict[str, tuple[int, int, int]]:
    """(in flight, prefilling, prompt tokens) per pod."""
    out = {}
    for ep in router.endpoints:
        c = router.datastore.counter(ep.id)
        assert c is not None
        out[ep.host.rsplit(".", 1)[1]] = (c.in_flight, c.prefilling, c.tokens)
    return out


def test_a_failover_moves_the_load_and_the_prefix_to_the_pod_that_served() -> None:
    router, _ = router_for(A, B, C)
    request = SchedulingRequest("r", "m", PROMPT)
    with router.decide(request) as flight:
        first, second = flight.result.targets[0], flight.result.targets[1]
        flight.send(first)
        assert load(router)[first.host[-1]] == (1, 1, 512)
        flight.failed(first)
        flight.send(second)
        assert load(router)[first.host[-1]] == (0, 0, 0)
        assert load(router)[second.host[-1]] == (1, 1, 512)
        flight.first_token()
        assert load(router)[second.host[-1]] == (1, 0, 512)
    assert all(v == (0, 0, 0) for v in load(router).values())
    assert flight.served == second
    # the approximate index learned the prefix where it was computed, not where the attempt failed
    matches = router.approx.match(router.fingerprinter.prompt(PROMPT))
    assert matches == {second.id: 32}


def test_every_attempt_failing_leaves_nothing_anywhere() -> None:
    router, _ = router_for(A, B)
    request = SchedulingRequest("r", "m", PROMPT)
    with router.decide(request) as flight:
        for target in flight.result.targets:
            flight.send(target)
            flight.failed(target)
    assert all(v == (0, 0, 0) for v in load(router).values())
    assert flight.served is None and len(router.approx) == 0


def test_finish_releases_whatever_is_held_even_when_the_caller_raises() -> None:
    router, _ = router_for(A)
    request = SchedulingRequest("r", "m", PROMPT)
    try:
        with router.decide(request) as flight:
            flight.send(A)
            raise RuntimeError("the upstream read blew up")
    except RuntimeError:
        pass
    assert load(router) == {"2": (0, 0, 0)}
    flight.finish()  # idempotent
    assert load(router) == {"2": (0, 0, 0)}


def test_pd_prefill_leg_carries_the_prompt_work_and_decode_only_its_kv() -> None:
    router, _ = router_for(A, P, profile="default")
    request = SchedulingRequest("r", "m", PROMPT)
    with router.decide(request) as flight:
        assert flight.result.prefill == P
        flight.send_prefill(P)
        assert load(router)["9"] == (1, 1, 512)
        assert router.datastore.counter(P.id).queued(100.0) == 512  # type: ignore[union-attr]
        flight.prefill_done(ok=True)
        flight.send(A)
        assert load(router) == {"2": (1, 1, 512), "9": (0, 0, 0)}
        assert router.datastore.counter(A.id).queued(100.0) == 0  # type: ignore[union-attr]


def test_pd_prefill_failure_puts_the_prompt_work_on_the_decode_pod() -> None:
    router, _ = router_for(A, P, profile="default")
    request = SchedulingRequest("r", "m", PROMPT)
    with router.decide(request) as flight:
        flight.send_prefill(P)
        flight.prefill_done(ok=False)
        flight.send(A)
        assert router.datastore.counter(A.id).queued(100.0) == 512  # type: ignore[union-attr]
        assert router.datastore.counter(P.id).queued(100.0) == 0  # type: ignore[union-attr]


def test_first_tokens_teach_the_router_each_pods_prefill_speed() -> None:
    router, clock = router_for(A)
    for i in range(3):  # three prompts nothing is cached of
        request = SchedulingRequest(f"r{i}", "m", [t + 10_000 * i for t in PROMPT])
        with router.decide(request) as flight:
            flight.send(A)
            clock.now += 0.768  # 512 uncached tokens + the 256-token step, at 1 ms a token
            flight.first_token()
    counter = router.datastore.counter(A.id)
    assert counter is not None and abs(counter.seconds_per_token - 0.001) < 1e-9


def _observe_first_tokens(router: Router, clock: Clock, seconds: list[float], start: int = 0) -> float:
    """Send uncached prompts to A one after another, each answering after ``seconds``; A's speed."""
    for i, s in enumerate(seconds, start):
        request = SchedulingRequest(f"r{i}", "m", [t + 10_000 * i for t in PROMPT])
        with router.decide(request) as flight:
            flight.send(A)
            clock.now += s
            flight.first_token()
    counter = router.datastore.counter(A.id)
    assert counter is not None
    return counter.seconds_per_token


def test_one_first_token_far_later_than_estimated_does_not_mark_the_pod_ten_times_slower() -> None:
    router, clock = router_for(A)
    assert abs(_observe_first_tokens(router, clock, [0.768] * 3) - 0.001) < 1e-9  # 1 ms a token
    # the work was misjudged (say a prefix it was to reuse was computed again): 10x the estimate
    speed = _observe_first_tokens(router, clock, [7.68], start=3)
    assert abs(speed - 0.001 * (1 + SPEED_WEIGHT * (SPEED_STEP - 1))) < 1e-9
    assert speed < 0.002  # unclipped, the average would have gone to 2.8 ms a token


def test_a_pod_that_really_is_slower_is_still_learned_over_a_few_requests() -> None:
    router, clock = router_for(A)
    _observe_first_tokens(router, clock, [0.768] * 3)
    speed = _observe_first_tokens(router, clock, [7.68] * 25, start=3)  # now 10 ms a token, every time
    assert 0.009 < speed <= 0.01


def test_non_streamed_requests_are_not_mistaken_for_time_to_first_token() -> None:
    router, clock = router_for(A)
    request = SchedulingRequest("r", "m", PROMPT)
    with router.decide(request) as flight:
        flight.send(A)
        clock.now += 30.0  # the whole answer came back at once
        flight.first_token(observe=False)
    assert router.datastore.counter(A.id).seconds_per_token == 0.0  # type: ignore[union-attr]
