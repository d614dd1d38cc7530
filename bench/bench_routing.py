"""Routing quality: kvflow's gateway against sglang-router, vllm-router and an oracle, in one run,
in front of the same simulated pods.

Per workload (``kvbench.workloads``: (a) llm-d's shared-prefix shape, (b) Zipf-skewed tenants,
(c) multi-turn chat, (d) shared prefix with P/D), 4 simulated vLLM pods (``kvflow sim --profile
h100-llama8b``, KV events on, a KV pool too small for every prefix) serve open-loop Poisson
traffic at several rates around where round-robin saturates (found on the oracle's replay).
Each router runs as its users run it; between runs the pods drain and reset their prefix
caches. The oracle replays the same traces offline on the simulator's own scheduler (see
``kvbench.oracle`` and docs/router.md), and its placements are then played on live pods with
no router between (``oracle (live)``). Prints a markdown table per workload (ratios to
sglang-router ``cache_aware`` and to the oracle, replayed and live, at the same rate), issue
10's targets, and writes ``bench/out/routing-<workload>.png`` and ``bench/out/routing.json``.

    python bench/bench_routing.py                       # everything, ~40 min on 2 cores
    python bench/bench_routing.py --workloads a --routers kvflow sglang:cache_aware --duration 10
    python bench/bench_routing.py --workloads a --routers kvflow kvflow:prefix-approx --rates 8 12 16
    python bench/bench_routing.py --workloads a b c --routers kvflow sglang:cache_aware sglang:round_robin \\
        --factors 1.0 --seeds 0 1 2                     # means over three traces, ~15 min
    python bench/bench_routing.py --trace ../shared/traces/mooncake-synthetic_trace.jsonl --trace-scale 0.0625 \\
        --trace-speedup 4 --duration 20                 # a Mooncake trace, 1/16 of its tokens, 4x its pace
    python bench/bench_routing.py --workloads a --routers kvflow kvflow:no-events kvflow-envoy sglang:cache_aware \\
        --replicas 1 3 --factors 1.0 --duration 15      # one replica against three, with and without KV events

``--replicas N [N ...]`` runs each kvflow row that names no ``xN`` of its own with N replicas
(each count in turn): N gateways with the whole pool each, the client spreading requests
round-robin over them, or N pickers behind the one Envoy for ``kvflow-envoy``. The row is
``kvflow default x3``; its CPU is every replica's; below the table each is compared with its
one-replica row (issue 51: within 10 % on mean and p90 TTFT, hit rate within 2 points). The
peers stay single.

``--trace FILE`` replays a trace in Mooncake's JSONL format (``kvbench.traces``) instead of the
synthetic workloads: open loop by timestamp, token counts scaled by ``--trace-scale``, a window
of trace time picked with ``--trace-window``, time compressed by ``--trace-speedup`` (or, without
it, to the rates the saturation search picks), seed ``k`` the ``k``-th slice of ``--duration``.

Peers come from the ``bench`` extra (``pip install -e '.[bench]'``); a missing one is installed
on first use, or skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from kvbench import report, routers
from kvbench.runner import Options, Outcome, bench_workload, pressured, saturation_row_rate
from kvbench import traces
from kvbench.workloads import WORKLOADS, describe

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="kvflow bench routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["a", "b", "c", "d"], choices=list(WORKLOADS),
                   help="a: shared prefix, b: Zipf tenants, c: multi-turn, d: shared prefix with P/D, "
                        "e / e-cpu: tiered prefix (more than GPU KV) without / with a CPU tier (default: a-d)")
    p.add_argument("--routers", nargs="+", default=list(routers.DEFAULT_ROUTERS),
                   help="kvflow[:PROFILE], kvflow-envoy[:PROFILE][:lean] (the router as ext_proc behind Envoy; lean: answers' "
                        "bodies bypass the picker), either with :no-events (pods that publish no KV events) and :xN (N replicas), "
                        "sglang:cache_aware|round_robin, vllm-router:cache_aware|round_robin|kv_aware, "
                        "oracle (the oracle's placements sent straight to the pods; default: %(default)s)")
    p.add_argument("--replicas", nargs="+", type=int, default=[1], metavar="N",
                   help="run each kvflow row (no :xN of its own) with N replicas: N gateways the client spreads "
                        "requests over round-robin, or N pickers behind one Envoy; several counts: a row each "
                        "(default: 1)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run (default 20)")
    p.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                   help="seconds of arrivals before each run's --duration, at the same rate and workload, that fill "
                        "the caches and count in no figure: only requests sent after the warm-up do (default 0)")
    p.add_argument("--factors", nargs="+", type=float, default=[0.5, 0.75, 1.0, 1.25],
                   help="rates as multiples of round-robin's saturation rate on the replay")
    p.add_argument("--rates", nargs="+", type=float, default=[], help="explicit request rates (req/s) instead")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="workload seeds (traces); with several, a last table gives the means over seeds "
                        "(default: %(default)s)")
    p.add_argument("--kv-fraction", nargs="+", type=float, default=[], metavar="F",
                   help="run each workload's cache-pressure variants instead: pools that hold F of its working set "
                        "(the blocks more than one prompt shares, at round-robin's saturation rate on its own pools), "
                        "named <workload>-kv<F as percent>; 0 is the workload's own pools (--kv-fraction 0 0.7: both)")
    traces.add_arguments(p)
    p.add_argument("--llmservice", type=Path, default=None,
                   help="take the kvflow rows' router config from `kvflow operator render` of this LLMService "
                        "(its profile, plugins, block size, KV-event and P/D settings; the pool is the benchmark's)")
    p.add_argument("--out", type=Path, default=OUT, help="where the PNGs and routing.json go")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--nice", type=int, default=-5 if os.geteuid() == 0 else 0,
                   help="niceness for the benchmark, its pods and routers (default -5 as root: a shared machine's "
                        "other work then disturbs the measurement less)")
    return p


def print_outcome(outcome: Outcome) -> None:
    w = outcome.workload
    print(f"\n### workload {w.name}: {describe(w)}; "
          f"{w.decode_pods} {'decode pods + ' + str(w.prefill_pods) + ' prefill' if w.pd else 'pods'}, "
          f"{w.num_blocks} KV blocks each; "
          + (f"round-robin saturates near {outcome.saturation:g} req/s (replay)" if outcome.saturation == outcome.saturation
             else "rates given")
          + (f"; warm-up {outcome.warmup:g} s: every figure is of the requests sent after it\n" if outcome.warmup else "\n"))
    print(report.table(outcome.rows))
    print()
    print(report.calibration(outcome.rows))
    print(report.targets(w.name, outcome.rows, saturation_row_rate(outcome),
                         uniform_shared_prefix=w.shape == "shared-prefix" and not w.pd))
    for line in replica_lines(outcome.rows, saturation_row_rate(outcome), outcome.decisions):
        print(line)
    for skipped in outcome.skipped:
        print(f"skipped {skipped}")


def replica_lines(rows: list[report.Row], rate: float, decisions: dict[str, dict[float, tuple[int, ...]]]) -> list[str]:
    """Each row with replicas against its one-replica row at ``rate`` (a no-events row also
    against the row with events): issue 51 asks that they route as well as one, no more than
    10 % slower on mean and p90 TTFT and 2 points lower on hit rate; and how its replicas shared
    the decisions."""
    at = {r.router: r for r in rows if r.rate == rate and r.measured}
    out = []
    for name, row in at.items():
        try:
            spec = routers.RouterSpec.parse(row_spelling(name))
        except ValueError:
            continue
        if spec.replicas == 1:
            continue
        ones = [dataclasses.replace(spec, replicas=1, kv_events=kv_events, peers=True).name
                for kv_events in dict.fromkeys((spec.kv_events, True))]
        for one in (at[n] for n in ones if n in at):
            mean, p90 = row.ttft_mean_ms / one.ttft_mean_ms, row.ttft_p90_ms / one.ttft_p90_ms
            hit = (row.hit_rate - one.hit_rate) * 100
            met = max(mean, p90) <= 1.10 and hit >= -2  # as well as one: no more than 10 % or 2 points worse
            out.append(f"issue 51 ({name} vs {one.router}, at {rate:g} req/s): mean TTFT {mean:.2f}, p90 {p90:.2f}, "
                       f"hit rate {hit:+.1f} points (at most 10 % and 2 points worse: {'met' if met else 'NOT met'})")
        shares = decisions.get(name, {}).get(rate)
        if shares:
            out.append(f"  {name}: decisions per replica {'/'.join(map(str, shares))}")
    return out


def row_spelling(name: str) -> str:
    """A measured kvflow row's name as ``--routers`` spells it (``kvflow default no-events x3`` is
    ``kvflow:default:no-events:x3``)."""
    return ":".join(name.split(" "))


def rendered_router_config(path: Path) -> dict[str, object]:
    """The router config the operator renders for the (first) LLMService in ``path``, less the
    pool it would watch on a cluster: what that service's router runs, for the kvflow rows."""
    import yaml

    from kvflow.operator.render import render_yaml
    from kvflow.operator.spec import InvalidSpecError

    try:
        objs = list(yaml.safe_load_all(render_yaml(path.read_text())))
    except (OSError, InvalidSpecError) as exc:
        raise SystemExit(f"kvflow bench routing: --llmservice {path}: {exc}") from None
    maps = [o for o in objs if o["kind"] == "ConfigMap" and "router.yaml" in o.get("data", {})]
    if not maps:
        raise SystemExit(f"kvflow bench routing: --llmservice {path}: no LLMService with kvflow's router in it")
    config: dict[str, object] = yaml.safe_load(maps[0]["data"]["router.yaml"])
    config.pop("pool", None)
    config.pop("peers", None)  # (each row's replicas are given their own peers: routers.peer_sections)
    return config


