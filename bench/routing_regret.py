"""Where kvflow's routing decisions lose against the oracle's model, on one replayed trace.

    python bench/routing_regret.py --workload b --seed 0 --rate 20 [--weight 1] [--secret 0]

kvflow's default router decides inside the replay (no HTTP, no machine noise); at each decision
the clairvoyant prices every pod in the same state, and the decision's one-step regret is what
kvflow's pick costs over the cheapest (``kvbench.regret`` says how, and what the causes mean).
The workloads and rates are ``kvflow bench routing``'s. The replay is exact: the same
arguments give the same figures; ``--secret`` gives the router another fingerprint key (the
key decides which blocks its working set samples), i.e. another, equally likely, run.
"""

from __future__ import annotations

import argparse
import statistics

from kvbench import oracle
from kvbench.regret import RegretReplay, report, summarise
from kvbench.replay_kvflow import secret
from kvbench.workloads import WORKLOADS

from kvflow.sim.profiles import get_profile


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(w for w in WORKLOADS if WORKLOADS[w].prefill_pods == 0), default="b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, required=True, help="requests per second (the bench's saturation rate)")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--weight", type=float, default=1.0, help="the clairvoyant's capacity weight")
    p.add_argument("--threshold-ms", type=float, default=2.0, help="a decision losing more than this counts")
    p.add_argument("--secret", type=int, default=0,
                   help="another fingerprint key for the router (0: the replay's; replay_policy.py's --secrets)")
    args = p.parse_args()

    workload = WORKLOADS[args.workload]
    trace = workload.trace(args.rate, args.duration, args.seed)
    profile = get_profile("h100-llama8b")
    policy = RegretReplay(workload.decode_pods, workload.num_blocks, weight=args.weight, secret=secret(args.secret))
    result = oracle.replay(trace, policy, pods=workload.decode_pods, profile=profile, num_blocks=workload.num_blocks,
                           cpu_blocks=workload.cpu_blocks)
    best, weight = oracle.oracle_replay(trace, pods=workload.decode_pods, profile=profile, num_blocks=workload.num_blocks,
                                        cpu_blocks=workload.cpu_blocks)
    kvflow_ms = statistics.fmean(t for t in result.ttft if t == t) * 1e3
    oracle_ms = statistics.fmean(t for t in best.ttft if t == t) * 1e3
    print(f"({args.workload}) seed {args.seed}, {args.rate:g} req/s: kvflow default (replay) {kvflow_ms:.1f} ms mean TTFT, "
          f"oracle {oracle_ms:.1f} ms (weight {weight:g}), ratio {kvflow_ms / oracle_ms:.2f}")
    print(report(summarise(policy.decisions, args.threshold_ms / 1e3)))


if __name__ == "__main__":
    main()
