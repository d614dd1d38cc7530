"""``--warmup``: a run's first seconds of arrivals fill the caches and count in no figure.

The same trace shape and rate run for warm-up + duration; every figure of the routing benchmark
and of the replay (TTFT, hit rates, requests per pod, throughput) is then of the requests sent
at or after the warm-up only (``workloads.after_warmup``), live (``loadgen.Run.counted``, the
pods' counters read when it ends) and replayed (``oracle.ReplayResult.since``) alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from bench_routing import main as bench_routing_main
from kvbench import loadgen, oracle, report
from kvbench.loadgen import Result, Run
from kvbench.pods import Counters
from kvbench.runner import replay_rows
from kvbench.workloads import SMOKE, Trace, TraceRequest, after_warmup
from replay_policy import replayed

from kvflow.sim.profiles import get_profile

PROFILE = get_profile("h100-llama8b")
SMOKE_CPU = replace(SMOKE, name="smoke-cpu", num_blocks=120, cpu_blocks=2000)
"""Pods too small for the smoke workload's prefixes, with a CPU tier that holds them all."""


def test_a_warmed_trace_runs_warmup_plus_duration_at_the_same_rate_and_says_so() -> None:
    plain, warmed = SMOKE.trace(10.0, 2.0, seed=1), SMOKE.trace(10.0, 2.0, seed=1, warmup=3.0)

    assert plain.warmup == 0.0 and SMOKE.trace(10.0, 2.0, seed=1, warmup=0.0) == plain  # default: unchanged
    assert warmed.warmup == 3.0 and warmed.duration == 5.0
    assert max(r.at for r in warmed.requests) < 5.0
    assert any(r.at < 3.0 for r in warmed.requests) and any(r.at >= 3.0 for r in warmed.requests)


def test_only_requests_sent_at_or_after_the_warmup_count_and_every_one_without_it() -> None:
    assert after_warmup(3.0, 3.0) and after_warmup(4.5, 3.0) and not after_warmup(2.999, 3.0)
    assert after_warmup(0.0, 0.0) and after_warmup(math.nan, 0.0)  # no warm-up: every request, as before
    assert not after_warmup(math.nan, 3.0)  # never sent


def _counters(requests: float, hits: float, queries: float) -> Counters:
    return Counters(requests=requests, prefix_hits=hits, prefix_queries=queries, ttft_sum=0.0, ttft_count=0.0,
                    external_hits=0.0)


def test_a_measured_row_is_of_the_requests_sent_after_the_warmup() -> None:
    def result(i: int, sent: float, ttft: float) -> Result:
        return Result(i, scheduled=sent, sent=sent, first=sent + ttft, last=sent + ttft + 0.1, chunks=2, tokens=4)

    warm = [result(0, 0.1, 5.0), result(1, 0.5, 5.0)]  # cold prefills: no figure may show them
    steady = [result(2, 1.0, 0.2), result(3, 1.4, 0.4), replace(result(4, 1.8, 0.3), error="HTTP 500: boom")]
    run = Run(tuple(warm + steady), wall=2.5, cpu=0.1, warmup=1.0)
    # ``before``: the pods' counters when the warm-up ended (``runner.measure`` reads them then)
    row = report.measured_row("w", "r", 2.0, run, [_counters(2, 0, 200)], [_counters(5, 150, 500)], [0],
                              router_cpu=0.1, load_avg=0.0)

    assert [r.index for r in run.counted] == [2, 3, 4]
    assert row.requests == 3 and row.errors == 1 and row.warmup_s == 1.0
    assert row.ttft_mean_ms == pytest.approx(300.0) and row.ttft_p90_ms == pytest.approx(400.0)
    assert row.ttfts_ms == (200.0, 400.0)
    assert row.hit_rate == pytest.approx(0.5) and row.requests_per_pod == (3,)
    assert row.tokens_per_s == pytest.approx(8 / (1.4 + 0.5 - 1.0))  # the counted requests' tokens over their span


