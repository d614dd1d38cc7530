"""kvflow's routing policy against the oracle on the replay, over several traces and fingerprint keys.

    python bench/replay_policy.py --workloads a b c [--seeds 0 1 2 3 4] [--secrets 3] [--lag 4,5]
    python bench/replay_policy.py --trace ../shared/traces/mooncake-synthetic_trace.jsonl   # a trace instead
    python bench/replay_policy.py --workloads e-cpu --rates 16 24 32 40 --seeds 0 --secrets 1   # fixed rates

For each workload and seed: round-robin's saturation rate on the replay (as ``kvflow bench
routing`` finds it), the oracle there, and kvflow's default router deciding inside the replay
once per fingerprint key (the key decides which blocks the router's working set samples, so each
is another, equally likely, run). It prints kvflow's mean TTFT over the oracle's per workload:
the mean and spread of those ratios. One replay is deterministic but chaotic (one decision
changed moves every later one), so a change to the policy is judged on the mean over all of them.

``--rates R [R ...]`` replays each trace at those rates instead of round-robin's saturation rate,
and ``--figures`` (implied by ``--rates``) prints, per workload and rate, the figures behind each
ratio beside the oracle's: mean and p90 TTFT, prefix-cache hit rate (tokens, GPU hits only: a
CPU-tier reload is no hit, as vLLM counts it) and balance (busiest pod's requests over the
mean), each the mean over seeds (and keys, for kvflow).

``--warmup SECONDS`` replays that many seconds of arrivals (same rate and workload) before each
trace's ``--duration`` and counts only the requests sent after them, in every figure and ratio:
steady state, not the first sight of each prefix (``kvflow bench routing --warmup``).

``--lag TO,FROM`` (ms) adds the way between the router and the pods (``oracle.Lag``): a request
reaches its pod's engine TO ms after the pick, and the router hears of its first token and its
end FROM ms after the engine; ``bench/path_probe.py`` measures both on the live benchmark's
pods (bench/RESULTS.md, "Every hop"). Without them the router learns its pods' speed on a path
with no latency, which no real one has.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

from kvbench import oracle, traces
from kvbench.replay_kvflow import KvflowReplay, secret
from kvbench.report import percentile
from kvbench.runner import SIM_PROFILE, saturation
from kvbench.workloads import WORKLOADS, Workload

from kvflow.sim.profiles import get_profile

DURATION = 20.0


@dataclass(frozen=True, slots=True)
class Figures:
    """One replay's figures: TTFT mean and p90 (ms), hit rates (tokens: GPU hits, and CPU-tier
    reloads), balance."""

    mean_ms: float
    p90_ms: float
    hit_rate: float
    cpu_rate: float
    balance: float

    @classmethod
    def of(cls, result: oracle.ReplayResult) -> Figures:
        ms = [t * 1e3 for t in result.ttft if not math.isnan(t)]
        per_pod = result.requests_per_pod
        balance = max(per_pod) / statistics.fmean(per_pod) if sum(per_pod) else math.nan
        return cls(statistics.fmean(ms) if ms else math.nan, percentile(ms, 0.9), result.hit_rate, result.reload_rate,
                   balance)

    @staticmethod
    def mean(figures: Sequence[Figures]) -> Figures:
        return Figures(*map(statistics.fmean, zip(*map(astuple, figures), strict=True)))

    def cells(self) -> str:
        return f"{self.mean_ms:.1f} / {self.p90_ms:.1f} | {self.hit_rate:.2f} / {self.cpu_rate:.2f} | {self.balance:.2f}"


@dataclass(slots=True)
class Replayed:
    """A workload's replays at one rate: kvflow's per (seed, key), the oracle's per seed."""

    rate: float
    """The rate (req/s); NaN for round-robin's saturation rate, each seed's own (``saturations``)."""
    saturations: list[float] = field(default_factory=list)
    kvflow: list[Figures] = field(default_factory=list)
    oracle: list[Figures] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    """kvflow's mean TTFT over the oracle's, per (seed, key)."""

    def label(self) -> str:
        if not self.saturations:
            return f"{self.rate:g}"
        lo, hi = min(self.saturations), max(self.saturations)
        return f"saturation ({lo:g})" if lo == hi else f"saturation ({lo:g}-{hi:g})"


