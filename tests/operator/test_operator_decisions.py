"""The pure decisions: stuck engines, queue-depth scaling, rollout order, status and events."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from operator_tools import SAMPLES

from kvflow.operator import names, status
from kvflow.operator.lifecycle import (
    Sample,
    desired_replicas,
    is_stuck,
    sample_from_metrics,
    trim,
)
from kvflow.operator.objects import key
from kvflow.operator.plan import deployment_settled, plan
from kvflow.operator.render import render
from kvflow.operator.spec import LLMService, parse
from kvflow.protocol.vllm_metrics import parse_metrics

# ---- metrics and stuck engines -----------------------------------------------------------


def test_a_sample_sums_each_metric_over_label_sets_and_skips_comments() -> None:
    text = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:generation_tokens_total{model_name="m, with } brace"} 1234.0 1700000000000
vllm:num_requests_waiting 3
vllm:bogus{a="b"} NaN
"""
    assert sample_from_metrics(parse_metrics(text), at=7.0) == Sample(at=7.0, running=3, waiting=3, generated=1234.0)


def samples(*rows: tuple[float, float, float]) -> list[Sample]:
    return [Sample(at=at, running=running, waiting=0, generated=generated) for at, running, generated in rows]


STUCK_CASES = {
    "idle": (samples((0, 0, 5), (100, 0, 5)), 100, False),
    "busy-and-progressing": (samples((0, 2, 5), (50, 2, 9), (100, 2, 20)), 100, False),
    "busy-without-tokens-long-enough": (samples((0, 2, 5), (50, 2, 5), (100, 2, 5)), 100, True),
    "busy-without-tokens-too-short": (samples((0, 2, 5), (50, 2, 5), (90, 2, 5)), 90, False),
    "only-the-trailing-busy-run-counts": (samples((0, 2, 5), (40, 0, 5), (60, 2, 5), (100, 2, 5)), 100, False),
    "single-sample": (samples((0, 2, 5)), 1000, False),
    "counter-reset-is-progress": (samples((0, 2, 50), (50, 2, 0), (100, 2, 0)), 100, False),
    "finished-now": (samples((0, 2, 5), (100, 0, 5)), 100, False),
}


@pytest.mark.parametrize("case", sorted(STUCK_CASES))
def test_is_stuck(case: str) -> None:
    history, now, expected = STUCK_CASES[case]
    assert is_stuck(history, now, threshold=100) is expected


def test_trim_keeps_one_sample_from_before_the_cut() -> None:
    history = samples((0, 1, 1), (10, 1, 1), (20, 1, 1))
    assert trim(history, now=100, keep_seconds=50) == history[-1:]
    assert trim(history, now=25, keep_seconds=10) == history[1:]
    assert trim(history, now=25, keep_seconds=50) == history


def test_sparse_scrapes_still_detect_a_stuck_engine() -> None:
    history: list[Sample] = []
    for at in (0, 40, 80):  # scrapes further apart than the kept window
        history = trim([*history, *samples((at, 2, 5))], now=at, keep_seconds=30)
    assert is_stuck(history, now=80, threshold=20)


SCALE_CASES = {
    # id: (current, queue depths, target, low, high, expected)
    "no-metrics-keeps-current": (3, [], 4, 1, 8, 3),
    "no-metrics-clamps": (9, [], 4, 1, 8, 8),
    "at-target": (2, [4, 4], 4, 1, 8, 2),
    "burst-at-most-doubles": (2, [40, 40], 4, 1, 8, 4),
    "quiet-drains-one-at-a-time": (4, [0, 0, 0, 0], 4, 1, 8, 3),
    "never-below-min": (1, [0], 4, 1, 8, 1),
    "never-above-max": (6, [30] * 6, 4, 1, 8, 8),
    "from-zero": (0, [5], 4, 0, 8, 2),
}


@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_desired_replicas(case: str) -> None:
    current, depths, target, low, high, expected = SCALE_CASES[case]
    assert desired_replicas(current, depths, target, low, high) == expected


# ---- rollout order ---------------------------------------------------------------------------


