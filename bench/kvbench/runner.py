"""One workload of the routing benchmark, end to end: rates, oracle, pods, routers, runs, rows.

For each workload: find where round-robin saturates on the replay (unless rates are given),
replay every rate's trace offline (round-robin, the oracle, kvflow's router, the bound), then,
for each router in turn, start fresh pods (warmed alike: their tokenizers have seen the traces'
words, not their prompts) and the router (kvflow's tokenizer, in its gateway or behind Envoy, warmed the same way),
and per rate drain and reset the pods' caches, send
the trace open-loop and read the pods' counters before and after. The live oracle starts no
router: its client sends each request to the pod the oracle's replay placed it on. A router
with several replicas (``kvflow:x3``) gets the requests spread round-robin over its gateways
(request ``i`` to replica ``i mod N``), or behind Envoy over its pickers by Envoy itself; each
replica's router counts its own decisions, read before and after each run.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvflow.local.procs import ProcessGroup, StartupError
from kvflow.sim.profiles import get_profile

from kvbench import loadgen, oracle, pods as podlib, report, routers
from kvbench.replay_kvflow import KvflowReplay
from kvbench.workloads import Trace, Workload, describe

SIM_PROFILE = "h100-llama8b"


@dataclass(frozen=True, slots=True)
class Options:
    duration: float = 20.0
    warmup: float = 0.0
    """Seconds of arrivals before ``duration``, at the same rate, that count in no figure."""
    factors: tuple[float, ...] = (0.5, 0.75, 1.0, 1.25)
    """Rates as multiples of the replay's round-robin saturation rate."""
    rates: tuple[float, ...] = ()
    """Explicit rates instead (no saturation search; the targets are read at the highest)."""
    seed: int = 0
    settle: float = 1.0
    """Seconds a freshly started router gets before traffic (first scrapes, KV-event subscriptions)."""
    log_dir: Path = Path(".kvflow/bench-routing-logs")
    verbose: bool = True
    kvflow_config: Mapping[str, Any] | None = None
    """The kvflow rows' router config, as ``kvflow operator render`` of an LLMService gives it
    (``--llmservice``); None: the router's defaults, as ``make up`` runs it."""


