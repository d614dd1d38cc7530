"""The same seed gives the same picks: sequences pinned from the router before its fast paths.

Each sequence is 40 requests (four prompt groups, three in flight) on six pods, three of them
scraped with uneven load: every pick, tie-break and fallback order is recorded as the last
octets of ``targets`` (``>N``: the prefill pod). The sequences were recorded with the router
that seeded a new ``random.Random`` per decision, rebuilt its snapshot on every request and
hashed every prompt; they must not change when the router gets cheaper. The ``default``
profile's sequences were re-recorded when it became the estimated-TTFT profile (issue 10), and
the max-score picker's when its tie-breaks became draws computed from the seed (SplitMix64)
instead of a Mersenne Twister seeded per decision.
"""

from __future__ import annotations

import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.router import EngineMetrics, Flight, Router, SchedulingRequest, load_config

CONFIG = {
    "kvEvents": {"enabled": False},
    "seed": 7,
    "plugins": [{"name": "wr", "type": "weighted-random-picker"}],
    "schedulingProfiles": [
        {
            "name": "weighted",
            "plugins": [{"pluginRef": "model-filter"}, {"pluginRef": "queue", "weight": 1}, {"pluginRef": "wr"}],
        }
    ],
}

PREFIX = (
    "725 245 645 542 746 245 642 546 745 247 642 546 745 246 647 546 745 245 647 542 746 247 "
    "645 546 746 245 645 547 745 245 645 547 746 246 645 542 746 246 647 546"
)
DEFAULT = (
    "725 245 645 547 742 274 624 567 752 247 627 567 754 264 647 562 745 245 674 542 762 247 "
    "652 546 764 254 654 576 756 245 657 547 765 265 652 524 762 265 647 546"
)
DEFAULT_PD = (
    "725 245 645>2 546>3 764 257 625 567 752 247 627 567 754 264 647 562 745 245 674 542 762 "
    "247 652 546 764 254 654 576 756 245 657 547 765 265 652 524 762 265 647 546"
)
EXPECTED = {
    ("round-robin", False): (
        "234 345 456 567 672 723 234 345 456 567 672 723 234 345 456 567 672 723 234 345 "
        "456 567 672 723 234 345 456 567 672 723 234 345 456 567 672 723 234 345 456 567"
    ),
    ("least-load", False): (
        "725 245 645 543 473 273 673 753 543 423 623 723 523 423 623 273 573 473 673 273 753 453 "
        "653 253 753 543 463 623 273 573 743 463 623 523 273 473 673 573 723 423"
    ),
    ("prefix-approx", False): PREFIX,
    ("prefix-precise", False): PREFIX,
    ("default", False): DEFAULT,
    ("weighted", False): (
        "524 672 724 245 542 463 672 724 527 247 645 475 574 726 623 423 524 276 764 642 "
        "542 423 273 673 754 543 245 462 675 752 256 546 462 673 275 574 475 674 726 527"
    ),
    ("default", True): DEFAULT_PD,
    ("round-robin", True): (
        "234 345 456>3 672>3 234 345 456 567>2 723 234 345>2 567 672 723 234>3 456>3 672 723 234 "
        "345>2 567 672 723>2 345 456 567 672>3 234>3 456 567 672 723>2 345 456 567>2 723 234 345 456 567"
    ),
}
CACHED = [0, 0, 0, 0] + [64, 208, 352, 496] * 9
"""Prompt tokens believed cached, for the profiles that match prefixes."""


def answered(flight: Flight) -> None:
    """The request's prefill leg (if any) and its pick answered, and it ended."""
    flight.prefill_done(ok=True)
    flight.first_token(observe=False)
    flight.finish()


def run(profile: str, pd: bool) -> tuple[str, list[int]]:
    pods = [Endpoint(f"127.0.0.{i}", 8000) for i in range(2, 8)]
    if pd:
        pods += [Endpoint(f"127.0.1.{i}", 8000, role=Role.PREFILL) for i in range(2, 4)]
    clock = iter(range(10**6))  # a fake clock: load estimates drain with time, identically each run
    router = Router(load_config(CONFIG), pods, profile=profile, clock=lambda: next(clock) * 0.001)
    for i, ep in enumerate(pods[:3]):
        router.datastore.record_scrape(ep.id, EngineMetrics(waiting=i % 2, kv_usage=0.25 * (i % 2)), 0.0)
    prompts = [list(range(100 * g, 100 * g + 16 * (4 + g * 9))) for g in range(4)]
    picks, cached, live = [], [], []
    for n in range(40):
        request = SchedulingRequest(f"r{n}", "m", prompts[n % 4] + [n] * 20)
        flight = router.decide(request)
        result = flight.result
        octets = "".join(t.host.rsplit(".", 1)[1] for t in result.targets)
        picks.append(octets + (f">{result.prefill.host.rsplit('.', 1)[1]}" if result.prefill else ""))
        cached.append(result.cached_tokens)
        flight.dispatch()
        live.append(flight)
        if len(live) > 3:
            answered(live.pop(0))
    return " ".join(picks), cached


