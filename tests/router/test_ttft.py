"""The estimated-TTFT scorer: cache against load, in one unit, on hand-made pods."""

from __future__ import annotations

import statistics

import numpy as np

from kvflow.endpoints import Endpoint
from kvflow.router.framework import Cycle
from kvflow.router.load import LoadBoard
from kvflow.router.model import EndpointView, EngineMetrics, LoadCounter, SchedulingRequest
from kvflow.router.plugins import PluginContext, build
from kvflow.router.plugins.ttft import pool_speed
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex

PROMPT = list(range(1000, 1512))  # 32 blocks of 16
STEP = 256


def pods(n: int) -> list[Endpoint]:
    return [Endpoint(f"127.0.0.{i + 2}", 8000) for i in range(n)]


def random_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64)


def run(
    cached: dict[int, int],
    *,
    queued: dict[int, int] | None = None,
    waiting: dict[int, int] | None = None,
    decoding: dict[int, int] | None = None,
    speed: dict[int, float] | None = None,
    n: int = 3,
    copy_weight: float = 0.0,
    evict_weight: float = 0.0,
    working_set: dict[int, int] | None = None,
    capacity: int | None = None,
) -> dict[int, float]:
    """Estimates (tokens of work, or seconds once speeds are known) per pod index."""
    eps = pods(n)
    precise = PrefixIndex()
    hashes = precise.fingerprinter.prompt(PROMPT).all()
    for i, blocks in cached.items():
        precise.add(eps[i].id, hashes[:blocks])
    ctx = PluginContext(ApproxPrefixIndex(), precise, None, {ep.id for ep in eps}, STEP)
    params = {"copyWeight": copy_weight, "evictWeight": evict_weight}
    scorer = build("ttft", "ttft-scorer", params, ctx)[1]
    views = []
    for i, ep in enumerate(eps):
        counter = LoadCounter(default_rate=1.0)  # a token a second; the clock stands still, nothing drains
        if queued and i in queued:
            counter.enqueue(queued[i], now=0.0)
        counter.in_flight = counter.prefilling = 1 if queued and i in queued else 0
        counter.in_flight += (decoding or {}).get(i, 0)
        counter.seconds_per_token = (speed or {}).get(i, 0.0)
        metrics = EngineMetrics(waiting=(waiting or {}).get(i, 0), num_blocks=capacity, block_size=16)
        counter.observe(metrics)  # as a scrape taken before this router sent anything would
        if working_set and i in working_set:  # requests sent there lately touched these blocks
            counter.touched(random_blocks(working_set[i], seed=i), now=0.0)
        views.append(EndpointView(ep, metrics, counter=counter))
    request = SchedulingRequest("r", "m", PROMPT)
    cycle = Cycle(request, precise.fingerprinter.prompt(PROMPT), 0, 16, now=0.0)
    scores = scorer.score(cycle, views)
    assert max(scores.values()) == 1.0
    return dict(enumerate(scorer.estimates(cycle, views)))


def test_a_cached_prefix_wins_on_idle_pods() -> None:
    # pod 0 holds 30 of 32 blocks: 32 tokens to compute against 512 elsewhere
    assert run({0: 30}) == {0: 32 + STEP, 1: 512 + STEP, 2: 512 + STEP}


def test_a_hot_prefix_spreads_once_its_queue_costs_more_than_recomputing_it() -> None:
    est = run({0: 30, 1: 30}, queued={0: 600, 1: 200})
    assert est == {0: 600 + 32 + STEP, 1: 200 + 32 + STEP, 2: 512 + STEP}
    assert min(est, key=est.__getitem__) == 1  # the other replica of the prefix, not the cold pod
    est = run({0: 30}, queued={0: 600})
    assert est[0] > est[1] == est[2]  # a queue longer than the prompt: recompute it elsewhere


def test_a_cold_prefix_stays_home_behind_a_short_queue() -> None:
    est = run({0: 30}, queued={0: 300})
    assert min(est, key=est.__getitem__) == 0


