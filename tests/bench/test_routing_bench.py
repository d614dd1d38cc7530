"""The routing benchmark's harness measures what it says, on a tiny workload.

Two simulated pods, kvflow's gateway (default profile, then round-robin), kvflow's router behind
a real Envoy, and sglang-router's ``cache_aware`` where it is installed, a few seconds of
open-loop shared-prefix traffic. Every request must be answered in full, the hit rates and the
per-pod counts must come from the pods' own counters, and no router may beat the provable bound.
``bench/bench_routing.py`` runs the real sizes.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from kvbench import oracle, report, routers
from kvbench.pods import Pod
from kvbench.runner import Options, bench_workload, pressured, saturation, words
from kvbench.workloads import SMOKE, Trace, TraceRequest, describe, multi_turn, sim_answer

from kvflow.endpoints import Endpoint
from kvflow.sim.profiles import get_profile


async def test_every_router_answers_everything_and_none_beats_the_bound(tmp_path: Path) -> None:
    names = ["kvflow", "kvflow:round-robin", "kvflow-envoy"] + (["sglang:cache_aware"] if routers.binary("sglang") else [])
    outcome = await bench_workload(SMOKE, names, Options(duration=2.0, rates=(6.0,), settle=0.5, log_dir=tmp_path, verbose=False))

    assert outcome.skipped == []
    measured = {r.router: r for r in outcome.rows if r.measured}
    assert set(measured) == {routers.RouterSpec.parse(n).name for n in names}
    bound = next(r for r in outcome.rows if r.router == report.BOUND)
    for row in measured.values():
        assert row.errors == 0, row
        assert row.requests == bound.requests > 0
        assert sum(row.requests_per_pod) == row.requests, row  # the pods' own request counters
        assert 0 < row.hit_rate <= 1, row  # the pods' prefix-cache counters moved
        assert row.answer_mismatches == 0, row
        assert bound.ttft_mean_ms <= row.ttft_mean_ms and bound.ttft_p90_ms <= row.ttft_p90_ms, (bound, row)
        assert row.itl_ms > 0 and row.tokens_per_s > 0
        # the pods' own histograms: from arrival at the pod, so never more than the client saw
        assert 0 < row.pod_ttft_ms <= row.ttft_mean_ms, row
    # the same groups come back, so a prefix-aware router must hit more than round-robin
    assert measured["kvflow default"].hit_rate > measured["kvflow round-robin"].hit_rate
    assert "kvflow default" in report.table(outcome.rows)
    # each router met pods of its own, started for it: none inherits what another's runs left
    for name in measured:
        pod_logs = list((tmp_path / SMOKE.name / name.replace(" ", "-").replace(":", "-")).glob("pod-*"))
        assert len(pod_logs) == SMOKE.decode_pods, (name, pod_logs)
    # behind Envoy, the router answers Envoy's ext_proc calls: two processes, both counted
    envoy_logs = sorted(p.name for p in (tmp_path / SMOKE.name / "kvflow-envoy-default").glob("*.log"))
    assert [n for n in envoy_logs if not n.startswith("pod-")] == ["envoy.log", "kvflow-router.log"]
    assert measured["kvflow-envoy default"].router_cpu > 0
    png = tmp_path / "smoke.png"
    report.plot(outcome.rows, "smoke", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_router_that_cannot_drive_the_workload_is_skipped_before_its_pods_start(tmp_path: Path) -> None:
    pd_smoke = replace(SMOKE, name="smoke-pd", decode_pods=1, prefill_pods=1)
    outcome = await bench_workload(pd_smoke, ["sglang:cache_aware", "kvflow-envoy"],
                                   Options(duration=1.0, rates=(4.0,), log_dir=tmp_path, verbose=False))

    assert [s.split(":")[0] for s in outcome.skipped] == ["sglang cache_aware", "kvflow-envoy default"]
    assert "bootstrap protocol" in outcome.skipped[0]
    assert "sidecar" in outcome.skipped[1]
    assert not any(r.measured for r in outcome.rows)  # the replays still ran; nothing was measured
    assert list(tmp_path.rglob("pod-*")) == []  # and no pod was started for it


async def test_the_live_oracle_sends_every_request_where_the_replay_placed_it_and_starts_no_router(
    tmp_path: Path,
) -> None:
    outcome = await bench_workload(SMOKE, ["oracle"], Options(duration=2.0, rates=(6.0,), log_dir=tmp_path, verbose=False))

    live = next(r for r in outcome.rows if r.router == report.LIVE_ORACLE)
    replayed = next(r for r in outcome.rows if r.router == report.ORACLE)
    assert live.measured and live.errors == 0 and live.answer_mismatches == 0
    assert live.requests == replayed.requests > 0
    # the pods' own request counters: each pod served exactly the requests the replay put on it
    assert live.requests_per_pod == replayed.requests_per_pod
    assert len(outcome.placements[6.0]) == live.requests and min(outcome.placements[6.0]) >= 0
    assert math.isnan(live.router_cpu)  # nothing stood between the client and the pods
    started = [p.name for p in (tmp_path / SMOKE.name / "oracle-(live)").iterdir()]
    assert len(started) == SMOKE.decode_pods and all(name.startswith("pod-") for name in started)  # pods only
    assert "vs oracle live" in report.table(outcome.rows)

    pd_smoke = replace(SMOKE, name="smoke-pd", decode_pods=1, prefill_pods=1)
    pd = await bench_workload(pd_smoke, ["oracle"], Options(duration=1.0, rates=(4.0,), log_dir=tmp_path, verbose=False))
    assert [s.split(":")[0] for s in pd.skipped] == ["oracle (live)"]  # the replay has no P/D placements


def test_kvflow_behind_envoy_takes_kvflows_profiles_and_points_envoy_at_its_router_and_the_pods(tmp_path: Path) -> None:
    assert routers.RouterSpec.parse("kvflow-envoy").name == "kvflow-envoy default"
    spec = routers.RouterSpec.parse("kvflow-envoy:round-robin")
    assert spec.name == "kvflow-envoy round-robin"
    with pytest.raises(ValueError, match="kvflow profiles"):
        routers.RouterSpec.parse("kvflow-envoy:cache_aware")
    pods = [Pod(Endpoint(f"127.0.0.{i}", 9000), "both", f"tcp://127.0.0.{i}:9100") for i in (2, 3)]

    router, envoy = routers.processes(spec, pods, 8123, tmp_path)  # starts nothing

    assert (router.name, envoy.name) == ("kvflow-router", "envoy")
    args = router.argv[router.argv.index("router") + 1:]
    assert args[args.index("--profile") + 1] == "round-robin" and "--no-secure-serving" in args
    config = json.loads(Path(args[args.index("--config") + 1]).read_text())
    assert [e["kvEvents"] for e in config["pool"]["endpoints"]] == [p.kv_events for p in pods]
    bootstrap = json.loads((tmp_path / "envoy.json").read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 8123
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    addresses = {name: [e["endpoint"]["address"]["socket_address"] for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
                 for name, c in clusters.items() if "load_assignment" in c}
    assert addresses["router"] == [{"address": "127.0.0.1", "port_value": int(args[args.index("--port") + 1])}]
    assert addresses["fallback"] == [{"address": p.endpoint.host, "port_value": 9000} for p in pods]
    assert envoy.argv[1:3] == ["-c", str(tmp_path / "envoy.json")]
    with pytest.raises(ValueError, match="two processes"):
        routers.argv(spec, pods, 8123, tmp_path)


def test_the_pods_are_warmed_with_every_word_of_the_traces_once() -> None:
    traces = [SMOKE.trace(6.0, 2.0, seed) for seed in (0, 1)]
    text = words([*traces, traces[0]])
    said = text.split(" ")
    assert len(said) == len(set(said))
    assert set(said) == {w for t in traces for r in t.requests for w in r.prompt.split()}


def test_the_summary_over_seeds_compares_each_router_with_the_references_of_its_own_seed() -> None:
    def row(router: str, seed: int, mean: float, p90: float, pod: float = math.nan, measured: bool = True,
            p99: float = math.nan) -> report.Row:
        return report.Row("a", router, 10.0, 100, 0, mean, p90, hit_rate=0.5, requests_per_pod=(50, 50),
                          measured=measured, pod_ttft_ms=pod, seed=seed, ttft_p99_ms=p99)

    rows = [
        row(report.ORACLE, 0, 50, 100, measured=False), row(report.ORACLE, 1, 100, 200, measured=False),
        row(report.REFERENCE, 0, 100, 200), row(report.REFERENCE, 1, 400, 800),
        row("vllm-router cache_aware", 0, 80, 300), row("vllm-router cache_aware", 1, 500, 500),
        row("kvflow default", 0, 60, 150, pod=55, p99=300), row("kvflow default", 1, 120, 400, pod=90, p99=500),
        row(report.LIVE_ORACLE, 0, 50, 110), row(report.LIVE_ORACLE, 1, 125, 260),
    ]
    text = report.summary(rows)

    kvflow = next(line for line in text.splitlines() if line.startswith("| a | kvflow default |"))
    cells = [c.strip() for c in kvflow.strip("|").split("|")]
    assert cells[2:7] == ["2", "90.0", "275.0", "400.0", "72.5"]  # plain means over the seeds
    assert cells[7] == "0.45 (0.30-0.60)"  # 60/100 and 120/400: each seed against its own reference
    assert cells[8] == "0.62"  # p90: 150/200 and 400/800
    # the best cache-aware peer, per seed and figure: mean 60/80 and 120/400, p90 150/200 and 400/500
    assert cells[9] == "0.53 (0.30-0.75) / 0.78 (0.75-0.80)"
    assert cells[10:12] == ["1.20", "1.00"]  # vs oracle: 60/50 and 120/100; the pods' own: 55/50 and 90/100
    assert cells[12] == "1.08"  # vs the live oracle: 60/50 and 120/125
    assert "a: vs sglang cache_aware mean 0.45, p90 0.62 (issue 10, <= 0.80: met); vs oracle 1.20 (<= 1.10: " \
           "NOT met); vs oracle (live) 1.08 (met)" in text
    assert "a: vs the best cache-aware peer mean 0.53 (0.30-0.75), p90 0.78 (0.75-0.80) (issue 47, <= 0.80 on " \
           "both: met)" in text


def test_a_cache_pressure_variant_sizes_the_pools_to_a_share_of_the_working_set() -> None:
    trace = SMOKE.trace(20.0, 4.0)
    prepared = oracle.prepare(trace)
    shared = oracle.working_set_blocks(prepared)
    # every system prompt is sent more than once, so its blocks are in the working set; a
    # question sent once is not, and the block holding only a prompt's tail never is
    assert 0 < shared < sum(len(p.hashes) for p in prepared)
    variant = pressured(SMOKE, 0.5, 0, 4.0)
    assert (variant.name, variant.base, variant.kv_fraction) == ("smoke-kv50", "smoke", 0.5)
    whole = oracle.working_set_blocks(oracle.prepare(SMOKE.trace(saturation(SMOKE, 0, 4.0), 4.0, 0)))
    assert variant.num_blocks == max(64, round(0.5 * whole / SMOKE.decode_pods))
    assert "50% of the working set" in describe(variant)
    with pytest.raises(ValueError, match="kv-fraction"):
        pressured(SMOKE, 0.0, 0, 4.0)


def test_the_cdf_plot_draws_every_router_that_has_requests(tmp_path: Path) -> None:
    rows = [report.Row("a", name, 10.0, 3, 0, 2.0, 3.0, ttft_p99_ms=3.0, ttfts_ms=(1.0, 2.0, 3.0))
            for name in ("kvflow default", report.REFERENCE, report.ORACLE)]
    png = tmp_path / "cdf.png"
    report.plot_cdf(rows, "a", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_replay_oracle_never_beats_the_bound_and_round_robin_spreads_evenly() -> None:
    profile = get_profile("h100-llama8b")
    trace = SMOKE.trace(20.0, 4.0)
    prepared = oracle.prepare(trace)
    bounds = oracle.lower_bound(trace, profile, prepared)
    rr = oracle.replay(trace, oracle.RoundRobin(), pods=2, profile=profile, num_blocks=300, prepared=prepared)
    greedy = oracle.replay(trace, oracle.Clairvoyant(), pods=2, profile=profile, num_blocks=300, prepared=prepared)
    best, _ = oracle.oracle_replay(trace, pods=2, profile=profile, num_blocks=300, prepared=prepared)
    for result in (rr, greedy, best):
        assert not any(math.isnan(t) for t in result.ttft)
        assert all(t >= b - 1e-9 for t, b in zip(result.ttft, bounds, strict=True))
    assert abs(rr.requests_per_pod[0] - rr.requests_per_pod[1]) <= 1
    assert rr.hit_rate <= best.hit_rate <= oracle.hit_ceiling(trace, prepared)
    assert greedy.hit_rate <= oracle.hit_ceiling(trace, prepared)
    assert sum(best.ttft) <= min(sum(rr.ttft), sum(greedy.ttft))


def test_the_hit_rate_ceiling_counts_what_earlier_requests_hold_but_never_a_prompts_last_block() -> None:
    shared = " ".join(f"w{i}" for i in range(40))  # 41 tokens with BOS: 2 full blocks before the last token's
    first = TraceRequest(0, 0.0, shared, 4, 0, "g")
    again = TraceRequest(1, 1.0, shared, 4, 1, "g")
    longer = TraceRequest(2, 2.0, shared + " " + " ".join(f"x{i}" for i in range(40)), 4, 2, "g")
    alone = TraceRequest(3, 3.0, " ".join(f"y{i}" for i in range(40)), 4, 3, "h")
    trace = Trace("shared-prefix", 1.0, 4.0, (first, again, longer, alone))
    prepared = oracle.prepare(trace)

    # the first of a prefix hits nothing; the same prompt again all but its last block (vLLM
    # computes at least one token); a longer prompt the two full blocks the others hold
    assert oracle.hittable_blocks(trace, prepared) == [0, 2, 2, 0]
    assert oracle.hit_ceiling(trace, prepared) == (2 + 2) * 16 / (41 + 41 + 81 + 41)


def test_a_multi_turn_history_carries_the_answers_the_simulator_will_give() -> None:
    trace = multi_turn(2.0, 3.0, turns=3, systems=1, system_len=20, user_len=(5, 5), output_len=4)
    first, second = trace.requests[0], trace.requests[1]
    assert second.after == first.index
    assert first.answer == sim_answer(first.seed, 4) and len(first.answer.split()) == 4
    assert second.prompt.startswith(first.prompt + first.answer + " ")


class _RefuseOdd(oracle.RoundRobin):
    """Round-robin that refuses every odd request, as a router answering 429 would."""

    def pick(self, prepared, pods, now, profile):  # type: ignore[no-untyped-def]
        return None if prepared.request.index % 2 else super().pick(prepared, pods, now, profile)


def test_a_request_the_router_refuses_counts_as_an_error_in_the_replay() -> None:
    profile = get_profile("h100-llama8b")
    trace = SMOKE.trace(20.0, 2.0)
    result = oracle.replay(trace, _RefuseOdd(), pods=2, profile=profile, num_blocks=300)
    refused = [i for i, t in enumerate(result.ttft) if math.isnan(t)]
    assert refused and all(i % 2 for i in refused)
    assert sum(result.requests_per_pod) == len(trace.requests) - len(refused)
    row = report.replay_row("smoke", "refusing", trace.rate, result.ttft)
    assert row.errors == len(refused)


def test_the_oracle_counts_the_chunk_a_running_step_computes_once() -> None:
    """A pod mid-step: the step ends at ``step_end`` with its chunk computed. A request sent now
    waits for that end, then computes its own prompt beside the first one's decode; the chunk in
    flight is not queued ahead of it a second time."""
    profile = get_profile("h100-llama8b")
    trace = SMOKE.trace(20.0, 4.0)
    prepared = oracle.prepare(trace)
    first, new = prepared[0], next(p for p in prepared if p.hashes[0] != prepared[0].hashes[0])
    pod = oracle.new_pod(0, profile, num_blocks=300)
    pod.scheduler.add(oracle.sim_request(first, 0.0))
    pod.plan = plan = pod.scheduler.schedule(0.0)
    assert plan.prefill_tokens == len(first.token_ids)  # the whole prompt in this one step
    pod.step_end = profile.step_seconds(0, 0, plan.prefill_tokens)
    now = pod.step_end / 2
    after = profile.step_seconds(1, len(first.token_ids), len(new.token_ids))  # its prompt, the first's decode
    got = oracle.Clairvoyant().estimate(new, pod, now, profile)
    assert math.isclose(got, pod.step_end - now + after)


class _Heard(oracle.RoundRobin):
    """Round-robin that writes down what a learning router hears, and when."""

    scrape_interval = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.picked: dict[int, float] = {}
        self.heard: list[tuple[str, int, float]] = []

    def pick(self, prepared, pods, now, profile):  # type: ignore[no-untyped-def]
        self.picked[prepared.request.index] = now
        return super().pick(prepared, pods, now, profile)

    def first_token(self, index: int, now: float) -> None:
        self.heard.append(("first", index, now))

    def finished(self, index: int, now: float) -> None:
        self.heard.append(("finished", index, now))

    def stepped(self, pod, now):  # type: ignore[no-untyped-def]
        pod.scheduler.pool.take_events()

    def scraped(self, pod, now):  # type: ignore[no-untyped-def]
        pass


def test_with_a_lag_requests_reach_the_pods_late_and_the_router_hears_back_late() -> None:
    profile = get_profile("h100-llama8b")
    trace = SMOKE.trace(20.0, 2.0)
    prepared = oracle.prepare(trace)
    plain = oracle.replay(trace, _Heard(), pods=2, profile=profile, num_blocks=300, prepared=prepared)
    heard = _Heard()
    lag = oracle.Lag(to_pod=0.004, from_pod=0.005)
    lagged = oracle.replay(trace, heard, pods=2, profile=profile, num_blocks=300, prepared=prepared, lag=lag)
    # TTFT counts from the pod's engine: these few requests never queue, so the lag changes nothing there
    assert all(math.isclose(a, b) for a, b in zip(plain.ttft, lagged.ttft, strict=True))
    for i, at in heard.picked.items():
        said = {kind: t for kind, j, t in heard.heard if j == i}
        assert math.isclose(said["first"], at + 0.004 + lagged.ttft[i] + 0.005)
        assert said["finished"] >= said["first"]


class _RefuseFirstTurns(_Heard):
    """Refuses every other conversation's first turn, and scrapes (so an unended replay would
    never stop)."""

    scrape_interval = 0.1

    def pick(self, prepared, pods, now, profile):  # type: ignore[no-untyped-def]
        if prepared.request.after is None and prepared.request.index % 2:
            return None
        return super().pick(prepared, pods, now, profile)


def test_a_refused_conversation_ends_the_replay_without_its_later_turns() -> None:
    """The later turns of a refused first turn are never sent: the replay must not wait for them
    (it scraped the idle pods for ever)."""
    trace = multi_turn(4.0, 3.0, turns=3, systems=1, system_len=20, user_len=(5, 5), output_len=4)
    result = oracle.replay(trace, _RefuseFirstTurns(), pods=2, profile=get_profile("h100-llama8b"), num_blocks=300)
    children = trace.children()
    unsent = {children[i] for i, t in enumerate(result.ttft) if math.isnan(t) and i in children}
    assert unsent and all(math.isnan(result.ttft[i]) for i in unsent)
