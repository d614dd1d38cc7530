"""kvflow's routing policy against the oracle on the replay, over several traces and fingerprint keys.

    python bench/replay_policy.py --workloads a b c [--seeds 0 1 2 3 4] [--secrets 3] [--lag 4,5]
    python bench/replay_policy.py --trace ../shared/traces/mooncake-synthetic_trace.jsonl   # a trace instead

For each workload and seed: round-robin's saturation rate on the replay (as ``kvflow bench
routing`` finds it), the oracle there, and kvflow's default router deciding inside the replay
once per fingerprint key (the key decides which blocks the router's working set samples, so each
is another, equally likely, run). It prints kvflow's mean TTFT over the oracle's per workload:
the mean and spread of those ratios. One replay is deterministic but chaotic (one decision
changed moves every later one), so a change to the policy is judged on the mean over all of them.

``--lag TO,FROM`` (ms) adds the way between the router and the pods (``oracle.Lag``): a request
reaches its pod's engine TO ms after the pick, and the router hears of its first token and its
end FROM ms after the engine; ``bench/path_probe.py`` measures both on the live benchmark's
pods (bench/RESULTS.md, "Every hop"). Without them the router learns its pods' speed on a path
with no latency, which no real one has.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from kvbench import oracle, traces
from kvbench.replay_kvflow import KvflowReplay, secret
from kvbench.runner import SIM_PROFILE, saturation
from kvbench.workloads import WORKLOADS, Workload

from kvflow.sim.profiles import get_profile

DURATION = 20.0


def ratios(w: Workload, seeds: list[int], secrets: int, lag: oracle.Lag, duration: float = DURATION,
           **policy: Any) -> list[float]:
    """kvflow's mean TTFT over the oracle's, per (seed, key); ``policy``: ``KvflowReplay``'s
    ``replicas``, ``peers`` and ``events``."""
    profile = get_profile(SIM_PROFILE)
    out = []
    for seed in seeds:
        rate = saturation(w, seed, duration)
        trace = w.trace(rate, duration, seed)
        prepared = oracle.prepare(trace)
        best, _ = oracle.oracle_replay(trace, pods=w.decode_pods, profile=profile, num_blocks=w.num_blocks,
                                       prepared=prepared, cpu_blocks=w.cpu_blocks)
        for i in range(secrets):
            replay = KvflowReplay(w.decode_pods, w.num_blocks, secret=secret(i), **policy)
            result = oracle.replay(trace, replay, pods=w.decode_pods, profile=profile, num_blocks=w.num_blocks,
                                   prepared=prepared, lag=lag, cpu_blocks=w.cpu_blocks)
            out.append(oracle.mean_ttft(result.ttft) / oracle.mean_ttft(best.ttft))
    return out


def parse_lag(text: str) -> oracle.Lag:
    try:
        to_pod, from_pod = (float(x) / 1e3 for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lag takes TO,FROM in milliseconds (got {text!r})") from None
    if to_pod < 0 or from_pod < 0:
        raise argparse.ArgumentTypeError("--lag cannot be negative")
    return oracle.Lag(to_pod, from_pod)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["a", "b", "c"],
                   choices=sorted(w for w in WORKLOADS if WORKLOADS[w].prefill_pods == 0))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--secrets", type=int, default=3, help="fingerprint keys per trace")
    p.add_argument("--lag", type=parse_lag, default=oracle.Lag(), help="TO,FROM in ms (default 0,0)")
    p.add_argument("--replicas", type=int, default=1, help="routers, as gateway replicas (request i to router i mod N)")
    p.add_argument("--no-peers", action="store_true", help="replicas do not tell each other what they routed")
    p.add_argument("--no-events", action="store_true", help="the pods publish no KV events")
    traces.add_arguments(p)  # --trace FILE replaces --workloads
    args = p.parse_args()
    if args.secrets < 1:
        p.error("--secrets must be at least 1")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    name = KvflowReplay(1, 1, replicas=args.replicas, peers=not args.no_peers, events=not args.no_events).name
    print(f"{name} over the oracle, {len(args.seeds)} traces x {args.secrets} keys, "
          f"lag {args.lag.to_pod * 1e3:g} ms to the pods, {args.lag.from_pod * 1e3:g} ms back")
    print("| workload | mean | sd | min | max |\n|---|---:|---:|---:|---:|")
    cases = [traces.workload(args)[0]] if args.trace else [WORKLOADS[name] for name in args.workloads]
    for w in cases:
        name = w.name
        r = ratios(w, args.seeds, args.secrets, args.lag, replicas=args.replicas, peers=not args.no_peers,
                   events=not args.no_events)
        sd = statistics.stdev(r) if len(r) > 1 else 0.0
        print(f"| ({name}) | {statistics.fmean(r):.3f} | {sd:.3f} | {min(r):.3f} | {max(r):.3f} |", flush=True)


if __name__ == "__main__":
    main()