@pytest.mark.parametrize(("profile", "pd"), list(EXPECTED), ids=[f"{p}{'-pd' if d else ''}" for p, d in EXPECTED])
def test_same_seed_same_picks_as_before(profile: str, pd: bool) -> None:
    picks, cached = run(profile, pd)
    assert picks == EXPECTED[profile, pd]
    if profile.startswith("prefix") or (profile, pd) == ("default", True):
        assert cached == CACHED


def test_profiles_without_prefix_scorers_never_hash_the_prompt() -> None:
    router = Router(load_config({"kvEvents": {"enabled": False}}), [Endpoint("127.0.0.2", 8000)], profile="least-load")
    fingerprinted: list[int] = []  # blocks fingerprinted, prompt by prompt
    compute = router.fingerprinter.prompt_array

    def counted(token_ids, *args):  # type: ignore[no-untyped-def]
        fingerprinted.append(len(token_ids) // 16)
        return compute(token_ids, *args)

    router.fingerprinter.prompt_array = counted  # type: ignore[method-assign]
    flight = router.decide(SchedulingRequest("r", "m", list(range(512))))
    flight.dispatch()
    assert (flight.result.cached_tokens, fingerprinted, len(router.approx)) == (0, [], 0)
    answered(flight)
    router.decide(SchedulingRequest("a", "m", list(range(512)), {"x-kvflow-profile": "prefix-approx"})).dispatch()
    assert (fingerprinted, len(router.approx)) == ([32], 32)  # once: the decision's, learned from too


def test_started_and_finished_do_not_rebuild_the_snapshot() -> None:
    router = Router(load_config({"kvEvents": {"enabled": False}}), [Endpoint("127.0.0.2", 8000)], profile="round-robin")
    before = router.datastore.snapshot()
    flight = router.decide(SchedulingRequest("r", "m", [1] * 16))
    flight.dispatch()
    assert router.datastore.snapshot() is before and before[0].in_flight == 1
    answered(flight)
    assert before[0].in_flight == 0
    router.datastore.record_scrape(before[0].id, EngineMetrics(), 1.0)  # nothing scraped changed
    assert router.datastore.snapshot() is before
    router.datastore.record_scrape(before[0].id, EngineMetrics(waiting=3), 2.0)
    assert router.datastore.snapshot()[0].queue == 3


def test_max_score_picker_ranks_as_the_plain_sort_would() -> None:
    """The picker ranks only the endpoints that can reach its top; the reference ranks them all
    by (score to 9 decimals, the cycle's tie-break draw, position)."""
    import heapq
    import random

    from kvflow.router.framework import Cycle, tie_break
    from kvflow.router.fingerprint import Fingerprinter
    from kvflow.router.model import EndpointView
    from kvflow.router.plugins import PluginContext, build
    from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex

    views = [EndpointView(Endpoint(f"10.0.{i // 250}.{i % 250}", 8000)) for i in range(300)]
    gen = random.Random(5)
    request = SchedulingRequest("r", "m", [])
    for trial in range(400):
        k = gen.choice([1, 2, 3, 5])
        n = gen.randrange(1, 70) if trial % 4 else gen.randrange(240, 300)  # small pools, and large ones
        levels = [gen.random() * 3 for _ in range(gen.randrange(1, 5))]
        scores = [gen.choice(levels) + gen.choice([0.0, 0.0, 1e-12, -1e-12, 4e-10, 6e-10, 1e-7]) for _ in range(n)]
        scored = [(views[i], s) for i, s in enumerate(scores)]
        picker = build("p", "max-score-picker", {"maxTargets": k}, PluginContext(ApproxPrefixIndex(), PrefixIndex()))[1]
        cycle = Cycle(request, Fingerprinter(16).prompt([]), trial, 16)
        got = [v.id for v in picker.pick(cycle, scored)]
        keyed = [(round(s, 9), tie_break(trial, i), i) for i, s in enumerate(scores)]
        assert got == [views[i].id for _, _, i in heapq.nlargest(k, keyed)]
        assert cycle.tie_breaks(1) == n  # a later picker in the cycle (a P/D prefill run) draws afresh
