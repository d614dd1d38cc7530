"""``kvflow bench routing --replicas N``: kvflow's rows run N routers, each deciding its share.

Live on the tiny SMOKE workload (two simulated pods, two seconds of traffic): two gateways the
client spreads requests over round-robin, and two ``kvflow router`` pickers behind one real
Envoy. Each replica's own ``kvflow_router_decisions`` counter says it routed requests; the rows
are named for their replicas. Without KV events, the pods publish none and the router is told so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvbench import report, routers
from kvbench.pods import Pod
from kvbench.runner import Options, bench_workload, spread
from kvbench.workloads import SMOKE

from bench_routing import parser, replica_lines, row_spelling
from kvflow.endpoints import Endpoint
from kvflow.router.config import load_config


async def test_two_replicas_each_route_their_share_and_the_rows_say_so(tmp_path: Path) -> None:
    names = routers.with_replicas(["kvflow", "kvflow-envoy"], [2])
    outcome = await bench_workload(SMOKE, names, Options(duration=2.0, rates=(6.0,), settle=0.5, log_dir=tmp_path,
                                                         verbose=False))

    assert outcome.skipped == []
    measured = {r.router: r for r in outcome.rows if r.measured}
    assert set(measured) == {"kvflow default x2", "kvflow-envoy default x2"}
    bound = next(r for r in outcome.rows if r.router == report.BOUND)
    for row in measured.values():
        assert row.errors == 0 and row.answer_mismatches == 0, row
        assert row.requests == bound.requests == sum(row.requests_per_pod) > 0, row
        assert row.router_cpu > 0, row
    # the client sends request i to gateway i mod 2: each decides its half, no more
    first, second = outcome.decisions["kvflow default x2"][6.0]
    assert first > 0 and second > 0 and first + second == bound.requests
    assert abs(first - second) <= 1
    # behind Envoy, Envoy spreads the ext_proc streams: both pickers decide
    pickers = outcome.decisions["kvflow-envoy default x2"][6.0]
    assert len(pickers) == 2 and min(pickers) > 0 and sum(pickers) == bound.requests
    logs = {name: sorted(p.name for p in (tmp_path / SMOKE.name / name.replace(" ", "-")).glob("*.log")
                         if not p.name.startswith("pod-"))
            for name in measured}
    assert logs == {"kvflow default x2": ["kvflow-default-x2-1.log", "kvflow-default-x2-2.log"],
                    "kvflow-envoy default x2": ["envoy.log", "kvflow-router-1.log", "kvflow-router-2.log"]}
    assert "kvflow default x2" in report.table(outcome.rows)


def test_replicas_multiply_the_kvflow_rows_and_leave_the_peers_single() -> None:
    args = parser().parse_args(["--routers", "kvflow", "kvflow:no-events", "kvflow-envoy:x2", "sglang:cache_aware",
                                "--replicas", "1", "3"])
    names = routers.with_replicas(args.routers, args.replicas)

    assert names == ["kvflow", "kvflow:x3", "kvflow:no-events", "kvflow:no-events:x3", "kvflow-envoy:x2",
                     "sglang:cache_aware"]
    assert [routers.RouterSpec.parse(n).name for n in names] == [
        "kvflow default", "kvflow default x3", "kvflow default no-events", "kvflow default no-events x3",
        "kvflow-envoy default x2", "sglang cache_aware"]
    assert "kvflow-envoy" in parser().parse_args([]).routers  # the default run has the Envoy row
    assert routers.RouterSpec.parse("kvflow").headline and not routers.RouterSpec.parse("kvflow:x3").headline
    with pytest.raises(ValueError, match="one process"):
        routers.RouterSpec.parse("sglang:x3")
    assert spread(["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"] and spread(["a"], 3) == "a"


def test_without_kv_events_the_router_is_told_the_pods_publish_none(tmp_path: Path) -> None:
    spec = routers.RouterSpec.parse("kvflow:no-events:x2")
    pods = [Pod(Endpoint(f"127.0.0.{i}", 9000), "both", "") for i in (2, 3)]

    built = routers.stack(spec, pods, tmp_path, ports=[8123, 8124])  # starts nothing

    assert built.urls == ("http://127.0.0.1:8123", "http://127.0.0.1:8124")
    assert [p.name for p in built.processes] == ["kvflow-default-no-events-x2-1", "kvflow-default-no-events-x2-2"]
    args = built.processes[1].argv
    assert args[args.index("--port") + 1] == "8124"
    config = json.loads(Path(args[args.index("--router-config") + 1]).read_text())
    assert config["kvEvents"] == {"enabled": False}
    assert all("kvEvents" not in e for e in config["pool"]["endpoints"])
    with pytest.raises(ValueError, match="2 ports"):
        routers.stack(spec, pods, tmp_path, ports=[8123])


def test_replicas_tell_each_other_what_they_routed_unless_the_row_says_no_peers(tmp_path: Path) -> None:
    """As the operator renders replicas > 1: each with its own peers port, the others' addresses
    and one shared key; ``no-peers`` and a single replica have no peers section."""
    pods = [Pod(Endpoint(f"127.0.0.{i}", 9000), "both", "") for i in (2, 3)]

    def peers(spelling: str) -> list[object]:
        built = routers.stack(routers.RouterSpec.parse(spelling), pods, tmp_path / spelling)
        configs = [json.loads(Path(p.argv[p.argv.index("--router-config") + 1]).read_text()) for p in built.processes]
        return [load_config(c).peers if "peers" in c else None for c in configs]

    three = peers("kvflow:no-events:x3")
    assert all(p is not None for p in three)
    own = [f"127.0.0.1:{p.port}" for p in three]  # type: ignore[union-attr]
    assert [sorted(p.addresses) for p in three] == [sorted(set(own) - {a}) for a in own]  # type: ignore[union-attr]
    assert len({p.key_file for p in three}) == 1  # type: ignore[union-attr]
    assert peers("kvflow:no-events:no-peers:x3") == [None, None, None]
    assert peers("kvflow") == [None]
    assert routers.RouterSpec.parse("kvflow:no-events:no-peers:x3").name == "kvflow default no-events no-peers x3"


def test_each_replicated_row_is_read_against_its_one_replica_row() -> None:
    def row(router: str, mean: float, p90: float, hit: float) -> report.Row:
        return report.Row("a", router, 10.0, 100, 0, mean, p90, hit_rate=hit, requests_per_pod=(50, 50))

    rows = [row("kvflow default", 50, 100, 0.88), row("kvflow default x3", 52, 104, 0.87),
            row("kvflow default no-events", 60, 120, 0.80), row("kvflow default no-events x3", 70, 150, 0.70),
            row("sglang cache_aware", 80, 160, 0.7)]
    lines = replica_lines(rows, 10.0, {"kvflow default x3": {10.0: (34, 33, 33)}})

    assert lines == [
        "issue 51 (kvflow default x3 vs kvflow default, at 10 req/s): mean TTFT 1.04, p90 1.04, hit rate -1.0 points "
        "(at most 10 % and 2 points worse: met)",
        "  kvflow default x3: decisions per replica 34/33/33",
        "issue 51 (kvflow default no-events x3 vs kvflow default no-events, at 10 req/s): mean TTFT 1.17, p90 1.25, "
        "hit rate -10.0 points (at most 10 % and 2 points worse: NOT met)",
        "issue 51 (kvflow default no-events x3 vs kvflow default, at 10 req/s): mean TTFT 1.40, p90 1.50, "
        "hit rate -18.0 points (at most 10 % and 2 points worse: NOT met)",
    ]
    assert row_spelling("kvflow-envoy default no-events x3") == "kvflow-envoy:default:no-events:x3"
    better = replica_lines([row("kvflow default", 50, 100, 0.80), row("kvflow default x3", 45, 80, 0.85)], 10.0, {})
    assert better[0].endswith("hit rate +5.0 points (at most 10 % and 2 points worse: met)")  # faster is no miss
