"""The regret diagnostic prices kvflow's decisions with the oracle's model of the same state."""

from __future__ import annotations

import math

from kvbench import oracle
from kvbench.regret import CAUSES, Decision, RegretReplay, summarise
from kvbench.workloads import SMOKE

from kvflow.sim.profiles import get_profile


def decision(pick: int, best: int, cost: tuple[float, ...], cached: tuple[int, ...], believed: tuple[int, ...]) -> Decision:
    n = len(cost)
    return Decision(0.0, pick, best, cost, cached, believed, (0,) * n, (0,) * n, (0,) * n, (0.0,) * n, (0.0,) * n)


def test_a_losing_decision_is_put_down_to_the_cache_kvflow_misjudged_else_to_load() -> None:
    stale = decision(0, 1, (0.3, 0.1), cached=(0, 0), believed=(640, 0))  # it thought its pick held the prefix
    missed = decision(0, 1, (0.3, 0.1), cached=(0, 640), believed=(0, 0))  # the best pod held it, unseen
    load = decision(0, 1, (0.3, 0.1), cached=(640, 0), believed=(640, 0))  # right about the cache, too busy
    right = decision(1, 1, (0.3, 0.1), cached=(0, 0), believed=(0, 0))
    assert [d.cause() for d in (stale, missed, load)] == list(CAUSES)
    summary = summarise([stale, missed, load, right], threshold=0.002)
    assert summary.decisions == 4 and math.isclose(summary.regret_s, 0.6)
    assert summary.losing == {"stale cache": 1, "missed cache": 1, "load": 1}
    assert math.isclose(sum(summary.lost_s.values()), 0.6)


def test_the_eviction_cut_is_scored_against_what_each_pod_held() -> None:
    def pair(indexed: int, kept: int, held: int) -> Decision:
        return Decision(0.0, 0, 0, (0.1,), (0,), (0,), (indexed,), (held,), (kept,), (0.0,), (0.0,))

    summary = summarise([
        pair(100, 40, 30),  # cut to 40, the pod held 30: right (its KV events were late)
        pair(100, 40, 100),  # cut to 40, the pod held all of it: 60 blocks taken wrongly
        pair(100, 100, 70),  # left whole, the pod held 70: 30 blocks missed
        pair(100, 100, 100),  # left whole, held whole
        pair(0, 0, 50),  # nothing matched: not the cut's business
    ])
    assert summary.cuts_right == 1 and summary.false_cuts == (1, 60) and summary.missed_evictions == (1, 30)


def run(trace):  # type: ignore[no-untyped-def]
    policy = RegretReplay(2, 300)
    result = oracle.replay(trace, policy, pods=2, profile=get_profile("h100-llama8b"), num_blocks=300)
    return policy, result


def test_every_decision_is_priced_and_a_replay_repeats_exactly() -> None:
    trace = SMOKE.trace(20.0, 3.0)
    policy, result = run(trace)
    decisions = policy.decisions
    assert len(decisions) == len(trace.requests) == sum(result.requests_per_pod)
    longest = max(len(p.token_ids) for p in oracle.prepare(trace))
    for d in decisions:
        assert d.regret >= 0.0 and d.cost[d.best] == min(d.cost)
        assert all(0 <= b <= longest for b in (*d.believed, *d.cached)) and all(a >= 0.0 for a in d.ahead)
    assert any(max(d.believed) > 0 for d in decisions)  # groups come back: kvflow knew where they were
    summary = summarise(decisions)
    assert 0.0 < summary.index_agrees <= 1.0
    assert all(0 <= k <= i for d in decisions for i, k in zip(d.indexed, d.kept))
    assert sum(summary.losing.values()) <= summary.decisions
    assert sum(summary.lost_s.values()) <= summary.regret_s + 1e-9
    again, repeat = run(trace)
    assert repeat.ttft == result.ttft and again.decisions == decisions  # one fixed fingerprint key


def test_work_ahead_is_the_running_steps_rest_and_what_is_left_after_it() -> None:
    from kvbench.regret import ahead_tokens

    profile = get_profile("h100-llama8b")
    prepared = oracle.prepare(SMOKE.trace(20.0, 1.0))
    pod = oracle.new_pod(0, profile, num_blocks=300)
    pod.scheduler.add(oracle.sim_request(prepared[0], 0.0))
    pod.plan = pod.scheduler.schedule(0.0)
    pod.step_end = profile.step_seconds(0, 0, len(prepared[0].token_ids))
    now = pod.step_end / 2
    assert math.isclose(ahead_tokens(pod, now, profile), (pod.step_end - now) / profile.prefill_per_token_s)
