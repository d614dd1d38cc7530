"""The path probe stamps every streamed request in the gateway and the pods, and joins them by id.

A tiny run of the routing benchmark's harness (two simulated pods, kvflow's gateway) with
``bench/path_probe_site`` on the children's ``PYTHONPATH``: every request answered has one
gateway record and one pod record with the same request id, and the stamps follow the request's
way (what ``bench/path_probe.py`` reports as hops).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import path_probe
import replay_placements
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

    # the pod records also say where each request of the trace went: replayed there, the
    # simulation puts as many on each pod as the pods' own counters did
    placed, engine_ttft = replay_placements.placements(list(pods.values()), TINY.trace(4.0, 2.0, 0))
    assert len(placed) == len(engine_ttft) == row.requests
    assert sorted(Counter(placed.values()).values()) == sorted(n for n in row.requests_per_pod if n)
