"""Passive health's decisions on an explicit clock: when a pod is ejected, for how long, and
when it comes back."""

from __future__ import annotations

import math

import pytest

from kvflow.endpoints import EndpointId
from kvflow.router.outliers import EjectionPolicy, Outliers

A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


def test_three_failures_in_a_row_eject_and_an_answer_between_them_resets_the_count() -> None:
    out = Outliers(EjectionPolicy(consecutive_failures=3, base_seconds=10))
    assert [out.failed(A, 0.0, 3), out.failed(A, 1.0, 3)] == [False, False]
    out.succeeded(A)
    assert [out.failed(A, 2.0, 3), out.failed(A, 3.0, 3), out.failed(A, 4.0, 3)] == [False, False, True]
    assert (out.ejected(), out.pods[A].until, out.next_due) == ([A], 14.0, 14.0)


@pytest.mark.parametrize(("ejection", "seconds"), [(1, 10.0), (2, 20.0), (3, 30.0), (40, 300.0)],
                         ids=["first", "second", "third", "capped"])
def test_each_ejection_lasts_longer_up_to_the_cap(ejection: int, seconds: float) -> None:
    out = Outliers(EjectionPolicy(consecutive_failures=1, base_seconds=10, max_seconds=300, forgive_seconds=1e9))
    now = 0.0
    for _ in range(ejection):
        assert out.failed(A, now, 2)
        now = out.pods[A].until
        assert out.due(now) == [A]  # readmitted when its time is up ...
    assert out.pods[A].until == 0.0 and out.next_due == math.inf
    assert out.failed(A, now, 2)  # ... and one failure ejects it again, for longer
    assert out.pods[A].until - now == min(300.0, 10.0 * (ejection + 1))


def test_a_readmitted_pod_is_ejected_by_one_failure_and_forgiven_after_a_quiet_spell() -> None:
    out = Outliers(EjectionPolicy(consecutive_failures=3, base_seconds=10, forgive_seconds=100))
    for t in (0.0, 1.0, 2.0):
        out.failed(A, t, 3)
    assert out.due(11.9) == [] and out.due(12.0) == [A]
    assert out.failed(A, 13.0, 3) and out.pods[A].until == 33.0  # second ejection: 20 s
    assert out.due(33.0) == [A]
    out.succeeded(A)
    for t in (200.0, 201.0, 202.0):  # long after: its past is forgotten
        out.failed(A, t, 3)
    assert out.pods[A].until == 212.0


def test_never_more_than_the_allowed_fraction_of_the_pool_and_never_the_last_pod() -> None:
    out = Outliers(EjectionPolicy(consecutive_failures=1, max_ejected_fraction=0.5))
    assert [out.failed(A, 0.0, 3), out.failed(B, 0.0, 3)] == [True, False]  # 3 pods: one may go
    out = Outliers(EjectionPolicy(consecutive_failures=1, max_ejected_fraction=0.1))
    assert out.failed(A, 0.0, 2)  # 10 % of two pods is none: one still may go (as in Envoy)
    assert not out.failed(B, 0.0, 2)
    assert not Outliers(EjectionPolicy(consecutive_failures=1)).failed(A, 0.0, 1)  # a pool of one keeps it


def test_a_pod_that_left_the_pool_is_forgotten() -> None:
    out = Outliers(EjectionPolicy(consecutive_failures=1))
    out.failed(C, 0.0, 4)
    out.forget(C)
    assert out.pods == {} and out.ejected() == []
