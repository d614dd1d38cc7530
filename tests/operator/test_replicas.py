"""Routers and gateways as several replicas: every one of them routes (active-active), so the
operator keeps them available: rolling updates that never drop below the replicas asked for,
replicas on different nodes when the cluster has them, and a disruption budget that keeps one
serving through a drain but never blocks one. Every object passes kubernetes-validate (strict)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_samples import IMAGES, SECTION, rendered, service

from kvflow.operator.objects import key
from kvflow.operator.plan import plan
from kvflow.operator.render import render

HOSTNAME = "kubernetes.io/hostname"


def named(objs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any] | None:
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == f"sim-llm-{component}"), None)


def deployment(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    found = named(objs, "Deployment", component)
    assert found is not None
    return found


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return set(selector["matchLabels"].items()) <= set(labels.items())


def pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each Deployment's pod labels, by Deployment name."""
    return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] == "Deployment"}


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_three_replicas_get_a_disruption_budget_and_spread_over_nodes(component: str) -> None:
    objs = rendered(**{SECTION[component]: {"replicas": 3}})
    dep = deployment(objs, component)
    pod = dep["spec"]["template"]["spec"]
    mine = dep["spec"]["template"]["metadata"]["labels"]

    budget = named(objs, "PodDisruptionBudget", component)
    assert budget is not None
    assert budget["spec"]["maxUnavailable"] == 1  # a drain takes one replica at a time; two keep serving
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a broken replica never holds a node
    assert [name for name, labels in pod_labels(objs).items() if selects(budget["spec"]["selector"], labels)] == \
        [dep["metadata"]["name"]]

    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == HOSTNAME and selects(term["podAffinityTerm"]["labelSelector"], mine)
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == HOSTNAME and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still runs all three
    assert selects(spread["labelSelector"], mine) and spread["matchLabelKeys"] == ["pod-template-hash"]


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_a_rolling_update_keeps_every_replica_serving(component: str) -> None:
    for replicas in (1, 3):
        dep = deployment(rendered(**{SECTION[component]: {"replicas": replicas}}), component)
        assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                           "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_one_replica_gets_no_budget_that_would_block_a_drain(component: str) -> None:
    objs = rendered(**{SECTION[component]: {"replicas": 1}})
    assert deployment(objs, component)["spec"]["replicas"] == 1
    assert named(objs, "PodDisruptionBudget", component) is None


@pytest.mark.parametrize("component", ["router", "gateway"])
def test_scaling_changes_no_pod_template(component: str) -> None:
    """Placement is the same at any count, and from two replicas on so are the peers they share
    routing with (test_operator_peers.py), so a scale change starts or stops pods and rolls none; only
    going from one replica to several (or back) rolls them once, to start (or stop) sharing."""
    templates = [deployment(rendered(**{SECTION[component]: {"replicas": n}}), component)["spec"]["template"]
                 for n in (2, 3, 5)]
    assert templates[0] == templates[1] == templates[2]
    one = deployment(rendered(**{SECTION[component]: {"replicas": 1}}), component)["spec"]["template"]
    assert {k: v for k, v in one["spec"].items() if k not in ("containers", "volumes")} == \
        {k: v for k, v in templates[0]["spec"].items() if k not in ("containers", "volumes")}


def test_gies_picker_replicas_are_placed_and_budgeted_as_the_routers() -> None:
    objs = rendered(routing={"picker": "gie", "replicas": 2}, gateway={"mode": "none"})
    pod = deployment(objs, "router")["spec"]["template"]["spec"]
    assert pod["containers"][0]["name"] == "epp"
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert "podAntiAffinity" in pod["affinity"]
    assert named(objs, "PodDisruptionBudget", "router") is not None


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_gateway_sharing_a_batch_claim_stays_on_one_node(replicas: int) -> None:
    """The replicas share one SQLite database on a ReadWriteOnce claim: the node that mounts it
    is the one place they can run, so the claim's podAffinity replaces every spreading rule (and
    with one replica, its update's surge pod starts where the claim is attached)."""
    objs = rendered(gateway={"replicas": replicas, "batchClaim": "llm-batches"})
    dep = deployment(objs, "gateway")
    pod = dep["spec"]["template"]["spec"]
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == HOSTNAME and selects(term["labelSelector"], dep["spec"]["template"]["metadata"]["labels"])
    assert "podAntiAffinity" not in pod["affinity"] and "topologySpreadConstraints" not in pod
    assert (named(objs, "PodDisruptionBudget", "gateway") is not None) == (replicas > 1)
    router = deployment(objs, "router")["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" in router  # the router keeps spreading: it holds no claim


def test_scaling_down_to_one_replica_deletes_the_budget_and_the_peers() -> None:
    observed = {key(o): o for o in rendered(routing={"replicas": 3}, gateway={"replicas": 3})}
    one = service()
    decided = plan(one, render(one, IMAGES), observed)
    assert decided.delete == [("policy/v1", "PodDisruptionBudget", "sim-llm-gateway"),
                              ("policy/v1", "PodDisruptionBudget", "sim-llm-router"),
                              ("v1", "Secret", "sim-llm-peers"),
                              ("v1", "Service", "sim-llm-gateway-peers"),
                              ("v1", "Service", "sim-llm-router-peers")]
