"""`kvflow up` plans pods on distinct loopback addresses, decode first, then prefill."""

import pytest

from kvflow.endpoints import Role
from kvflow.local.up import plan_stack


def test_aggregated_stack_uses_role_both():
    plan = plan_stack(2, 0)
    assert [(p.name, p.host, p.role) for p in plan.pods] == [
        ("decode-0", "127.0.0.2", Role.BOTH),
        ("decode-1", "127.0.0.3", Role.BOTH),
    ]
    assert (plan.gateway_host, plan.gateway_port) == ("127.0.0.1", 8080)


def test_pd_stack_splits_roles():
    plan = plan_stack(2, 1)
    assert [(p.host, p.role) for p in plan.pods] == [
        ("127.0.0.2", Role.DECODE), ("127.0.0.3", Role.DECODE), ("127.0.0.4", Role.PREFILL),
    ]


@pytest.mark.parametrize(("decode", "prefill", "message"), [(0, 0, "--decode"), (1, -1, "--prefill"), (200, 60, "--prefill")])
def test_impossible_stacks_are_refused(decode, prefill, message):
    with pytest.raises(ValueError, match=message):
        plan_stack(decode, prefill)
