"""The operator end to end against the emulated cluster: create -> scale -> model update ->
stuck-engine replacement -> bad spec -> delete, then an RBAC audit of every call it made."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from operator_harness import Harness, eventually, operator_running
from operator_rbac import audit_against_chart
from operator_tools import SAMPLES

NS = "default"
NAME = "sim-llm"
LLMS = f"/apis/kvflow.io/v1alpha1/namespaces/{NS}/llmservices"
CHILDREN = {
    ("v1/serviceaccounts", f"{NAME}-router"), ("rbac.authorization.k8s.io/v1/roles", f"{NAME}-router"),
    ("rbac.authorization.k8s.io/v1/rolebindings", f"{NAME}-router"), ("v1/configmaps", f"{NAME}-router"),
    ("apps/v1/deployments", f"{NAME}-router"), ("v1/services", f"{NAME}-router"),
    ("apps/v1/deployments", f"{NAME}-prefill"), ("v1/services", f"{NAME}-prefill"),
    ("policy/v1/poddisruptionbudgets", f"{NAME}-prefill"),
    ("apps/v1/deployments", f"{NAME}-decode"), ("v1/services", f"{NAME}-decode"),
    ("policy/v1/poddisruptionbudgets", f"{NAME}-decode"),
    ("inference.networking.k8s.io/v1/inferencepools", NAME),
    ("apps/v1/deployments", f"{NAME}-gateway"), ("v1/services", f"{NAME}-gateway"),
    ("policy/v1/poddisruptionbudgets", f"{NAME}-gateway"), ("v1/configmaps", f"{NAME}-gateway"),
    ("v1/services", f"{NAME}-gateway-peers"), ("v1/secrets", f"{NAME}-peers"),  # its replicas share routing
}


def sample(port: int) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / "sim-pd.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"]["engine"]["port"] = port
    body["spec"]["lifecycle"]["stuckAfterSeconds"] = 10
    body["spec"]["gateway"] = {"replicas": 2}  # two replicas: a disruption budget and peers to create and delete
    return body


def status(h: Harness) -> dict[str, Any]:
    obj = h.k8s.read("kvflow.io/v1alpha1/llmservices", NS, NAME) or {}
    return obj.get("status") or {}


def deployment(h: Harness, role: str) -> dict[str, Any]:
    return h.k8s.read("apps/v1/deployments", NS, f"{NAME}-{role}") or {}


def engine_args(h: Harness, role: str) -> list[str]:
    args: list[str] = deployment(h, role)["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def engine_pods(h: Harness, role: str) -> list[dict[str, Any]]:
    return [p for p in h.k8s.items("v1/pods", NS) if p["metadata"]["labels"].get("kvflow.io/role") == role]


def events(h: Harness, reason: str) -> list[dict[str, Any]]:
    return [e for e in h.k8s.items("v1/events", NS) if e.get("reason") == reason]


async def test_create_scale_update_stuck_delete_and_rbac(harness: Harness) -> None:
    h = harness
    created = await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
    uid = created["metadata"]["uid"]

    # Create: every child appears, owned by the LLMService; the status turns Ready.
    await eventually(lambda: all(h.k8s.read(r, NS, n) for r, n in CHILDREN), what="all children")
    for resource, name in CHILDREN:
        owners = h.k8s.read(resource, NS, name)["metadata"]["ownerReferences"]  # type: ignore[index]
        assert owners == [{"apiVersion": "kvflow.io/v1alpha1", "kind": "LLMService", "name": NAME,
                           "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")
    ready = {c["type"]: c["status"] for c in status(h)["conditions"]}
    assert ready == {"Ready": "True", "Progressing": "False", "Degraded": "False", "MetricsReachable": "True",
                     "PrefillPoolReady": "True", "DecodePoolReady": "True"}
    assert status(h)["observedGeneration"] == 1
    assert status(h)["pools"]["decode"]["summary"] == "2/2"
    await eventually(lambda: events(h, "Ready"), what="a Ready event")

    # Scale: decode 2 -> 3 lands on the Deployment without touching the pod template.
    template_before = copy.deepcopy(deployment(h, "decode")["spec"]["template"])
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"decode": {"replicas": 3}}})
    await eventually(lambda: deployment(h, "decode")["spec"]["replicas"] == 3, what="decode replicas 3")
    await eventually(lambda: status(h).get("pools", {}).get("decode", {}).get("summary") == "3/3", what="decode 3/3")
    await eventually(lambda: len(engine_pods(h, "decode")) == 3, what="3 decode pods")
    assert deployment(h, "decode")["spec"]["template"] == template_before
    assert status(h)["observedGeneration"] == 2

    # Model update: prefill rolls out first; decode keeps its template until prefill is done.
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"model": {"name": "sim-model-v2"}}})
    await eventually(lambda: "sim-model-v2" in engine_args(h, "prefill"), what="prefill updated")
    assert "sim-model-v2" not in engine_args(h, "decode")
    await eventually(lambda: status(h).get("rollout", {}).get("held") == ["decode"], what="decode held")
    await eventually(lambda: "sim-model-v2" in engine_args(h, "decode"), what="decode updated")
    await eventually(lambda: status(h).get("phase") == "Ready" and status(h)["observedGeneration"] == 3,
                     what="Ready after the model update")
    change = [c for c in h.controller.template_changes if c[0] == f"{NAME}-decode"][-1]
    prefill_hash, prefill_settled = change[2][f"{NAME}-prefill"]
    assert prefill_settled and prefill_hash == deployment(h, "prefill")["metadata"]["annotations"][
        "kvflow.io/template-hash"]
    for role in ("prefill", "decode"):
        assert deployment(h, role)["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    await eventually(lambda: events(h, "RolloutStarted") and events(h, "RolloutFinished"), what="rollout events")

    # Stuck engine: requests running, no new tokens for stuckAfterSeconds -> the pod is replaced.
    victim = engine_pods(h, "decode")[0]
    state = h.engines.state[victim["status"]["podIP"]]
    state.running, state.stuck = 3, True
    await eventually(lambda: victim["metadata"]["name"] not in {p["metadata"]["name"] for p in engine_pods(h, "decode")},
                     what="stuck pod deleted")
    await eventually(lambda: len(engine_pods(h, "decode")) == 3, what="replacement pod")
    await eventually(lambda: events(h, "StuckEngineReplaced"), what="a StuckEngineReplaced event")
    healthy = [p for p in engine_pods(h, "decode") if p["metadata"]["uid"] != victim["metadata"]["uid"]]
    assert len(healthy) == 3

    # A bad spec (possible when CEL is bypassed) is reported, and nothing is changed.
    before = deployment(h, "decode")["metadata"]["resourceVersion"]
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"engine": {"extraArgs": ["--port=1"]}}})
    await eventually(lambda: status(h).get("phase") == "Invalid", what="phase Invalid")
    degraded = next(c for c in status(h)["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "--port" in degraded["message"]
    assert deployment(h, "decode")["metadata"]["resourceVersion"] == before
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"engine": {"extraArgs": []}}})
    await eventually(lambda: status(h).get("phase") == "Ready", what="Ready again")

    # Switching the gateway off deletes its children (and only those).
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"gateway": {"mode": "none"}}})
    await eventually(lambda: not h.k8s.read("apps/v1/deployments", NS, f"{NAME}-gateway"), what="gateway gone")
    await eventually(lambda: not h.k8s.read("v1/secrets", NS, f"{NAME}-peers")
                     and not h.k8s.read("v1/services", NS, f"{NAME}-gateway-peers"), what="the peers' key and Service gone")
    assert h.k8s.read("apps/v1/deployments", NS, f"{NAME}-router")

    # Delete: the operator releases its finalizer; the garbage collector takes the children.
    await h.request("DELETE", f"{LLMS}/{NAME}", content_type="application/json")
    await eventually(lambda: not h.k8s.read("kvflow.io/v1alpha1/llmservices", NS, NAME), what="LLMService gone")
    await eventually(lambda: not any(h.k8s.read(r, NS, n) for r, n in CHILDREN), what="children gone")
    assert not engine_pods(h, "decode")

    # RBAC: every call the operator (and kopf inside it) made is allowed by the chart's ClusterRole.
    calls = [e for e in h.k8s.audit if e.user_agent.startswith(("kvflow-operator", "kopf"))]
    assert calls
    audit_against_chart(calls)


async def test_missing_crd_applies_nothing_then_queue_depth_scaling(harness: Harness) -> None:
    h = harness
    body = sample(h.engines.port)
    body["spec"]["autoscaling"] = {"mode": "keda", "targetQueueDepth": 4}
    body["spec"]["prefill"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2}
    body["spec"]["decode"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    await h.request("POST", LLMS, body, content_type="application/json")

    # KEDA is not installed in this cluster: nothing is applied, and the status says why.
    await eventually(lambda: status(h).get("phase") == "Degraded", what="phase Degraded")
    degraded = next(c for c in status(h)["conditions"] if c["type"] == "Degraded")
    assert "ScaledObject (KEDA)" in degraded["message"]
    assert not h.k8s.items("apps/v1/deployments", NS) and not h.k8s.items("v1/services", NS)

    # The operator's own autoscaler instead: decode follows the waiting requests within min/max,
    # scaling down only after a quiet stabilisation window (20 s of the operator's clock, 1 s here).
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"autoscaling": {
        "mode": "operator", "scaleDownStabilizationSeconds": 20}}})
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")

    def busy_then(replicas: int) -> bool:
        for pod in engine_pods(h, "decode"):  # every decode pod, new ones too, has 10 waiting
            h.engines.state[pod["status"]["podIP"]].waiting = 10
        return bool(deployment(h, "decode")["spec"]["replicas"] == replicas)

    await eventually(lambda: busy_then(4), what="decode scaled to its max, 4")
    await eventually(lambda: events(h, "Scaled"), what="a Scaled event")
    assert deployment(h, "prefill")["spec"]["replicas"] == 1
    for state in h.engines.state.values():
        state.waiting = 0
    await eventually(lambda: deployment(h, "decode")["spec"]["replicas"] == 1, what="decode drained to min 1")


async def test_kvflow_operator_run_cli_reconciles(cluster: Harness) -> None:
    """The real entry point, ``kvflow operator run``, as its own process against the emulator."""
    import asyncio
    import sys

    h = cluster
    before = len(h.k8s.audit)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.cli", "operator", "run", "--server", str(h.server.url).rstrip("/"),
        "--interval", "0.5", "--liveness", "",  # cluster-wide: kmock cannot parse /api/v1/namespaces
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
        await eventually(lambda: len([e for e in h.k8s.audit[before:]
                                      if e.user_agent.startswith("kvflow-operator") and e.verb == "patch"]) > 20,
                         timeout=30, what="the CLI operator applying children")
        await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")
        await eventually(lambda: all(h.k8s.read(r, NS, n) for r, n in CHILDREN), what="all children")
    finally:
        proc.terminate()
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode in (0, -15), stderr.decode()[-2000:]


async def test_image_pull_failure_is_a_condition_naming_the_pool_then_recovers(harness: Harness) -> None:
    h = harness
    await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")

    # A bad engine image: the surge pod of the first pool cannot pull it. The status says which
    # pool and why; the operator keeps running its rounds (no crash loop) and the old pods serve.
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"engine": {"image": "registry.invalid/kvflow:nope"}}})

    def degraded() -> dict[str, Any] | None:
        found = [c for c in status(h).get("conditions", []) if c["type"] == "Degraded" and c["status"] == "True"]
        return found[0] if found else None

    condition = await eventually(degraded, what="a Degraded condition")
    assert condition["reason"] == "ImagePullBackOff"
    assert condition["message"].startswith("prefill pool: pod sim-llm-prefill-")
    assert 'cannot pull the image (ImagePullBackOff): Back-off pulling image "registry.invalid/kvflow:nope"' \
        in condition["message"]
    assert status(h)["phase"] == "Degraded" and status(h)["rollout"]["held"] == ["decode"]
    await eventually(lambda: events(h, "Degraded"), what="a Degraded event")
    rounds = len(h.k8s.audit)
    await eventually(lambda: len(h.k8s.audit) > rounds + 20, what="the operator still reconciling")

    # Fixing the spec recovers without anyone touching the operator.
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"engine": {"image": None}}})
    await eventually(lambda: status(h).get("phase") == "Ready" and not degraded(), what="Ready again")


async def test_stuck_engines_are_evicted_within_budgets(cluster: Harness) -> None:
    """Evictions go through the Eviction API (a PodDisruptionBudget can refuse them) and a
    global budget caps how many engines the operator replaces per window."""
    async with operator_running(cluster, eviction_budget=1, eviction_window=3600.0) as h:
        await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
        await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")
        budget = f"{NAME}-decode"
        await h.k8s.patch_status("policy/v1/poddisruptionbudgets", NS, budget, {"disruptionsAllowed": 0})
        first, second = engine_pods(h, "decode")[:2]
        for pod in (first, second):
            state = h.engines.state[pod["status"]["podIP"]]
            state.running, state.stuck = 3, True
        await eventually(lambda: events(h, "EvictionBlocked"), what="an eviction refused by the budget")
        assert {p["metadata"]["name"] for p in engine_pods(h, "decode")} >= {first["metadata"]["name"],
                                                                              second["metadata"]["name"]}
        await h.k8s.patch_status("policy/v1/poddisruptionbudgets", NS, budget, {"disruptionsAllowed": 1})
        await eventually(lambda: events(h, "StuckEngineReplaced"), what="one stuck engine evicted")
        await eventually(lambda: events(h, "EvictionRateLimited"), what="the second held by the global budget")
        left = {p["metadata"]["name"] for p in engine_pods(h, "decode")}
        assert len({first["metadata"]["name"], second["metadata"]["name"]} & left) == 1
        evictions = [e for e in h.k8s.audit if e.subresource == "eviction"]
        assert evictions and not [e for e in h.k8s.audit if e.resource == "pods" and e.verb == "delete"
                                  and e.user_agent.startswith("kvflow-operator")]


async def test_unreachable_engines_are_a_condition_not_silence(harness: Harness) -> None:
    h = harness
    await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")

    def reachable() -> dict[str, Any]:
        return next((c for c in status(h).get("conditions", []) if c["type"] == "MetricsReachable"), {})

    assert reachable()["status"] == "True"
    for pod in engine_pods(h, "decode"):  # as if a NetworkPolicy admitted only the router
        h.engines.state[pod["status"]["podIP"]].blocked = True
    condition = await eventually(lambda: reachable().get("status") == "False" and reachable(),
                                 what="MetricsReachable False")
    assert condition["reason"] == "ScrapeFailed"
    assert condition["message"].startswith("no pod of the decode pool answered /metrics for ")
    assert "NetworkPolicy" in condition["message"] and status(h)["phase"] == "Ready"  # serving is not the issue
    for state in h.engines.state.values():
        state.blocked = False
    await eventually(lambda: reachable().get("status") == "True", what="reachable again")