async def main_async(args: argparse.Namespace) -> list[Outcome]:
    for name in args.routers:
        routers.RouterSpec.parse(name)  # a typo fails before any pod starts
    names = routers.with_replicas(args.routers, args.replicas)
    workloads = [(WORKLOADS[name], tuple(args.rates)) for name in args.workloads]
    if args.trace is not None:
        trace, rates = traces.workload(args)
        workloads = [(trace, rates or tuple(args.rates))]
    kvflow_config = rendered_router_config(args.llmservice) if args.llmservice else None
    outcomes = []
    for base, rates in workloads:
        for seed in args.seeds:
            for fraction in args.kv_fraction or [0.0]:
                workload = await asyncio.to_thread(pressured, base, fraction, seed, args.duration) if fraction else base
                opts = Options(duration=args.duration, warmup=args.warmup, factors=tuple(args.factors), rates=rates,
                               seed=seed, log_dir=ROOT / ".kvflow" / "bench-routing-logs", verbose=not args.quiet,
                               kvflow_config=kvflow_config)
                outcome = await bench_workload(workload, names, opts)
                outcomes.append(outcome)
                print_outcome(outcome)
                title = f"workload {workload.name}: {describe(workload)}" + (f", seed {seed}" if seed else "")
                report.plot(outcome.rows, title, args.out / plot_name(workload.name, seed, args.seeds))
                at = saturation_row_rate(outcome)
                report.plot_cdf([r for r in outcome.rows if r.rate == at], f"{title}, {at:g} req/s",
                                args.out / plot_name(workload.name, seed, args.seeds).replace(".png", "-cdf.png"))
                sys.stdout.flush()
    if len(args.seeds) > 1:
        print(f"\n### means over seeds {', '.join(map(str, args.seeds))}, at round-robin's saturation rate\n")
        print(report.summary([r for o in outcomes for r in o.rows if r.rate == saturation_row_rate(o)]))
    return outcomes


