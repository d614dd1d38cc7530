"""Each plugin on hand-made snapshots: exact scores, filters and picks."""

from __future__ import annotations

from collections import Counter

import pytest

from kvflow.errors import RateLimitError
from kvflow.router.framework import Cycle, min_max_inverse
from kvflow.router.fingerprint import Fingerprinter
from kvflow.router.model import EndpointView, EngineMetrics, SchedulingRequest
from kvflow.router.plugins import PluginContext, build
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex
from kvflow.endpoints import Endpoint, Role

CTX = PluginContext(ApproxPrefixIndex(), PrefixIndex())


def view(
    n: int,
    role: Role = Role.BOTH,
    models: frozenset[str] = frozenset(),
    healthy: bool = True,
    in_flight: int = 0,
    dispatched: int = 0,
    **metrics: object,
) -> EndpointView:
    return EndpointView(
        Endpoint(f"127.0.0.{n}", 8000, role=role, models=models),
        EngineMetrics(**metrics),  # type: ignore[arg-type]
        healthy,
        in_flight,
        dispatched,
    )


def cycle(
    tokens: int = 64, *, lora: str | None = None, headers: dict[str, str] | None = None, model: str = "m",
    priority: int = 0,
) -> Cycle:
    request = SchedulingRequest("r", model, list(range(tokens)), headers or {}, lora, priority=priority)
    return Cycle(request, Fingerprinter(16).prompt(request.token_ids), 0, 16)


def plugin(type_name: str, **params: object):  # type: ignore[no-untyped-def]
    return build(type_name, type_name, params, CTX)[1]


def ids(views) -> list[str]:  # type: ignore[no-untyped-def]
    return [v.id.split(":")[0].rsplit(".", 1)[1] for v in views]


def test_min_max_inverse() -> None:
    assert min_max_inverse({"a": 0.0, "b": 5.0, "c": 10.0}) == {"a": 1.0, "b": 0.5, "c": 0.0}  # type: ignore[dict-item]
    assert min_max_inverse({"a": 3.0, "b": 3.0}) == {"a": 1.0, "b": 1.0}  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("type_name", "params", "views", "kw", "kept"),
    [
        ("healthy-filter", {}, [view(2), view(3, healthy=False)], {}, ["2"]),
        ("role-filter", {"role": "decode"}, [view(2, Role.PREFILL), view(3, Role.DECODE), view(4)], {}, ["3", "4"]),
        ("role-filter", {"role": "prefill"}, [view(2, Role.PREFILL), view(3, Role.DECODE), view(4)], {}, ["2", "4"]),
        (
            "model-filter",
            {},
            [view(2, models=frozenset({"m"})), view(3, models=frozenset({"x"})), view(4)],
            {},
            ["2", "4"],
        ),
        ("model-filter", {}, [view(2, models=frozenset({"m", "ad"})), view(3)], {"lora": "ad"}, ["2"]),
        ("model-filter", {}, [view(2), view(3)], {"lora": "unlisted"}, ["2", "3"]),
        (
            "saturation-filter",
            {"queueLimit": 4},
            [view(2, waiting=5), view(3, waiting=4), view(4, dispatched=5)],
            {},
            ["3"],
        ),
        (
            "saturation-filter",
            {"kvCacheLimit": 0.9},
            [view(2, kv_usage=0.95), view(3, kv_usage=0.5)],
            {"priority": -1},
            ["3"],
        ),
    ],
    ids=["healthy", "role-decode", "role-prefill", "model", "lora-listed", "lora-unlisted", "queue-limit", "kv-limit"],
)
def test_filters(type_name, params, views, kw, kept) -> None:  # type: ignore[no-untyped-def]
    assert ids(plugin(type_name, **params).filter(cycle(**kw), views)) == kept


