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


def test_every_pod_publishes_kv_events_on_its_own_loopback_address_and_the_router_connects_there():
    import argparse

    from kvflow.local.up import router_config, sim_argv

    plan = plan_stack(2, 1)
    args = argparse.Namespace(model="m", sim_profile="instant", kv_transfer="nixl", tokenizer="")
    for pod, endpoint in zip(plan.pods, router_config(plan, 16)["pool"]["endpoints"], strict=True):
        argv = sim_argv(pod, args)
        published = argv[argv.index("--kv-events-endpoint") + 1]
        assert published == endpoint["kvEvents"] == f"tcp://{pod.host}:{pod.kv_events_port}"
        assert "*" not in published and "0.0.0.0" not in published


def test_vllm_pods_publish_kv_events_on_unix_sockets_which_vllm_binds(tmp_path):
    plan = plan_stack(1, 1, ipc_dir=str(tmp_path))
    assert [p.kv_events for p in plan.pods] == [f"ipc://{tmp_path}/decode-0.kv-events",
                                                f"ipc://{tmp_path}/prefill-0.kv-events"]


def test_pd_pods_hold_ucx_to_loopback():
    from kvflow.local.up import pod_env

    aggregated, = plan_stack(1, 0).pods
    decode, prefill = plan_stack(1, 1).pods
    assert "UCX_NET_DEVICES" not in pod_env(aggregated)
    assert pod_env(decode)["UCX_NET_DEVICES"] == pod_env(prefill)["UCX_NET_DEVICES"] == "lo"


def test_a_simulated_pods_kv_events_are_not_reachable_on_another_address(tmp_path):
    """A real simulator started as `kvflow up` starts it: its publisher answers on its 127.0.0.x only."""
    import argparse
    import socket

    from kvflow.local.procs import ProcessGroup, free_port
    from kvflow.local.up import SIM_ENV, PodPlan, sim_argv

    pod = PodPlan("decode-0", "127.0.0.2", Role.BOTH, free_port("127.0.0.2"), 0, free_port("127.0.0.2"))
    args = argparse.Namespace(model="m", sim_profile="instant", kv_transfer="nixl", tokenizer="")
    with ProcessGroup(tmp_path) as group:
        group.start("pod", sim_argv(pod, args), env=SIM_ENV, ready_url=f"http://{pod.address}/health")
        group.wait_ready(30)
        with socket.create_connection((pod.host, pod.kv_events_port), timeout=5):
            pass  # the router's way in
        for other in ("127.0.0.1", "127.0.0.3"):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, pod.kv_events_port), timeout=5).close()
