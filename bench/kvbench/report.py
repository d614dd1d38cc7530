"""Rows of the routing benchmark, the markdown table, issue 10's targets and the plots (pure
but for writing the PNGs)."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbench.loadgen import Run
from kvbench.pods import Counters

REFERENCE = "sglang cache_aware"
ORACLE = "oracle (replay)"
LIVE_ORACLE = "oracle (live)"
"""The oracle's placements sent straight to the live pods, no router between (``routers.ORACLE``)."""
BOUND = "bound"
REPLAY_RR = "round-robin (replay)"
REPLAY_KVFLOW = "kvflow default (replay)"
STYLES: dict[str, dict[str, object]] = {
    ORACLE: {"linestyle": "--", "color": "black"},
    BOUND: {"linestyle": ":", "color": "black"},
    REPLAY_RR: {"linestyle": "--", "color": "grey"},
    REPLAY_KVFLOW: {"linestyle": "--", "color": "tab:red"},
    LIVE_ORACLE: {"linestyle": "-", "color": "black", "linewidth": 1.0},
}
"""Rows drawn in a style of their own: the replay's dashed or dotted, the live oracle thin black."""
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
"""Measured routers other than kvflow's headline (red, its replay dashed red)."""


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    router: str
    rate: float
    requests: int
    errors: int
    ttft_mean_ms: float
    ttft_p90_ms: float
    itl_ms: float = math.nan
    tokens_per_s: float = math.nan
    hit_rate: float = math.nan
    """Prefix-cache hits / queries from the pods' own counters (the replay's own for oracle rows)."""
    requests_per_pod: tuple[int, ...] = ()
    router_cpu: float = math.nan
    """The router's processes' CPU (Envoy's too, for ``kvflow-envoy``), as a share of one core
    over the run."""
    client_cpu: float = math.nan
    client_lag_ms: float = math.nan
    load_avg: float = math.nan
    answer_mismatches: int = 0
    pulled_tokens: int = 0
    """Prompt tokens P/D decode pods received over KV transfer (0: no disaggregation happened)."""
    pod_ttft_ms: float = math.nan
    """Mean time to first token as the (decode) pods measured it, from arrival at the pod: the
    rest of the client's TTFT is the router's path and the client's own delays."""
    measured: bool = True
    seed: int = 0
    """The workload's seed (its trace): rows compare with each other only within a seed."""
    ttft_p99_ms: float = math.nan
    ttfts_ms: tuple[float, ...] = ()
    """Every answered request's TTFT, in send order (the CDF plots)."""
    warmup_s: float = 0.0
    """The run's warm-up: every figure is of the requests sent after it (0: of all)."""

    @property
    def balance(self) -> float:
        """Busiest pod's requests over the mean (1.0 = even)."""
        if not self.requests_per_pod or not sum(self.requests_per_pod):
            return math.nan
        return max(self.requests_per_pod) / statistics.mean(self.requests_per_pod)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measured_row(workload: str, router: str, rate: float, run: Run, before: Sequence[Counters],
                 after: Sequence[Counters], decode_pods: Sequence[int], *, router_cpu: float, load_avg: float) -> Row:
    counted = run.counted  # ``before``: the pods' counters when the warm-up ended, if there was one
    done = [r for r in counted if r.ok]
    ttfts = [r.ttft * 1e3 for r in done]
    itls = [r.itl * 1e3 for r in done if not math.isnan(r.itl)]
    hits = sum(a.prefix_hits - b.prefix_hits for a, b in zip(after, before, strict=True))
    queries = sum(a.prefix_queries - b.prefix_queries for a, b in zip(after, before, strict=True))
    per_pod = tuple(int(after[i].requests - before[i].requests) for i in decode_pods)
    pod_ttfts = sum(after[i].ttft_count - before[i].ttft_count for i in decode_pods)
    pod_ttft = sum(after[i].ttft_sum - before[i].ttft_sum for i in decode_pods) / pod_ttfts if pod_ttfts else math.nan
    span = max((r.last for r in done), default=0.0) - min((r.sent for r in done), default=0.0)
    return Row(
        workload, router, rate, len(counted), len(counted) - len(done),
        statistics.mean(ttfts) if ttfts else math.nan, percentile(ttfts, 0.9),
        statistics.mean(itls) if itls else math.nan, sum(r.tokens for r in done) / span if span > 0 else math.nan,
        hits / queries if queries else math.nan, per_pod, router_cpu, run.cpu_share, run.max_lag * 1e3, load_avg,
        sum(not r.answer_matches for r in done),
        int(sum(a.external_hits - b.external_hits for a, b in zip(after, before, strict=True))), pod_ttft * 1e3,
        ttft_p99_ms=percentile(ttfts, 0.99), ttfts_ms=tuple(round(t, 3) for t in ttfts), warmup_s=run.warmup,
    )