def plot_name(workload: str, seed: int, seeds: list[int]) -> str:
    """``routing-<workload>.png`` for the first seed, ``routing-<workload>-seed<N>.png`` for the others."""
    return f"routing-{workload}.png" if seed == seeds[0] else f"routing-{workload}-seed{seed}.png"


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup cannot be negative")
    try:  # children (pods, routers) inherit it
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    except OSError as exc:
        print(f"kvflow bench routing: could not set niceness {args.nice} ({exc}); running as is", file=sys.stderr)
    try:
        outcomes = asyncio.run(main_async(args))
    except (ValueError, OSError) as exc:  # a bad trace file is one line, not a traceback
        print(f"kvflow bench routing: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(
        [{"workload": o.workload.name, "seed": o.seed, "saturation": o.saturation, "rates": o.rates, "warmup": o.warmup,
          "skipped": o.skipped,
          "decisions_per_replica": o.decisions, "rows": [asdict(r) for r in o.rows]} for o in outcomes],
        indent=1, default=str))
    names = [plot_name(o.workload.name, o.seed, args.seeds) for o in outcomes]
    print(f"\nplots: {', '.join(str(args.out / n) for n in names)}; TTFT CDFs at the saturation rate: "
          f"{', '.join(str(args.out / n.replace('.png', '-cdf.png')) for n in names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