def service(**spec_changes: Any) -> LLMService:
    body = yaml.safe_load((SAMPLES / "sim-pd.yaml").read_text())
    body["metadata"]["name"] = "sim-llm"
    body["metadata"]["uid"] = "u-1"
    for field, value in spec_changes.items():  # one level of merging is enough here
        current = body["spec"].get(field)
        body["spec"][field] = {**current, **value} if isinstance(current, dict) else value
    return parse(body)


def running(objs: list[dict[str, Any]], *, settled: bool = True) -> dict[Any, dict[str, Any]]:
    """Observed children as a cluster would show them after applying ``objs``."""
    observed = {}
    for obj in copy.deepcopy(objs):
        obj["metadata"]["generation"] = 2
        if obj["kind"] == "Deployment":
            replicas = obj["spec"].get("replicas", 1)
            obj["status"] = {"observedGeneration": 2 if settled else 1, "replicas": replicas,
                             "readyReplicas": replicas, "availableReplicas": replicas,
                             "updatedReplicas": replicas if settled else 0}
        observed[key(obj)] = obj
    return observed


def dep(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def test_model_update_rolls_the_first_pool_and_holds_the_second() -> None:
    old = service()
    new = service(model={"name": "v2", "source": "hf://o/v2"})
    observed = running(render(old))

    first = plan(new, render(new), observed)
    assert "v2" in dep(first.apply, "sim-llm-prefill")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert dep(first.apply, "sim-llm-decode")["spec"]["template"] == dep(render(old), "sim-llm-decode")["spec"]["template"]
    assert first.rolling_pool == "prefill" and first.pools["decode"].held

    # Prefill applied but still rolling out: decode keeps waiting.
    mid = running(first.apply, settled=False)
    second = plan(new, render(new), mid)
    assert second.pools["decode"].held and second.pools["prefill"].rolling

    # Prefill done: decode gets the new template.
    third = plan(new, render(new), running(second.apply))
    assert not third.pools["decode"].held
    assert dep(third.apply, "sim-llm-decode")["spec"]["template"] == dep(render(new), "sim-llm-decode")["spec"]["template"]
    assert third.rolling_pool == "decode"

    assert plan(new, render(new), running(third.apply)).settled


def test_pool_order_is_configurable() -> None:
    old = service(rollout={"poolOrder": ["decode", "prefill"]})
    new = service(rollout={"poolOrder": ["decode", "prefill"]}, engine={"kind": "sim", "blockSize": 32})
    decided = plan(new, render(new), running(render(old)))
    assert decided.rolling_pool == "decode" and decided.pools["prefill"].held


def test_scale_only_change_rolls_nothing() -> None:
    old = service()
    new = service(decode={"replicas": 5})
    decided = plan(new, render(new), running(render(old)))
    assert decided.rolling_pool is None and decided.settled
    assert dep(decided.apply, "sim-llm-decode")["spec"]["replicas"] == 5


def test_children_no_longer_rendered_are_deleted() -> None:
    old = service(gateway={"replicas": 2})  # two replicas: a disruption budget and peers too
    new = service(gateway={"mode": "none"})
    decided = plan(new, render(new), running(render(old)))
    assert decided.delete == [("apps/v1", "Deployment", "sim-llm-gateway"),
                              ("policy/v1", "PodDisruptionBudget", "sim-llm-gateway"),
                              ("v1", "ConfigMap", "sim-llm-gateway"),
                              ("v1", "Secret", "sim-llm-peers"),  # no other replicas share a key
                              ("v1", "Service", "sim-llm-gateway"),
                              ("v1", "Service", "sim-llm-gateway-peers")]


def test_operator_autoscaling_keeps_the_decided_replicas() -> None:
    auto = {"mode": "operator"}
    svc = service(autoscaling=auto, prefill={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
                  decode={"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 6}})
    observed = running(render(svc))
    dep(list(observed.values()), "sim-llm-decode")["spec"]["replicas"] = 5  # scaled up earlier
    kept = plan(svc, render(svc), observed)
    assert dep(kept.apply, "sim-llm-decode")["spec"]["replicas"] == 5
    scaled = plan(svc, render(svc), observed, scale={"decode": 9})
    assert dep(scaled.apply, "sim-llm-decode")["spec"]["replicas"] == 6  # clamped to max


def test_deployment_settled() -> None:
    base = {"metadata": {"generation": 3}, "spec": {"replicas": 2}}
    assert deployment_settled({**base, "status": {"observedGeneration": 3, "updatedReplicas": 2,
                                                  "availableReplicas": 2, "replicas": 2}})
    assert not deployment_settled({**base, "status": {"observedGeneration": 2, "updatedReplicas": 2,
                                                      "availableReplicas": 2, "replicas": 2}})
    assert not deployment_settled({**base, "status": {"observedGeneration": 3, "updatedReplicas": 2,
                                                      "availableReplicas": 2, "replicas": 3}})


# ---- status and events -------------------------------------------------------------------


def test_status_conditions_keep_their_transition_time() -> None:
    svc = service()
    observed = running(render(svc))
    decided = plan(svc, render(svc), observed)
    first = status.compute(svc, decided, observed, now="2026-01-01T00:00:00Z", previous={})
    assert first["phase"] == "Ready" and first["pools"]["decode"]["summary"] == "2/2"
    later = status.compute(svc, decided, observed, now="2026-01-01T01:00:00Z", previous=first)
    assert [c["lastTransitionTime"] for c in later["conditions"]] == ["2026-01-01T00:00:00Z"] * 6
    assert status.transition_events(first, later) == []


def test_apply_error_degrades() -> None:
    svc = service()
    observed = running(render(svc))
    decided = plan(svc, render(svc), observed)
    ready = status.compute(svc, decided, observed, now="t0", previous={})
    broken = status.compute(svc, decided, observed, now="t1", previous=ready, error="HTTP 403: forbidden")
    conditions = {c["type"]: c for c in broken["conditions"]}
    assert broken["phase"] == "Degraded" and conditions["Degraded"]["status"] == "True"
    assert conditions["Ready"]["status"] == "False" and conditions["Degraded"]["message"] == "HTTP 403: forbidden"
    assert status.transition_events(ready, broken) == [status.Event("Warning", "Degraded", "HTTP 403: forbidden")]


def test_rollout_events() -> None:
    idle = {"phase": "Ready", "rollout": {"pool": None}}
    rolling = {"phase": "Progressing", "rollout": {"pool": "prefill"}}
    assert [e.reason for e in status.transition_events(idle, rolling)] == ["RolloutStarted"]
    assert [e.reason for e in status.transition_events(rolling, idle)] == ["RolloutFinished", "Ready"]


def test_invalid_status_names_the_problem() -> None:
    result = status.invalid(4, "spec.model.source: bad", now="t", previous={})
    assert result["phase"] == "Invalid" and result["observedGeneration"] == 4
    assert {c["type"]: c["status"] for c in result["conditions"]} == {
        "Ready": "False", "Progressing": "False", "Degraded": "True"}


def test_engine_selector_matches_both_pools_only() -> None:
    svc = service()
    objs = render(svc)
    selector = names.engine_pool_selector(svc)
    for obj in objs:
        if obj["kind"] == "Deployment":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert (selector.items() <= labels.items()) == (obj["metadata"]["name"] in
                                                            ("sim-llm-prefill", "sim-llm-decode"))


def test_status_patch_carries_changes_only() -> None:
    from kvflow.operator.handlers import status_patch

    previous = {"phase": "Ready", "gatewayURL": "http://x", "kopf": {"progress": {}}, "decode": {"ready": 2}}
    assert status_patch(previous, {"phase": "Ready", "gatewayURL": "http://x", "decode": {"ready": 2}}) == {}
    assert status_patch(previous, {"phase": "Progressing", "decode": {"ready": 2}}) == {
        "phase": "Progressing", "gatewayURL": None}


# ---- scale-down stabilisation and pods that do not come up ------------------------------


STABILIZED = {
    # id: (current, [(t, recommended)...], now, window, expected)
    "up-at-once": (2, [(0, 2), (10, 5)], 10, 300, 5),
    "down-waits-for-the-window": (4, [(0, 4), (100, 3), (200, 2)], 200, 300, 4),
    "down-to-the-window-max": (4, [(0, 4), (100, 3), (350, 2)], 350, 300, 3),
    "quiet-for-a-window": (4, [(0, 4), (100, 2), (450, 2)], 450, 300, 2),
    "no-window": (4, [(0, 4), (10, 1)], 10, 0, 1),
    "no-recommendation": (3, [], 10, 300, 3),
}


@pytest.mark.parametrize("case", sorted(STABILIZED))
def test_scale_down_is_stabilised(case: str) -> None:
    from kvflow.operator.lifecycle import stabilized

    current, history, now, window, expected = STABILIZED[case]
    assert stabilized(current, history, now, window) == expected


def pod_with(name: str, component: str, *, waiting: str | None = None, message: str = "",
             unschedulable: str | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status_: dict[str, Any] = {"phase": "Pending"}
    if waiting:
        status_["containerStatuses"] = [{"name": "engine", "image": "img:1",
                                         "state": {"waiting": {"reason": waiting, "message": message}}}]
    if unschedulable:
        status_["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "message": unschedulable}]
    return {"metadata": meta, "status": status_}


def test_pods_that_cannot_come_up_are_named_by_pool_and_reason() -> None:
    from kvflow.operator.health import problems, summary

    pods = [
        pod_with("llm-decode-b", "decode", waiting="ImagePullBackOff", message='Back-off pulling image "x"'),
        pod_with("llm-decode-a", "decode", waiting="ErrImagePull", message="not found"),
        pod_with("llm-decode-c", "decode", waiting="ImagePullBackOff", message='Back-off pulling image "x"'),
        pod_with("llm-prefill-a", "prefill", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
        pod_with("llm-router-a", "router", waiting="CrashLoopBackOff", message="back-off 5m0s restarting"),
        pod_with("llm-decode-old", "decode", waiting="CrashLoopBackOff", deleting=True),  # going away: ignored
        pod_with("llm-decode-ok", "decode"),
    ]
    stalled = {"metadata": {"labels": {"app.kubernetes.io/component": "gateway"}}, "status": {"conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "llm-gateway-7" has timed out progressing.'}]}}
    found = problems(pods, [stalled])
    assert [(p.component, p.reason, p.pods) for p in found] == [
        ("prefill", "InsufficientAccelerators", ("llm-prefill-a",)),  # the scheduler names a device
        ("decode", "ErrImagePull", ("llm-decode-a",)),
        ("decode", "ImagePullBackOff", ("llm-decode-b", "llm-decode-c")),
        ("router", "CrashLoopBackOff", ("llm-router-a",)),
        ("gateway", "ProgressDeadlineExceeded", ()),
    ]
    reason, message = summary(found)  # type: ignore[misc]
    assert reason == "InsufficientAccelerators"
    assert message.split("; ") == [
        "prefill pool: pod llm-prefill-a cannot be scheduled (InsufficientAccelerators): "
        "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
        "decode pool: pod llm-decode-a cannot pull the image (ErrImagePull): not found",
        'decode pool: 2 pods (llm-decode-b, ...) cannot pull the image (ImagePullBackOff): Back-off pulling image "x"',
        "router: pod llm-router-a cannot stay up (CrashLoopBackOff): back-off 5m0s restarting",
        'gateway: ProgressDeadlineExceeded: ReplicaSet "llm-gateway-7" has timed out progressing.',
    ]
    assert summary([]) is None


def test_problems_degrade_the_status_without_an_api_error() -> None:
    from kvflow.operator.health import problems

    svc = service()
    observed = running(render(svc))
    decided = plan(svc, render(svc), observed)
    found = problems([pod_with("sim-llm-decode-x", "decode", waiting="ImagePullBackOff", message="nope")], [])
    result = status.compute(svc, decided, observed, now="t", previous={}, problems=found)
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert result["phase"] == "Degraded" and degraded["reason"] == "ImagePullBackOff"
    assert degraded["message"] == "decode pool: pod sim-llm-decode-x cannot pull the image (ImagePullBackOff): nope"


def test_the_reconcile_path_reads_only_the_injected_clocks() -> None:
    """Durations come from ``Runtime.clock``, timestamps from ``Runtime.wall``: no module on the
    reconcile path calls a clock itself (only ``wall_time``, the default ``wall``)."""
    import ast
    import pathlib

    import kvflow.operator as package

    clocks = {("time", "monotonic"), ("time", "time"), ("time", "perf_counter"), ("datetime", "now"),
              ("datetime", "utcnow"), ("date", "today")}
    modules = ["reconcile", "plan", "lifecycle", "status", "health", "render", "render_pools", "render_control",
               "volumes", "args", "objects", "spec", "names", "scrape"]
    found = []
    for module in modules:
        tree = ast.parse((pathlib.Path(package.__path__[0]) / f"{module}.py").read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for call in [n for n in ast.walk(function) if isinstance(n, ast.Call)]:
                func = call.func
                if isinstance(func, ast.Attribute):
                    owner = func.value.attr if isinstance(func.value, ast.Attribute) else getattr(func.value, "id", "")
                    if (owner, func.attr) in clocks and function.name != "wall_time":
                        found.append(f"{module}.{function.name}: {owner}.{func.attr}()")
    assert found == []


def test_each_pool_has_a_condition_naming_why_it_is_not_ready() -> None:
    from kvflow.operator.health import problems

    svc = service()
    observed = {key(o): o for o in render(svc)}
    pods = [pod_with("sim-llm-prefill-a", "prefill", unschedulable="0/2 nodes are available: 2 Insufficient amd.com/gpu."),
            pod_with("sim-llm-decode-a", "decode", waiting="CrashLoopBackOff", message="back-off")]
    decided = plan(svc, render(svc), observed)
    now = "2026-01-01T00:00:00Z"
    out = status.compute(svc, decided, observed, now=now, previous={}, problems=problems(pods, []),
                         stuck={"decode": "decode pod x ran requests without generating a token"})
    conditions = {c["type"]: (c["status"], c["reason"]) for c in out["conditions"]}
    assert conditions["PrefillPoolReady"] == ("False", "InsufficientAccelerators")
    assert conditions["DecodePoolReady"] == ("False", "CrashLoopBackOff")  # what the pods say comes first
    healthy = status.compute(svc, decided, observed, now=now, previous={}, stuck={"decode": "pod x is stuck"})
    assert {c["type"]: c["reason"] for c in healthy["conditions"]}["DecodePoolReady"] == "StuckEngine"
    assert out["ready"] == "prefill 0/1, decode 0/2" and out["mode"] == "disaggregated"
    assert out["profile"] == "default"


def test_a_leader_worker_set_pool_rolls_and_holds_like_a_deployment() -> None:
    def multi(**changes: Any) -> LLMService:
        body = yaml.safe_load((SAMPLES / "multi-node.yaml").read_text())
        body["spec"]["prefill"] = {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 8}}}
        body["spec"]["kvTransfer"] = {"connector": "NixlConnector"}
        body["spec"].update(changes)
        return parse({**body, "metadata": {**body["metadata"], "uid": "u1"}})

    old, new = multi(), multi(model={**multi().spec.model.model_dump(by_alias=True, exclude_none=True),
                                      "name": "deepseek-r1-v2"})
    observed = {key(o): o for o in render(old)}
    for obj in observed.values():
        if obj["kind"] == "LeaderWorkerSet":  # settled: every group updated and ready
            obj["metadata"]["generation"] = 1
            obj["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}
    assert deployment_settled(observed[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "deepseek-prefill")])
    decided = plan(new, render(new), observed)
    assert decided.rolling_pool == "prefill" and decided.pools["decode"].held
    held = next(o for o in decided.apply if o["metadata"]["name"] == "deepseek-decode" and o["kind"] == "LeaderWorkerSet")
    assert held["kind"] == "LeaderWorkerSet"
    assert held["spec"]["leaderWorkerTemplate"] == observed[
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "deepseek-decode")]["spec"]["leaderWorkerTemplate"]
    counts = status.pool_counts(new, "decode", observed)
    assert (counts["ready"], counts["available"], counts["desired"]) == (1, 1, 1)


def test_the_printer_columns_read_fields_the_status_has() -> None:
    from operator_tools import CHART

    crd = yaml.safe_load((CHART / "crds" / "llmservices.kvflow.io.yaml").read_text())
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Ready", "Profile", "Gateway", "Phase", "Age"]
    svc = service()
    observed = {key(o): o for o in render(svc)}
    out = status.compute(svc, plan(svc, render(svc), observed), observed, now="2026-01-01T00:00:00Z", previous={})
    for name in ("Ready", "Profile", "Gateway", "Phase"):
        field = columns[name].removeprefix(".status.")
        assert isinstance(out[field], str) and out[field], name