def test_the_static_filters_answer_the_same_list_once_and_a_new_list_anew() -> None:
    # the model and health filters remember their answer for the pool's list of views, which is
    # replaced (never changed in place) when a scrape or the pod set changes
    models, health = plugin("model-filter"), plugin("healthy-filter")
    before = [view(2, models=frozenset({"m"})), view(3, models=frozenset({"x"}))]
    assert ids(models.filter(cycle(model="m"), before)) == ["2"]
    assert ids(models.filter(cycle(model="x"), before)) == ["3"]
    assert models.filter(cycle(model="m"), before) is models.filter(cycle(model="m"), before)
    after = [view(2, models=frozenset({"x"})), view(3, models=frozenset({"x"}))]  # pod 2 now serves x
    assert ids(models.filter(cycle(model="m"), after)) == []
    assert ids(models.filter(cycle(model="x"), after)) == ["2", "3"]
    assert health.filter(cycle(), before) is before  # all healthy: the list itself
    assert ids(health.filter(cycle(), [view(2), view(3, healthy=False)])) == ["2"]


def test_saturation_sheds_a_sheddable_request_when_every_pod_is_over() -> None:
    with pytest.raises(RateLimitError) as info:
        plugin("saturation-filter", queueLimit=1, retryAfterSeconds=2).filter(cycle(priority=-1), [view(2, waiting=3)])
    assert info.value.status == 429 and info.value.headers() == {"Retry-After": "2"}


def test_a_full_kv_cache_moves_only_a_sheddable_request() -> None:
    # a pod's cache fills with what it runs, the homes of the busiest prefixes first: a request
    # that may not be shed waits there (the TTFT scorer prices its queue) rather than computing
    # its prefix again elsewhere; a sheddable one goes where there is room, and is shed when none is
    sat = plugin("saturation-filter")
    pods = [view(2, kv_usage=0.995), view(3, kv_usage=0.5)]
    assert ids(sat.filter(cycle(), pods)) == ["2", "3"]
    assert ids(sat.filter(cycle(priority=-1), pods)) == ["3"]
    with pytest.raises(RateLimitError):
        sat.filter(cycle(priority=-1), pods[:1])
    assert ids(plugin("saturation-filter", queueLimit=1).filter(cycle(), [view(2, waiting=3), view(3)])) == ["3"]


def test_a_saturated_pool_still_takes_requests_that_may_not_be_shed() -> None:
    # as the Inference Extension's saturation detector: priority 0 and above queue on a pod
    saturated = [view(2, waiting=3), view(3, waiting=5)]
    sat = plugin("saturation-filter", queueLimit=1)
    assert ids(sat.filter(cycle(), saturated)) == ["2", "3"]
    assert ids(sat.filter(cycle(priority=5), saturated)) == ["2", "3"]
    assert ids(sat.filter(cycle(priority=-1), [*saturated, view(4)])) == ["4"]  # room somewhere: no shedding


@pytest.mark.parametrize(
    ("type_name", "views", "kw", "expected"),
    [
        (
            "queue-scorer",
            [view(2, waiting=0), view(3, waiting=2, dispatched=2), view(4, waiting=4)],
            {},
            {"2": 1.0, "3": 0.0, "4": 0.0},
        ),
        ("running-requests-scorer", [view(2, running=1), view(3, running=3)], {}, {"2": 1.0, "3": 0.0}),
        (
            "active-request-scorer",
            [view(2, in_flight=4), view(3, in_flight=2), view(4)],
            {},
            {"2": 0.0, "3": 0.5, "4": 1.0},
        ),
        ("kv-cache-utilization-scorer", [view(2, kv_usage=0.25), view(3, kv_usage=1.0)], {}, {"2": 0.75, "3": 0.0}),
        (
            "lora-affinity-scorer",
            [
                view(2, running_loras=frozenset({"ad"}), max_loras=1),
                view(3, running_loras=frozenset({"x"}), max_loras=2),
                view(4, running_loras=frozenset({"x"}), max_loras=1),
            ],
            {"lora": "ad"},
            {"2": 1.0, "3": 0.8, "4": 0.0},
        ),
        ("lora-affinity-scorer", [view(2), view(3)], {}, {}),  # no adapter: every pod alike, it abstains
    ],
    ids=["queue", "running", "active", "kv-cache", "lora", "no-lora-abstains"],
)
def test_scorers(type_name, views, kw, expected) -> None:  # type: ignore[no-untyped-def]
    got = plugin(type_name).score(cycle(**kw), views)
    assert {k.split(":")[0].rsplit(".", 1)[1]: v for k, v in got.items()} == expected