def test_copying_a_prefix_another_pod_holds_costs_the_capacity_it_takes() -> None:
    # two requests of a new prefix arrive together: the second waits behind the first at home
    # (600 queued) or copies the 480 cached tokens to an idle pod, at the cost of that copy
    assert run({0: 30}, queued={0: 600}, copy_weight=1.0) == {0: 600 + 32 + STEP, 1: 512 + 480 + STEP,
                                                              2: 512 + 480 + STEP}
    est = run({0: 30}, queued={0: 2000}, copy_weight=1.0)  # a busy home: the copy is worth it
    assert min(est, key=est.__getitem__) != 0


def test_a_new_prefix_goes_where_it_evicts_nothing_in_use() -> None:
    # pods of 1,000 blocks; pod 0's requests lately touched ~1,200 blocks, pod 1's ~100: the 512
    # new tokens would push in-use blocks out of pod 0 (all 512 count: no more than are stored)
    est = run({}, capacity=1000, working_set={0: 1200, 1: 100}, evict_weight=1.0)
    assert est == {0: 2 * 512 + STEP, 1: 512 + STEP, 2: 512 + STEP}
    # a pod that does not report its capacity is charged nothing
    assert run({}, working_set={0: 5000}, evict_weight=1.0)[0] == 512 + STEP


def test_a_cached_prefix_stays_home_on_a_full_pod() -> None:
    # pod 0 holds the prefix and is full of in-use blocks: its 32 new tokens evict at most 32
    est = run({0: 30}, capacity=1000, working_set={0: 5000, 1: 100}, evict_weight=1.0)
    assert est[0] == 2 * 32 + STEP < est[1] == 512 + STEP


def test_other_routers_waiting_requests_count_at_the_mean_work() -> None:
    est = run({}, queued={0: 100}, waiting={1: 3})  # our one request sent 100 tokens; pod 1 has 3 foreign
    assert est == {0: 100 + 512 + STEP, 1: 3 * 100 + 512 + STEP, 2: 512 + STEP}


def test_decoding_requests_slow_every_step() -> None:
    assert run({}, decoding={0: 40}) == {0: 512 + STEP + 40, 1: 512 + STEP, 2: 512 + STEP}


def test_work_turns_into_seconds_at_the_pools_speed() -> None:
    # the median of the observed pods' seconds per token, for every pod (observed or not)
    work = 512 + STEP
    est = run({}, speed={0: 0.002, 1: 0.001})
    assert {i: round(v / work / 0.001, 9) for i, v in est.items()} == {0: 1.5, 1: 1.5, 2: 1.5}
    assert run({}) == {0: work, 1: work, 2: work}  # nothing observed yet: tokens of work, all alike


def test_a_pod_that_looked_slow_in_a_burst_is_not_left_idle() -> None:
    # pod 0's last first tokens came three times later than its queue said (a burst the queue
    # model got wrong); now it is idle and the others have a queue: it gets the request
    est = run({}, queued={1: 400, 2: 400}, speed={0: 0.003, 1: 0.001, 2: 0.001})
    assert min(est, key=est.__getitem__) == 0


def test_a_large_pools_speed_is_the_median_of_a_sample_spread_over_it() -> None:
    # 1,000 pods: every other one not observed yet, one in seven of the rest ten times slower
    speeds = [0.0 if i % 2 else 0.01 if i % 7 == 0 else 0.001 for i in range(1000)]
    views = [EndpointView(Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000), EngineMetrics(),
                          counter=LoadCounter(seconds_per_token=s)) for i, s in enumerate(speeds)]
    def speed(of: list[EndpointView]) -> float:
        speeds = pool_speed([ep.counter.seconds_per_token for ep in of])
        assert pool_speed(LoadBoard(1).columns(of).columns.seconds_per_token) == speeds  # the same from a column
        return speeds

    assert speed(views) == 0.001
    assert speed(views[1::2]) == 0.0  # nobody observed
    assert speed(views[:4]) == statistics.median([0.01, 0.001])
