"""A live run's placements, read from the path probe's pod records and replayed where they went."""

from __future__ import annotations

from kvbench import oracle
from kvbench.workloads import SMOKE
from replay_placements import Placed, placements

from kvflow.sim.profiles import get_profile


def test_each_record_names_its_request_by_seed_and_its_pod_by_address() -> None:
    trace = SMOKE.trace(6.0, 2.0, 0)
    first, second = trace.requests[0], trace.requests[1]
    records = [
        {"pod": "127.0.0.151:9000", "seed": second.seed, "engine": 1.0, "first_token": 1.25},
        {"pod": "127.0.0.150:9000", "seed": first.seed, "engine": 0.0, "first_token": 0.5},
        {"pod": "127.0.0.150:9000", "seed": 999_999_999, "engine": 0.0, "first_token": 9.0},  # another trace's
    ]
    placed, engine_ttft = placements(records, trace)
    assert placed == {first.index: 0, second.index: 1}  # pods numbered in the order of their addresses
    assert sorted(engine_ttft) == [0.25, 0.5]


def test_the_replay_sends_every_request_where_it_was_placed_and_refuses_the_unplaced() -> None:
    trace = SMOKE.trace(6.0, 2.0, 0)
    placed = {r.index: 1 if r.group == trace.requests[0].group else 0 for r in trace.requests[1:]}
    result = oracle.replay(trace, Placed(placed), pods=2, profile=get_profile("h100-llama8b"), num_blocks=300)
    assert list(result.requests_per_pod) == [list(placed.values()).count(0), list(placed.values()).count(1)]
    assert result.ttft[0] != result.ttft[0]  # NaN: request 0 was placed nowhere, as a refused one