@pytest.mark.parametrize("kind", ["approx", "precise"])
def test_prefix_scorers_share_of_blocks(kind: str) -> None:
    c = cycle(64)  # 4 blocks
    approx, precise = ApproxPrefixIndex(), PrefixIndex()
    index = approx if kind == "approx" else precise
    hashes = c.hashes.all()
    index.add(view(2).id, hashes[:3])
    index.add(view(3).id, hashes)
    type_name = "prefix-cache-scorer" if kind == "approx" else "precise-prefix-cache-scorer"
    scorer = build("p", type_name, {}, PluginContext(approx, precise))[1]
    got = scorer.score(c, [view(2), view(3), view(4)])
    assert list(got.values()) == [0.75, 1.0, 0.0]
    assert c.data[f"prefix:{kind}"] == {view(2).id: 3, view(3).id: 4}


def test_session_affinity_remembers_the_pick() -> None:
    from kvflow.router.model import SchedulingResult

    scorer = plugin("session-affinity-scorer", header="X-Session")
    c = cycle(headers={"x-session": "s1"})
    assert scorer.score(c, [view(2), view(3)]) == {}  # a new session: every pod alike, it abstains
    scorer.request_started(c.request, SchedulingResult("p", (view(3).endpoint,), None, 0))
    assert list(scorer.score(c, [view(2), view(3)]).values()) == [0.0, 1.0]


def test_max_score_orders_and_breaks_ties_deterministically() -> None:
    picker = plugin("max-score-picker", maxTargets=2)
    scored = [(view(2), 1.0), (view(3), 3.0), (view(4), 3.0), (view(5), 0.5)]
    first = ids(picker.pick(cycle(), scored))
    assert sorted(first) == ["3", "4"] and ids(picker.pick(cycle(), scored)) == first


def test_max_score_breaks_ties_evenly_over_seeds() -> None:
    picker = plugin("max-score-picker", maxTargets=1)
    scored = [(view(i), 1.0) for i in range(2, 6)]
    base = cycle()
    wins = Counter(ids(picker.pick(Cycle(base.request, base.hashes, seed, 16), scored))[0] for seed in range(4000))
    assert sorted(wins) == ["2", "3", "4", "5"] and all(850 < n < 1150 for n in wins.values())


def test_weighted_random_never_picks_zero_before_positive() -> None:
    picker = plugin("weighted-random-picker", maxTargets=3)
    for seed in range(20):
        c = cycle()
        c.rng.seed(seed)
        assert ids(picker.pick(c, [(view(2), 0.0), (view(3), 1.0), (view(4), 2.0)]))[2] == "2"


def test_round_robin_cycles() -> None:
    picker = plugin("round-robin-picker", maxTargets=1)
    scored = [(view(3), 9.0), (view(2), 0.0)]
    assert [ids(picker.pick(cycle(), scored))[0] for _ in range(4)] == ["2", "3", "2", "3"]


def test_precise_scorer_keeps_an_evicted_prefix_at_home() -> None:
    c = cycle(64)  # 4 blocks
    approx, precise = ApproxPrefixIndex(), PrefixIndex()
    hashes = c.hashes.all()
    approx.add(view(2).id, hashes)  # the router sent this prefix to .2 ...
    precise.add(view(3).id, hashes[:1])  # ... but the pods' events say only .3 holds a block of it
    heard = {view(2).id, view(3).id}
    scorer = build(
        "p", "precise-prefix-cache-scorer", {"homeWeight": 0.5}, PluginContext(approx, precise, None, heard)
    )[1]
    assert list(scorer.score(c, [view(2), view(3), view(4)]).values()) == [0.5, 0.25, 0.0]
    assert c.data["prefix:precise"] == {view(3).id: 1}  # what P/D and cached_tokens believe stays exact