async def test_the_load_generator_marks_the_end_of_the_warmup_after_the_requests_before_it() -> None:
    sent_by_then: list[int] = []
    arrived: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        arrived.append((await request.json())["seed"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"choices": [{"text": "a"}]}).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 1}}).encode() + b"\n\n")
        return resp

    async def warmed() -> None:
        sent_by_then.append(len(arrived))

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    trace = Trace("t", 10.0, 0.3, tuple(TraceRequest(i, at, "hi", 1, i, "g") for i, at in enumerate((0.0, 0.05, 0.2, 0.25))),
                  warmup=0.15)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        run = await loadgen.run(str(server.make_url("/v1/completions")), trace, model="m", on_warm=warmed)
        unwarmed = await loadgen.run(str(server.make_url("/v1/completions")), replace(trace, warmup=0.0), model="m",
                                     on_warm=warmed)
    finally:
        await server.close()

    assert loadgen.errors(run.results) == []
    assert sent_by_then == [2]  # once, with the two warm-up requests sent and the others not; never without a warm-up
    assert run.warmup == 0.15 and [r.index for r in run.counted] == [2, 3]
    assert unwarmed.warmup == 0.0 and len(unwarmed.counted) == 4


def test_a_replay_since_the_warmup_keeps_the_requests_sent_after_it_and_their_hits() -> None:
    trace = SMOKE_CPU.trace(12.0, 2.0, warmup=2.0)
    full = oracle.replay(trace, oracle.RoundRobin(), pods=2, profile=PROFILE, num_blocks=SMOKE_CPU.num_blocks,
                         cpu_blocks=SMOKE_CPU.cpu_blocks)
    after = full.since(trace.warmup)
    counted = [r.index for r in trace.requests if r.at >= trace.warmup]  # no follow-ups: each sent at its time

    assert full.since(0.0) is full
    assert len(after.ttft) == len(after.sent) == len(after.placements) == len(counted) > 0
    assert after.ttft == tuple(full.ttft[i] for i in counted)
    assert sum(after.requests_per_pod) == len(counted) < sum(full.requests_per_pod)
    # every request's own lookup adds up to the pods' prefix-cache counters
    everything = full.since(-1.0)
    assert everything.hit_rate == pytest.approx(full.hit_rate) and everything.reload_rate == pytest.approx(full.reload_rate)
    # after the warm-up the prefixes are on the pods (GPU, or CPU tier) and the cold first sightings are gone
    assert after.hit_rate + after.reload_rate > full.hit_rate + full.reload_rate
    assert oracle.mean_ttft(after.ttft) < oracle.mean_ttft(full.ttft)


def test_the_benchmarks_replay_rows_count_after_the_warmup_and_the_oracle_places_every_request() -> None:
    trace = SMOKE_CPU.trace(12.0, 2.0, warmup=2.0)
    rows, placements = replay_rows(SMOKE_CPU, trace)
    counted = sum(r.at >= trace.warmup for r in trace.requests)

    assert len(placements) == len(trace.requests) and min(placements) >= 0  # the live oracle sends them all
    by_name = {r.router: r for r in rows}
    for name in (report.ORACLE, report.REPLAY_RR, report.REPLAY_KVFLOW):
        assert by_name[name].requests == counted and by_name[name].warmup_s == 2.0
        assert sum(by_name[name].requests_per_pod) == counted


def test_replay_policy_figures_with_a_warmup_are_of_the_steady_state() -> None:
    cold, = replayed(SMOKE_CPU, [0], 1, oracle.Lag(), duration=2.0, rates=[12.0])
    warm, = replayed(SMOKE_CPU, [0], 1, oracle.Lag(), duration=2.0, rates=[12.0], warmup=2.0)

    for row in (cold, warm):
        assert len(row.kvflow) == len(row.oracle) == len(row.ratios) == 1
    assert warm.oracle[0].mean_ms < cold.oracle[0].mean_ms
    assert warm.oracle[0].hit_rate + warm.oracle[0].cpu_rate > cold.oracle[0].hit_rate + cold.oracle[0].cpu_rate


def test_a_negative_warmup_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_routing_main(["--workloads", "e", "--warmup", "-1"])
    assert "--warmup cannot be negative" in capsys.readouterr().err
