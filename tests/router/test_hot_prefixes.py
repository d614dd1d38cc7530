"""Hot prefixes spread, cold ones stay home, sessions stay together: the default profile, replayed.

The router decides inside the simulator's own scheduler on a virtual clock
(``bench/kvbench/replay_kvflow.py``): the same code as in production, fed KV events and scrapes,
with no HTTP and no CPU noise, so the outcomes are exact and the test takes seconds.
"""

from __future__ import annotations

import collections
import random

from kvbench import oracle
from kvbench.replay_kvflow import KvflowReplay
from kvbench.workloads import Trace, TraceRequest

from kvflow.sim.profiles import get_profile

PROFILE = get_profile("h100-llama8b")
PODS, BLOCKS = 4, 2400


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(20000)}" for _ in range(n))


def trace(hot_rate: float, cold_groups: int = 8, seconds: float = 5.0) -> Trace:
    """One hot system prompt at ``hot_rate`` req/s, and cold ones each sent twice, far apart."""
    rng = random.Random(7)
    hot = words(rng, 4000)
    colds = [words(rng, 4000) for _ in range(cold_groups)]
    sends: list[tuple[float, str, str]] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(hot_rate)
        sends.append((t, "hot", hot))
    for g, prompt in enumerate(colds):
        sends += [(0.3 + g * 0.5, f"cold{g}", prompt), (0.3 + g * 0.5 + 1.0, f"cold{g}", prompt)]
    sends.sort()
    requests = tuple(TraceRequest(i, at, f"{prefix} {words(rng, 800)}", 16, i, group)
                     for i, (at, group, prefix) in enumerate(sends))
    return Trace("hot-and-cold", hot_rate, seconds, requests)


def pods_per_group(t: Trace, policy: KvflowReplay) -> dict[str, collections.Counter[int]]:
    """Per group, how many of its requests each pod served."""
    served: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in t.requests:
        served[r.group][policy.picks[r.index]] += 1
    return served


def run(t: Trace) -> tuple[KvflowReplay, oracle.ReplayResult]:
    policy = KvflowReplay(PODS, BLOCKS)
    result = oracle.replay(t, policy, pods=PODS, profile=PROFILE, num_blocks=BLOCKS)
    assert policy.unchained == 0 and len(policy.router.precise)  # the pods' events keyed every block
    return policy, result


def test_a_prefix_that_one_pod_can_serve_stays_on_it() -> None:
    for rate in (2.0, 4.0, 8.0):
        t = trace(hot_rate=rate)
        policy, _ = run(t)
        hot = pods_per_group(t, policy)["hot"]
        # at most a copy made when two of its first requests arrived together
        assert hot.most_common(1)[0][1] >= 0.9 * sum(hot.values()), (rate, hot)


def test_a_prefix_hotter_than_its_pod_is_replicated_and_cold_ones_stay_home() -> None:
    t = trace(hot_rate=40.0)
    policy, result = run(t)
    served = pods_per_group(t, policy)
    # 40 req/s of 800 new tokens each is more prefill than one pod does (25k tokens/s)
    assert len(served["hot"]) >= 2  # its queue grew: it was computed again elsewhere
    assert all(len(pods) == 1 for group, pods in served.items() if group != "hot")  # each cold one at home
    # all at home, its queue would have grown by 7k tokens a second (over a second by the end)
    ttft = sorted(result.ttft)
    assert ttft[int(0.9 * len(ttft))] < 0.5