def test_a_profile_clamps_scores_counts_missing_endpoints_as_zero_and_skips_abstainers() -> None:
    from kvflow.router.framework import Profile

    class Fixed:
        def __init__(self, name: str, scores: dict[str, float]) -> None:
            self.name, self.scores = name, scores

        def score(self, cycle, endpoints):  # type: ignore[no-untyped-def]
            return {ep.id: self.scores[ep.id.split(":")[0].rsplit(".", 1)[1]] for ep in endpoints
                    if ep.id.split(":")[0].rsplit(".", 1)[1] in self.scores}

    wild = Fixed("wild", {"2": 7.0, "3": -3.0})  # out of range, and nothing for pod 4
    silent = Fixed("silent", {})  # abstains
    profile = Profile("p", (), ((wild, 2.0), (silent, 5.0)), plugin("max-score-picker", maxTargets=3))
    run = profile.run(cycle(), [view(2), view(3), view(4)])
    assert {k.split(":")[0].rsplit(".", 1)[1]: v for k, v in run.totals.items()} == {"2": 2.0, "3": 0.0, "4": 0.0}
    assert dict(run.scores[view(2).id]) == {"wild": 1.0} and ids(run.targets)[0] == "2"


def test_scores_in_endpoint_order_add_up_as_the_same_scores_by_id() -> None:
    from kvflow.router.framework import Profile, Scores

    class ByOrder:
        def __init__(self, name: str, values: list[float], by_id: bool) -> None:
            self.name, self.values, self.by_id = name, values, by_id

        def score(self, cycle, endpoints):  # type: ignore[no-untyped-def]
            if self.by_id:
                return {ep.id: v for ep, v in zip(endpoints, self.values)}
            return Scores(endpoints, list(self.values))

    views = [view(2), view(3), view(4)]
    runs = []
    for by_id in (True, False):
        scorers = ((ByOrder("a", [0.25, 1.5, -1.0], by_id), 4.0), (ByOrder("b", [0.5, 0.0, 1.0], by_id), 1.0))
        runs.append(Profile("p", (), scorers, plugin("max-score-picker", maxTargets=3)).run(cycle(), views))
    by_id, aligned = runs
    assert dict(aligned.totals) == dict(by_id.totals) == {views[0].id: 1.5, views[1].id: 4.0, views[2].id: 1.0}
    assert ids(aligned.targets) == ids(by_id.targets) == ["3", "2", "4"]
    assert dict(aligned.scores[views[1].id]) == {"a": 1.0, "b": 0.0}  # read back by id, clamped
    scores = Scores(views, [0.1, 0.2, 0.3])
    assert scores[views[2].id] == 0.3 and list(scores) == [v.id for v in views] and len(scores) == 3


def test_aligned_scores_for_other_endpoints_are_read_by_id() -> None:
    """A scorer that answers for endpoints other than the ones it was given (a copy, a subset)
    is read by id: only the endpoints it names score."""
    from kvflow.router.framework import Profile, Scores

    class Subset:
        name = "subset"

        def score(self, cycle, endpoints):  # type: ignore[no-untyped-def]
            return Scores(endpoints[1:], [1.0] * (len(endpoints) - 1))

    views = [view(2), view(3), view(4)]
    run = Profile("p", (), ((Subset(), 1.0),), plugin("max-score-picker", maxTargets=3)).run(cycle(), views)
    assert dict(run.totals) == {views[0].id: 0.0, views[1].id: 1.0, views[2].id: 1.0}