def replay_row(workload: str, name: str, rate: float, ttft_s: Sequence[float], *, hit_rate: float = math.nan,
               requests_per_pod: tuple[int, ...] = (), warmup: float = 0.0) -> Row:
    """``ttft_s``: the counted requests' (those sent after ``warmup``)."""
    ms = [t * 1e3 for t in ttft_s if not math.isnan(t)]
    return Row(workload, name, rate, len(ttft_s), len(ttft_s) - len(ms), statistics.mean(ms) if ms else math.nan,
               percentile(ms, 0.9), hit_rate=hit_rate, requests_per_pod=requests_per_pod, measured=False,
               ttft_p99_ms=percentile(ms, 0.99), ttfts_ms=tuple(round(t, 3) for t in ms), warmup_s=warmup)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not math.isnan(a) and not math.isnan(b) else "–"


def _f(v: float, fmt: str) -> str:
    return "–" if math.isnan(v) else format(v, fmt)


def table(rows: Sequence[Row]) -> str:
    """One markdown table: every router at every rate, with ratios (mean TTFT) to sglang-router
    cache_aware and to the oracle, replayed and live, at the same rate."""
    lines = [
        "| rate (req/s) | router | TTFT mean (ms) | TTFT p90 (ms) | TTFT p99 (ms) | pod TTFT (ms) | vs sglang ca | vs oracle | "
        "vs oracle live | ITL (ms) | tok/s | errors | hit rate | balance (max/mean) | req/pod | KV pulled (tok) | router CPU | client CPU | "
        "client lag (ms) | load avg |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rate in sorted({r.rate for r in rows}):
        at = [r for r in rows if r.rate == rate]
        ref = next((r for r in at if r.router == REFERENCE), None)
        oracle = next((r for r in at if r.router == ORACLE), None)
        live = next((r for r in at if r.router == LIVE_ORACLE), None)
        for r in at:
            lines.append(
                f"| {rate:g} | {r.router} | {_f(r.ttft_mean_ms, '.1f')} | {_f(r.ttft_p90_ms, '.1f')} | "
                f"{_f(r.ttft_p99_ms, '.1f')} | {_f(r.pod_ttft_ms, '.1f')} | "
                f"{_ratio(r.ttft_mean_ms, ref.ttft_mean_ms) if ref else '–'} | "
                f"{_ratio(r.ttft_mean_ms, oracle.ttft_mean_ms) if oracle else '–'} | "
                f"{_ratio(r.ttft_mean_ms, live.ttft_mean_ms) if live else '–'} | {_f(r.itl_ms, '.2f')} | "
                f"{_f(r.tokens_per_s, '.0f')} | {r.errors if r.measured or r.errors else '–'} | "
                f"{_f(r.hit_rate, '.2f')} | {_f(r.balance, '.2f')} | {'/'.join(map(str, r.requests_per_pod))} | "
                f"{r.pulled_tokens if r.measured else '–'} | "
                f"{_f(r.router_cpu * 100, '.0f') + '%' if not math.isnan(r.router_cpu) else '–'} | "
                f"{_f(r.client_cpu * 100, '.0f') + '%' if not math.isnan(r.client_cpu) else '–'} | "
                f"{_f(r.client_lag_ms, '.1f')} | {_f(r.load_avg, '.2f')} |"
            )
    return "\n".join(lines)


def calibration(rows: Sequence[Row]) -> str:
    """Measured round-robin TTFT over the replay's, per rate: how well the replay models the pods."""
    parts = []
    for rate in sorted({r.rate for r in rows}):
        replayed = next((r for r in rows if r.rate == rate and r.router == REPLAY_RR), None)
        if replayed is None:
            continue
        for r in rows:
            if r.rate == rate and r.measured and r.router.replace("_", "-").endswith("round-robin"):
                parts.append(f"{r.router} @ {rate:g}: mean {_ratio(r.ttft_mean_ms, replayed.ttft_mean_ms)}, "
                             f"p90 {_ratio(r.ttft_p90_ms, replayed.ttft_p90_ms)}")
    return "replay calibration (measured / replayed round-robin TTFT): " + ("; ".join(parts) or "no round-robin run")


def targets(workload: str, rows: Sequence[Row], saturation: float, *, uniform_shared_prefix: bool) -> str:
    """Issue 10 item 6 at the rate where round-robin saturates: reported whether met or not.
    The hit-rate and balance target is for the uniform shared-prefix workload only."""
    at = [r for r in rows if r.rate == saturation]
    kv = next((r for r in at if r.router == "kvflow default"), None)
    if kv is None:
        return f"targets ({workload}): no kvflow default run at {saturation:g} req/s"
    out = [f"issue 10 targets ({workload}, at {saturation:g} req/s):"]
    ref = next((r for r in at if r.router == REFERENCE), None)
    if ref:
        m, p = kv.ttft_mean_ms / ref.ttft_mean_ms, kv.ttft_p90_ms / ref.ttft_p90_ms
        out.append(f"  TTFT vs sglang cache_aware: mean {m:.2f}, p90 {p:.2f} (target <= 0.80: "
                   f"{'met' if max(m, p) <= 0.8 else 'NOT met'})")
    oracle = next((r for r in at if r.router == ORACLE), None)
    if oracle:
        m = kv.ttft_mean_ms / oracle.ttft_mean_ms
        out.append(f"  TTFT vs oracle: mean {m:.2f} (target <= 1.10: {'met' if m <= 1.1 else 'NOT met'})")
        if not math.isnan(kv.pod_ttft_ms):
            out.append(f"  the pods' own TTFT vs oracle (the replay models the pods, not the HTTP path): "
                       f"mean {kv.pod_ttft_ms / oracle.ttft_mean_ms:.2f}")
    live = next((r for r in at if r.router == LIVE_ORACLE), None)
    if live:
        m, p = kv.ttft_mean_ms / live.ttft_mean_ms, kv.ttft_p90_ms / live.ttft_p90_ms
        out.append(f"  TTFT vs oracle (live: its placements sent straight to the same pods, no router): mean {m:.2f} "
                   f"(target <= 1.10: {'met' if m <= 1.1 else 'NOT met'}), p90 {p:.2f}")
    replayed = next((r for r in at if r.router == REPLAY_KVFLOW), None)
    if oracle and replayed:
        m = replayed.ttft_mean_ms / oracle.ttft_mean_ms
        out.append(f"  on the replay (no machine noise): kvflow default vs oracle, mean {m:.2f}, "
                   f"p90 {replayed.ttft_p90_ms / oracle.ttft_p90_ms:.2f}")
    rr = [r.hit_rate for r in at if r.measured and r.router.replace("_", "-").endswith("round-robin")]
    if rr:
        rr_mean = statistics.mean(rr)
        x = kv.hit_rate / rr_mean if rr_mean else math.inf
        verdict = f" (target >= 3x and <= 1.5: {'met' if x >= 3 and kv.balance <= 1.5 else 'NOT met'})"
        out.append(f"  hit rate {kv.hit_rate:.2f} = {x:.1f}x round-robin's, balance {kv.balance:.2f}"
                   + (verdict if uniform_shared_prefix else ""))
        bound = next((r for r in at if r.router == BOUND and not math.isnan(r.hit_rate)), None)
        if bound and rr_mean:
            out.append(f"  the trace's hit-rate ceiling (every block an earlier request could hold, a hit): "
                       f"{bound.hit_rate:.2f} = {bound.hit_rate / rr_mean:.1f}x round-robin's")
    return "\n".join(out)


CACHE_AWARE_PEERS = ("sglang cache_aware", "vllm-router cache_aware")
"""The peers issue 47's targets compare with: per seed, the better of them on each figure."""


def summary(rows: Sequence[Row]) -> str:
    """Several seeds' runs at round-robin's saturation rate, one line per workload and router:
    the mean over seeds of each figure, and of each seed's ratios to sglang-router ``cache_aware``,
    to the best cache-aware peer and to the oracle, replayed and live (each seed is its own trace,
    so only rows of one seed are compared), with the range over seeds; then the targets on those
    means. A single live run of these traces swings by tens of percent for every router; the mean
    over seeds is the figure to read, the range how far one run can be from it."""
    lines = [
        "| workload | router | seeds | TTFT mean (ms) | TTFT p90 (ms) | TTFT p99 (ms) | pod TTFT (ms) | "
        "mean vs sglang ca (range) | p90 vs sglang ca | mean / p90 vs best ca peer (ranges) | mean vs oracle | "
        "pod TTFT vs oracle | mean vs oracle live | hit rate | balance | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        for router in dict.fromkeys(r.router for r in mine):
            runs = [r for r in mine if r.router == router]
            vs_ref, vs_ref_p90, vs_oracle, pod_vs_oracle, vs_live = [], [], [], [], []
            vs_best, vs_best_p90 = [], []
            for r in runs:
                if math.isnan(r.ttft_mean_ms):  # a run with no answered request has no ratios
                    continue
                same = [o for o in mine if o.seed == r.seed]
                ref = next((o for o in same if o.router == REFERENCE), None)
                oracle = next((o for o in same if o.router == ORACLE), None)
                live = next((o for o in same if o.router == LIVE_ORACLE), None)
                peers = [o for o in same if o.router in CACHE_AWARE_PEERS and o.router != router]
                if live:
                    vs_live.append(r.ttft_mean_ms / live.ttft_mean_ms)
                if ref:
                    vs_ref.append(r.ttft_mean_ms / ref.ttft_mean_ms)
                    vs_ref_p90.append(r.ttft_p90_ms / ref.ttft_p90_ms)
                if peers:
                    vs_best.append(r.ttft_mean_ms / min(o.ttft_mean_ms for o in peers))
                    vs_best_p90.append(r.ttft_p90_ms / min(o.ttft_p90_ms for o in peers))
                if oracle:
                    vs_oracle.append(r.ttft_mean_ms / oracle.ttft_mean_ms)
                    pod_vs_oracle.append(r.pod_ttft_ms / oracle.ttft_mean_ms)
            best = (f"{_mean(vs_best, '.2f')}{_range(vs_best)} / {_mean(vs_best_p90, '.2f')}{_range(vs_best_p90)}"
                    if vs_best else "–")
            lines.append(
                f"| {workload} | {router} | {len(runs)} | {_mean(r.ttft_mean_ms for r in runs)} | "
                f"{_mean(r.ttft_p90_ms for r in runs)} | {_mean(r.ttft_p99_ms for r in runs)} | "
                f"{_mean(r.pod_ttft_ms for r in runs)} | "
                f"{_mean(vs_ref, '.2f')}{_range(vs_ref)} | {_mean(vs_ref_p90, '.2f')} | {best} | {_mean(vs_oracle, '.2f')} | "
                f"{_mean(pod_vs_oracle, '.2f')} | {_mean(vs_live, '.2f')} | {_mean((r.hit_rate for r in runs), '.2f')} | "
                f"{_mean((r.balance for r in runs), '.2f')} | {sum(r.errors for r in runs) if runs[0].measured else '–'} |")
            if router == "kvflow default" and vs_ref and vs_oracle:
                m, p, o = statistics.mean(vs_ref), statistics.mean(vs_ref_p90), statistics.mean(vs_oracle)
                live_verdict = ""
                if vs_live:
                    v = statistics.mean(vs_live)
                    live_verdict = f"; vs oracle (live) {v:.2f} ({'met' if v <= 1.1 else 'NOT met'})"
                verdicts.append(f"  {workload}: vs sglang cache_aware mean {m:.2f}, p90 {p:.2f} (issue 10, <= 0.80: "
                                f"{'met' if max(m, p) <= 0.8 else 'NOT met'}); vs oracle {o:.2f} (<= 1.10: "
                                f"{'met' if o <= 1.1 else 'NOT met'}){live_verdict}")
            if router == "kvflow default" and vs_best:
                m, p = statistics.mean(vs_best), statistics.mean(vs_best_p90)
                verdicts.append(f"  {workload}: vs the best cache-aware peer mean {m:.2f}{_range(vs_best)}, p90 "
                                f"{p:.2f}{_range(vs_best_p90)} (issue 47, <= 0.80 on both: "
                                f"{'met' if max(m, p) <= 0.8 else 'NOT met'})")
    return "\n".join(lines + (["", "targets on the means over seeds:", *verdicts] if verdicts else []))


def _range(values: Sequence[float]) -> str:
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def _mean(values: Iterable[float], fmt: str = ".1f") -> str:
    present = [v for v in values if not math.isnan(v)]
    return format(statistics.mean(present), fmt) if present else "–"


def plot(rows: Sequence[Row], title: str, path: Path) -> None:
    """TTFT mean and p90 against request rate, one line per router; the oracle and the bound
    dashed. Log scale: a saturated router's TTFT grows with the run's length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    routers = list(dict.fromkeys(r.router for r in rows))
    for ax, attr, label in ((axes[0], "ttft_mean_ms", "TTFT mean (ms)"), (axes[1], "ttft_p90_ms", "TTFT p90 (ms)")):
        palette = iter(PALETTE)
        for name in routers:
            pts = sorted((r.rate, getattr(r, attr)) for r in rows if r.router == name)
            style: dict[str, object] = {"linestyle": "-", "linewidth": 1.5}
            if name == "kvflow default":
                style |= {"linewidth": 2.5, "color": "tab:red"}
            elif name not in STYLES:
                style["color"] = next(palette, None)
            style |= STYLES.get(name, {})
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **style)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(rows: Sequence[Row], title: str, path: Path) -> None:
    """Each router's TTFT distribution at one rate (the rows given), as a CDF on a log axis: the
    tail is where routers differ under cache pressure, and the mean hides it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    palette = iter(PALETTE)
    for r in rows:
        if not r.ttfts_ms or r.router == BOUND:
            continue
        xs = sorted(r.ttfts_ms)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        style: dict[str, object] = {"linewidth": 1.5}
        if r.router == "kvflow default":
            style |= {"linewidth": 2.5, "color": "tab:red"}
        elif r.router not in STYLES:
            style["color"] = next(palette, None)
        style |= STYLES.get(r.router, {})
        ax.step(xs, ys, where="post", label=f"{r.router} (p90 {r.ttft_p90_ms:.0f}, p99 {r.ttft_p99_ms:.0f} ms)", **style)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.9, color="grey", linewidth=0.5)
    ax.axhline(0.99, color="grey", linewidth=0.5)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