@dataclass(slots=True)
class Outcome:
    workload: Workload
    saturation: float
    rates: tuple[float, ...]
    rows: list[report.Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seed: int = 0
    warmup: float = 0.0
    """Seconds of each run's arrivals before its figures count (``Options.warmup``)."""
    placements: dict[float, tuple[int, ...]] = field(default_factory=dict)
    """Per rate, the pod the oracle's replay sent each request to (what the live oracle sends)."""
    decisions: dict[str, dict[float, tuple[int, ...]]] = field(default_factory=dict)
    """Per kvflow row and rate, the decisions each of its routers (gateway replicas, or pickers
    behind Envoy) took in the run, from their own ``kvflow_router_decisions`` counters."""


def log(opts: Options, msg: str) -> None:
    if opts.verbose:
        print(msg, file=sys.stderr, flush=True)


def plan_rates(workload: Workload, opts: Options) -> tuple[float, tuple[float, ...]]:
    """(round-robin's saturation rate on the replay, the rates to run); explicit rates skip the
    search (NaN)."""
    if opts.rates:
        return math.nan, tuple(sorted(opts.rates))
    sat = saturation(workload, opts.seed, opts.duration)
    return sat, tuple(round(sat * f, 1) for f in opts.factors)


def saturation(workload: Workload, seed: int, duration: float) -> float:
    """Round-robin's saturation rate on the replay of the workload's trace, to 0.1 request/s."""
    # P/D: prefill is the bottleneck, so round-robin over as many aggregated pods as prefill pods
    pods = workload.prefill_pods or workload.decode_pods
    sat = oracle.saturation_rate(lambda r, d: workload.trace(r, d, seed), duration, pods=pods,
                                 profile=get_profile(SIM_PROFILE), num_blocks=workload.num_blocks,
                                 cpu_blocks=workload.cpu_blocks)
    return round(sat, 1)


def pressured(workload: Workload, fraction: float, seed: int, duration: float) -> Workload:
    """The cache-pressure variant of ``workload``: pools that hold ``fraction`` of the working set
    (``oracle.working_set_blocks``) of its trace at round-robin's saturation rate on its own pools,
    named ``<name>-kv<percent>``. Its rates are then searched again on the smaller pools."""
    if not 0 < fraction <= 4:
        raise ValueError(f"--kv-fraction takes a fraction of the working set in (0, 4], got {fraction:g}")
    rate = saturation(workload, seed, duration)
    blocks = oracle.working_set_blocks(oracle.prepare(workload.trace(rate, duration, seed)))
    pods = workload.decode_pods
    return replace(workload, name=f"{workload.name}-kv{round(fraction * 100)}", base=workload.base or workload.name,
                   kv_fraction=fraction, num_blocks=max(64, round(fraction * blocks / pods)))


def replay_rows(workload: Workload, trace: Trace) -> tuple[list[report.Row], tuple[int, ...]]:
    """The replay's rows for one trace, and the oracle's placements (none with P/D)."""
    profile = get_profile(SIM_PROFILE)
    prepared = oracle.prepare(trace)
    hits = oracle.hittable_blocks(trace, prepared)
    ceiling = math.nan if workload.pd else oracle.hit_ceiling(trace, prepared, hits)  # P/D pods count twice
    rows = [report.replay_row(workload.name, report.BOUND, trace.rate, oracle.lower_bound(trace, profile, prepared, hits),
                              hit_rate=ceiling)]
    if workload.pd:  # the replay models aggregated pods only
        return rows, ()
    best, _ = oracle.oracle_replay(trace, pods=workload.decode_pods, profile=profile,
                                   num_blocks=workload.num_blocks, prepared=prepared, cpu_blocks=workload.cpu_blocks)
    results = [(report.ORACLE, best)]  # the oracle's placements are every request's, the warm-up's too
    for policy, name in ((oracle.RoundRobin(), report.REPLAY_RR),
                         (KvflowReplay(workload.decode_pods, workload.num_blocks), report.REPLAY_KVFLOW)):
        results.append((name, oracle.replay(trace, policy, pods=workload.decode_pods, profile=profile,
                                            num_blocks=workload.num_blocks, prepared=prepared,
                                            cpu_blocks=workload.cpu_blocks)))
    for name, res in results:
        res = res.since(trace.warmup)
        rows.append(report.replay_row(workload.name, name, trace.rate, res.ttft, hit_rate=res.hit_rate,
                                      requests_per_pod=res.requests_per_pod, warmup=trace.warmup))
    return rows, best.placements


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live descendants, from /proc."""
    total, stack = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


async def measure(workload: Workload, spec: routers.RouterSpec, url: str | Sequence[str], pids: Sequence[int],
                  trace: Trace, fleet: Sequence[podlib.Pod], opts: Options) -> report.Row:
    """One run of ``trace`` sent to ``url`` (one URL per request: the live oracle's placements, or
    a router's replicas in turn), and its row; ``pids``: the router's processes, whose CPU is
    counted, every replica's (none: no router)."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await podlib.wait_idle(session, fleet)
        await podlib.reset(session, fleet)
        before = await podlib.counters(session, fleet)
        cpu0, t0 = [proc_cpu_seconds(pid) for pid in pids], time.monotonic()

        async def warmed() -> None:  # the figures count from here: the pods' counters, the router's CPU
            nonlocal before, cpu0, t0
            before, cpu0, t0 = await podlib.counters(session, fleet), [proc_cpu_seconds(p) for p in pids], time.monotonic()

        run = await loadgen.run(url, trace, model=podlib.MODEL, on_warm=warmed)
        elapsed = time.monotonic() - t0
        shares = [(proc_cpu_seconds(pid) - c) / elapsed for pid, c in zip(pids, cpu0, strict=True)]
        router_cpu = sum(shares) if pids else math.nan
        load_avg = os.getloadavg()[0]
        if not await podlib.wait_idle(session, fleet):
            log(opts, f"  warning: pods still busy 60 s after {spec.name}'s run; its counters may miss requests")
        await asyncio.sleep(0.3)  # counters of the last finished requests
        after = await podlib.counters(session, fleet)
    decode = [i for i, p in enumerate(fleet) if p.role != "prefill"]
    row = report.measured_row(workload.name, spec.name, trace.rate, run, before, after, decode,
                              router_cpu=router_cpu, load_avg=load_avg)
    errs = loadgen.errors(run.results)
    log(opts, f"  {spec.name} @ {trace.rate:g} req/s: TTFT mean {row.ttft_mean_ms:.0f} ms p90 {row.ttft_p90_ms:.0f} "
              f"hit {row.hit_rate:.2f} balance {row.balance:.2f} errors {row.errors}"
              + (f" (first: {errs[0]})" if errs else ""))
    if len(shares) > 1:  # which of the router's processes used it: pickers, then Envoy
        log(opts, f"  {spec.name} CPU per process, in start order: {', '.join(f'{s:.0%}' for s in shares)}")
    return row


async def router_decisions(session: aiohttp.ClientSession, urls: Sequence[str]) -> tuple[int, ...]:
    """Each router's decisions so far (``kvflow_router_decisions_total`` at its ``/metrics``)."""
    async def one(url: str) -> int:
        async with session.get(url) as resp:
            text = await resp.text()
        return int(sum(s.value for family in text_string_to_metric_families(text) if family.name == "kvflow_router_decisions"
                       for s in family.samples if s.name.endswith("_total")))

    return tuple(await asyncio.gather(*(one(u) for u in urls)))


def spread(urls: Sequence[str], requests: int) -> str | list[str]:
    """Where each request goes: the one URL, or request ``i`` to ``urls[i mod N]`` (round-robin
    by the trace's order, so a session's turns may meet different replicas, as behind a Service)."""
    if len(urls) == 1:
        return urls[0]
    return [urls[i % len(urls)] for i in range(requests)]


async def bench_workload(workload: Workload, router_names: Sequence[str], opts: Options) -> Outcome:
    saturation, rates = await asyncio.to_thread(plan_rates, workload, opts)
    outcome = Outcome(workload, saturation, rates, seed=opts.seed, warmup=opts.warmup)
    found = f"round-robin saturates near {saturation:g} req/s on the replay" if saturation == saturation else "given"
    log(opts, f"workload {workload.name} ({describe(workload)}): {found}; rates {', '.join(map(str, rates))}")
    traces = {rate: workload.trace(rate, opts.duration, opts.seed, opts.warmup) for rate in rates}
    if opts.warmup:
        log(opts, f"  warm-up {opts.warmup:g} s at each rate: only requests sent after it count")
    for rate, trace in traces.items():
        rows, outcome.placements[rate] = await asyncio.to_thread(replay_rows, workload, trace)
        outcome.rows += rows
    specs = [routers.RouterSpec.parse(n) for n in router_names]
    vocabulary = words(traces.values())
    for spec in specs:
        try:  # before its pods start: a router that cannot run here costs nothing
            await asyncio.to_thread(routers.check, spec, workload.prefill_pods)
        except routers.Skip as exc:
            outcome.skipped.append(f"{spec.name}: {exc}")
            log(opts, f"  skipping {spec.name}: {exc}")
            continue
        # Fresh pods for every router, warmed alike: pods that served an earlier router's runs
        # have tokenized its prompts before (the simulator's tokenizer remembers words and text
        # chunks), which shortens the path of whichever router runs second. kvflow's
        # gateway, or its router behind Envoy, runs the same tokenizer: warmed so once it is up.
        log_dir = opts.log_dir / workload.name / spec.name.replace(" ", "-").replace(":", "-")
        with ProcessGroup(log_dir) as group:
            fleet = await asyncio.to_thread(podlib.start_pods, group, decode=workload.decode_pods,
                                            prefill=workload.prefill_pods, num_blocks=workload.num_blocks,
                                            profile=SIM_PROFILE, extra=offload_args(workload),
                                            kv_events=spec.kv_events)
            await podlib.warm(fleet, vocabulary)
            if spec.kind == routers.ORACLE:
                for rate in rates:
                    assert min(outcome.placements[rate], default=0) >= 0, "the oracle places every request"
                    urls = [f"{fleet[pod].url}/v1/completions" for pod in outcome.placements[rate]]
                    outcome.rows.append(await measure(workload, spec, urls, [], traces[rate], fleet, opts))
                continue
            try:
                stack = routers.stack(spec, fleet, log_dir, opts.kvflow_config)
            except routers.Skip as exc:
                outcome.skipped.append(f"{spec.name}: {exc}")
                log(opts, f"  skipping {spec.name}: {exc}")
                continue
            procs = stack.processes
            children = [group.start(p.name, p.argv, ready_url=p.ready_url) for p in procs]
            try:
                await asyncio.to_thread(group.wait_ready, 120, children)
            except StartupError as exc:
                outcome.skipped.append(f"{spec.name}: did not start: {str(exc)[:300]}")
                log(opts, f"  skipping {spec.name}: did not start: {exc}")
                continue
            # kvflow's router tokenizes with the pods' tokenizer: warmed as they are
            await podlib.warm_urls([p.tokenizer_url for p in procs if p.tokenizer_url], vocabulary)
            await asyncio.sleep(opts.settle)
            counted = [p.metrics_url for p in procs if p.metrics_url]
            for rate in rates:
                urls = spread([f"{u}/v1/completions" for u in stack.urls], len(traces[rate].requests))
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                    before = await router_decisions(session, counted)
                    outcome.rows.append(await measure(workload, spec, urls, [c.popen.pid for c in children],
                                                      traces[rate], fleet, opts))
                    decided = tuple(a - b for a, b in zip(await router_decisions(session, counted), before, strict=True))
                if decided:
                    outcome.decisions.setdefault(spec.name, {})[rate] = decided
                    if len(decided) > 1:
                        log(opts, f"  {spec.name} @ {rate:g} req/s: decisions per replica {'/'.join(map(str, decided))}")
    outcome.rows = [replace(r, seed=opts.seed) for r in outcome.rows]
    return outcome


def offload_args(workload: Workload) -> tuple[str, ...]:
    """The pods' ``--kv-offloading-size`` for the workload's CPU tier (none without one): the
    GiB that holds exactly ``cpu_blocks`` of the profile's blocks."""
    if not workload.cpu_blocks:
        return ()
    block_bytes = oracle.HASH.block_size * get_profile(SIM_PROFILE).kv_bytes_per_token
    gib = (workload.cpu_blocks * block_bytes + block_bytes // 2) / (1 << 30)
    return ("--kv-offloading-size", repr(gib), "--kv-offloading-backend", "native")


def words(traces: Iterable[Trace]) -> str:
    """Every distinct word of the traces' prompts, once: what warms a pod's tokenizer."""
    return " ".join(sorted({w for trace in traces for r in trace.requests for w in r.prompt.split()}))


def saturation_row_rate(outcome: Outcome) -> float:
    """The measured rate closest to the saturation rate (the targets are read there)."""
    if math.isnan(outcome.saturation):
        return max(outcome.rates)
    return min(outcome.rates, key=lambda r: (abs(r - outcome.saturation), -r))
