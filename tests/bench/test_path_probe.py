"""The path probe stamps every streamed request in the gateway and the pods, and joins them by id.

A tiny run of the routing benchmark's harness (two simulated pods, kvflow's gateway) with
``bench/path_probe_site`` on the children's ``PYTHONPATH``: every request answered has one
gateway record and one pod record with the same request id, and the stamps follow the request's
way (what ``bench/path_probe.py`` reports as hops).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import path_probe
import replay_placements
from kvbench import loadgen
from kvbench.runner import Options, bench_workload
from kvbench.workloads import Workload

SITE = Path(path_probe.__file__).resolve().parent / "path_probe_site"
TINY = Workload("smoke", "shared-prefix", decode_pods=2, num_blocks=300,
                params=(("groups", 2), ("per_group", 3), ("system_len", 600), ("question_len", 100), ("output_len", 8)))
WAY = ["began", "handled", "serving", "sent", "handler", "engine", "first_token"]
"""Stamps in the order a request passes them (the pod writes the first token out after it is
produced, but the engine's planned time may lead the write by less than its clock's tick)."""
TICK = 0.001
"""The simulator's timer resolution (uvloop's whole milliseconds, docs/simulator.md): a token's
planned time can trail its delivery, and the gateway's read of it, by up to this much."""


async def test_every_streamed_request_is_stamped_on_both_sides_and_joined_by_its_id(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("KVFLOW_PATH_PROBE", str(probe))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))
    client = _probe_this_process(monkeypatch)  # the load generator runs here, not in `kvflow bench routing`
    outcome = await bench_workload(TINY, ["kvflow"], Options(duration=2.0, rates=(4.0,), settle=0.5,
                                                             log_dir=tmp_path / "logs", verbose=False))
    (row,) = [r for r in outcome.rows if r.measured]

    gateway, lag = path_probe.load(probe, "gateway")
    pods = {r["rid"]: r for r in path_probe.load(probe, "sim")[0]}
    assert row.errors == 0 and len(gateway) == len(pods) == row.requests > 0
    assert lag and all(lag_s > -0.002 for lag_s in lag)  # timers fire late, never much early
    for g in gateway:
        p = pods[g["rid"]]
        stamps = {**g, **p}
        assert [stamps[k] for k in WAY] == sorted(stamps[k] for k in WAY)
        assert p["written"] <= g["first_chunk"] and p["first_token"] <= g["first_chunk"] + TICK
        assert 0 < g["tokenize"] + g["schedule"] <= g["sent"] - g["serving"]
    assert f"({row.requests} requests joined by id)" in path_probe.report(probe)

    # the load generator's records join the pods' by seed, on the same clock: whichever router
    # carried it, a request was sent before its pod's handler saw it and got its first token
    # after the pod wrote it
    (probe / "client-0.jsonl").write_text("".join(json.dumps(["requests", c]) + "\n" for c in client))
    by_seed = {p["seed"]: p for p in pods.values()}
    assert len(client) == row.requests
    for c in client:
        p = by_seed[c["seed"]]
        assert c["sent"] < p["handler"] and p["written"] <= c["first"]
    assert f"from the load generator ({row.requests} requests joined by seed)" in path_probe.report(probe)

    # the pod records also say where each request of the trace went: replayed there, the
    # simulation puts as many on each pod as the pods' own counters did
    placed, engine_ttft = replay_placements.placements(list(pods.values()), TINY.trace(4.0, 2.0, 0))
    assert len(placed) == len(engine_ttft) == row.requests
    assert sorted(Counter(placed.values()).values()) == sorted(n for n in row.requests_per_pod if n)


def _probe_this_process(monkeypatch) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    """The probe's load-generator records, kept in a list instead of a file (no dump thread)."""
    spec = importlib.util.spec_from_file_location("path_probe_sitecustomize", SITE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # this process is no kvflow component: nothing is patched yet
    kept: dict[str, list[dict[str, float]]] = {}
    monkeypatch.setattr(site, "_dump_every", lambda seconds, role, state: kept.update(state))
    monkeypatch.setattr(loadgen, "run", loadgen.run)  # put back after the test
    site.probe_client()
    return kept["requests"]
