"""kvflow's policy against the oracle on the replay, over traces and fingerprint keys."""

from __future__ import annotations

import argparse
import math

import pytest
from kvbench import oracle
from kvbench.workloads import SMOKE
from kvbench.replay_kvflow import secret
from replay_policy import parse_lag, ratios, replayed


def test_one_ratio_per_trace_and_key_each_a_repeatable_replay() -> None:
    got = ratios(SMOKE, [0], 2, oracle.Lag(0.004, 0.005), duration=3.0)
    assert len(got) == 2 and all(math.isfinite(r) and r > 0.5 for r in got)
    assert ratios(SMOKE, [0], 2, oracle.Lag(0.004, 0.005), duration=3.0) == got
    assert secret(0) != secret(1) != secret(2)


def test_the_lag_is_read_in_milliseconds_and_bad_ones_are_refused() -> None:
    assert parse_lag("4,5") == oracle.Lag(0.004, 0.005)
    for bad in ("4", "a,b", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lag(bad)


def test_fixed_rates_give_a_row_each_with_both_routers_figures() -> None:
    rows = replayed(SMOKE, [0, 1], 2, oracle.Lag(), duration=3.0, rates=[4.0, 8.0])
    assert [row.rate for row in rows] == [4.0, 8.0]
    for row in rows:
        assert len(row.ratios) == len(row.kvflow) == 4 and len(row.oracle) == 2  # (seed, key) and seed
        for f in (*row.kvflow, *row.oracle):
            assert f.mean_ms > 0 and f.p90_ms > 0 and 0 <= f.hit_rate <= 1 and f.cpu_rate == 0 and f.balance >= 1
    assert rows[0].label() == "4"