def replayed(w: Workload, seeds: list[int], secrets: int, lag: oracle.Lag, duration: float = DURATION,
             rates: Sequence[float] = (), warmup: float = 0.0, **policy: Any) -> list[Replayed]:
    """kvflow's and the oracle's replays of each seed's trace, at round-robin's saturation rate
    (``rates`` empty) or at each of ``rates``, each figure of the requests sent after ``warmup``
    seconds; ``policy``: ``KvflowReplay``'s ``replicas``, ``peers`` and ``events``."""
    profile = get_profile(SIM_PROFILE)
    out: dict[float, Replayed] = {}
    for seed in seeds:
        for rate in rates or [saturation(w, seed, duration)]:
            trace = w.trace(rate, duration, seed, warmup)
            prepared = oracle.prepare(trace)
            row = out.setdefault(rate if rates else math.nan, Replayed(rate if rates else math.nan))
            if not rates:
                row.saturations.append(rate)
            best, _ = oracle.oracle_replay(trace, pods=w.decode_pods, profile=profile, num_blocks=w.num_blocks,
                                           prepared=prepared, cpu_blocks=w.cpu_blocks)
            best = best.since(warmup)
            row.oracle.append(Figures.of(best))
            for i in range(secrets):
                replay = KvflowReplay(w.decode_pods, w.num_blocks, secret=secret(i), **policy)
                result = oracle.replay(trace, replay, pods=w.decode_pods, profile=profile, num_blocks=w.num_blocks,
                                       prepared=prepared, lag=lag, cpu_blocks=w.cpu_blocks).since(warmup)
                row.kvflow.append(Figures.of(result))
                row.ratios.append(oracle.mean_ttft(result.ttft) / oracle.mean_ttft(best.ttft))
    return list(out.values())


def ratios(w: Workload, seeds: list[int], secrets: int, lag: oracle.Lag, duration: float = DURATION,
           **policy: Any) -> list[float]:
    """kvflow's mean TTFT over the oracle's, per (seed, key), at round-robin's saturation rate;
    ``policy``: ``KvflowReplay``'s ``replicas``, ``peers`` and ``events``."""
    return [r for row in replayed(w, seeds, secrets, lag, duration, **policy) for r in row.ratios]


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
    p.add_argument("--rates", nargs="+", type=float, default=None, metavar="R",
                   help="replay at these rates (req/s) instead of round-robin's saturation rate")
    p.add_argument("--duration", type=float, default=DURATION, help="seconds of each trace (default %(default)s)")
    p.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                   help="seconds of arrivals before each trace's duration that count in no figure (default 0)")
    p.add_argument("--figures", action="store_true",
                   help="also print each router's TTFT mean / p90, hit rate and balance (always with --rates)")
    traces.add_arguments(p)  # --trace FILE replaces --workloads
    args = p.parse_args()
    if args.secrets < 1:
        p.error("--secrets must be at least 1")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.rates and min(args.rates) <= 0:
        p.error("--rates must be above 0")
    if args.duration <= 0:
        p.error("--duration must be above 0")
    if args.warmup < 0:
        p.error("--warmup cannot be negative")
    name = KvflowReplay(1, 1, replicas=args.replicas, peers=not args.no_peers, events=not args.no_events).name
    print(f"{name} over the oracle, {len(args.seeds)} traces x {args.secrets} keys, "
          f"lag {args.lag.to_pod * 1e3:g} ms to the pods, {args.lag.from_pod * 1e3:g} ms back"
          + (f", warm-up {args.warmup:g} s (only requests sent after it count)" if args.warmup else ""))
    if args.trace:
        case, fixed = traces.workload(args)
        cases, rates = [case], tuple(args.rates or fixed)
    else:
        cases, rates = [WORKLOADS[name] for name in args.workloads], tuple(args.rates or ())
    policy = {"replicas": args.replicas, "peers": not args.no_peers, "events": not args.no_events}
    print("| workload | rate | mean | sd | min | max |\n|---|---:|---:|---:|---:|---:|")
    rows: list[tuple[Workload, Replayed]] = []
    for w in cases:  # each workload's rows as soon as its replays are done
        for row in replayed(w, args.seeds, args.secrets, args.lag, args.duration, rates, args.warmup, **policy):
            rows.append((w, row))
            r = row.ratios
            sd = statistics.stdev(r) if len(r) > 1 else 0.0
            print(f"| ({w.name}) | {row.label()} | {statistics.fmean(r):.3f} | {sd:.3f} | {min(r):.3f} | {max(r):.3f} |",
                  flush=True)
    if args.figures or rates:
        print(f"\nmean over seeds (kvflow: and keys); TTFT mean / p90 in ms, hit rate: GPU / CPU-tier reloads\n"
              f"| workload | rate | {name} TTFT | hit | balance | oracle (replay) TTFT | hit | balance |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|")
        for w, row in rows:
            print(f"| ({w.name}) | {row.label()} | {Figures.mean(row.kvflow).cells()} | {Figures.mean(row.oracle).cells()} |")


if __name__ == "__main__":
    main()
