"""The same seed gives the same picks: sequences pinned from the router before its fast paths.

Each sequence is 40 requests (four prompt groups, three in flight) on six pods, three of them
scraped with uneven load: every pick, tie-break and fallback order is recorded as the last
octets of ``targets`` (``>N``: the prefill pod). The sequences were recorded with the router
that seeded a new ``random.Random`` per decision, rebuilt its snapshot on every request and
hashed every prompt; they must not change when the router gets cheaper. The ``default``
profile's sequences were re-recorded when it became the estimated-TTFT profile (issue 10).
"""

from __future__ import annotations

import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.router import EngineMetrics, Router, SchedulingRequest, load_config

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
    "762 524 624 426 726 526 625 427 724 524 624 427 724 524 627 427 724 524 627 425 "
    "725 526 625 426 725 526 624 425 725 527 625 427 725 526 625 425 725 527 624 426"
)
DEFAULT = (
    "762 524 627 742 245 542 652 725 274 546 624 742 274 524 627 726 274 542 675 725 "
    "725 526 652 764 725 562 642 756 725 527 654 724 725 567 654 745 725 576 647 746"
)
DEFAULT_PD = (
    "762 524 627>3 674>2 726 567 657 627 724 546 624 647 742 524 627 627 724 542 675 625 "
    "752 526 652 647 752 562 642 652 756 527 654 672 754 567 654 645 756 576 647 645"
)
EXPECTED = {
    ("round-robin", False): (
        "234 345 456 567 672 723 234 345 456 567 672 723 234 345 456 567 672 723 234 345 "
        "456 567 672 723 234 345 456 567 672 723 234 345 456 567 672 723 234 345 456 567"
    ),
    ("least-load", False): (
        "762 524 624 423 723 253 563 643 743 423 253 563 763 463 623 253 753 453 563 263 "
        "763 643 543 423 723 623 253 543 743 463 623 253 753 543 463 263 673 753 453 523"
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
        result = router.schedule(request)
        octets = "".join(t.host.rsplit(".", 1)[1] for t in result.targets)
        picks.append(octets + (f">{result.prefill.host.rsplit('.', 1)[1]}" if result.prefill else ""))
        cached.append(result.cached_tokens)
        router.request_started(request, result)
        live.append((request, result))
        if len(live) > 3:
            router.request_finished(*live.pop(0), ok=True)
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
    compute = router.fingerprinter.fingerprints

    def counted(values, *args):  # type: ignore[no-untyped-def]
        fingerprinted.append(len(values) // 16)
        return compute(values, *args)

    router.fingerprinter.fingerprints = counted  # type: ignore[method-assign]
    request = SchedulingRequest("r", "m", list(range(512)))
    result = router.schedule(request)
    router.request_started(request, result)
    assert (result.cached_tokens, fingerprinted, len(router.approx)) == (0, [], 0)
    router.request_finished(request, result, ok=True)
    approx = router.schedule(SchedulingRequest("a", "m", list(range(512)), {"x-kvflow-profile": "prefix-approx"}))
    router.request_started(SchedulingRequest("a", "m", list(range(512))), approx)
    assert (fingerprinted, len(router.approx)) == ([32], 32)  # once: the decision's, learned from too


def test_started_and_finished_do_not_rebuild_the_snapshot() -> None:
    router = Router(load_config({"kvEvents": {"enabled": False}}), [Endpoint("127.0.0.2", 8000)], profile="round-robin")
    before = router.datastore.snapshot()
    request = SchedulingRequest("r", "m", [1] * 16)
    result = router.schedule(request)
    router.request_started(request, result)
    assert router.datastore.snapshot() is before and before[0].in_flight == 1
    router.request_finished(request, result, ok=True)
    assert before[0].in_flight == 0
    router.datastore.record_scrape(before[0].id, EngineMetrics(), 1.0)  # nothing scraped changed
    assert router.datastore.snapshot() is before
    router.datastore.record_scrape(before[0].id, EngineMetrics(waiting=3), 2.0)
    assert router.datastore.snapshot()[0].queue == 3


def test_max_score_picker_ranks_as_the_plain_sort_would() -> None:
    """The picker decodes tie-break draws lazily; the reference draws one per endpoint."""
    import heapq
    import random

    from kvflow.router.framework import Cycle
    from kvflow.router.fingerprint import Fingerprinter
    from kvflow.router.model import EndpointView
    from kvflow.router.plugins import PluginContext, build
    from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex

    views = [EndpointView(Endpoint(f"10.0.{i // 250}.{i % 250}", 8000)) for i in range(70)]
    gen = random.Random(5)
    request = SchedulingRequest("r", "m", [])
    for trial in range(400):
        k = gen.choice([1, 2, 3, 5])
        n = gen.randrange(1, 70)
        levels = [gen.random() * 3 for _ in range(gen.randrange(1, 5))]
        scores = [gen.choice(levels) + gen.choice([0.0, 0.0, 1e-12, -1e-12, 4e-10, 6e-10, 1e-7]) for _ in range(n)]
        scored = [(views[i], s) for i, s in enumerate(scores)]
        picker = build("p", "max-score-picker", {"maxTargets": k}, PluginContext(ApproxPrefixIndex(), PrefixIndex()))[1]
        cycle = Cycle(request, Fingerprinter(16).prompt([]), trial, 16)
        got = [v.id for v in picker.pick(cycle, scored)]
        ref_rng = random.Random(trial)
        keyed = [(round(s, 9), ref_rng.random(), i) for i, s in enumerate(scores)]
        assert got == [views[i].id for _, _, i in heapq.nlargest(k, keyed)]
        assert cycle.rng.random() == ref_rng.random()  # later draws (a P/D prefill run) unchanged
