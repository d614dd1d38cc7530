"""LoRA adapters follow the spec on running engines, through vLLM's dynamic LoRA API.

The plan is pure and table-tested; the calls run against real ``kvflow sim`` pods, and the whole
loop (edit ``spec.model.loraAdapters`` → the operator's lifecycle round loads and unloads, the
status says so) runs with kopf against the emulated cluster, whose pods are real simulators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from operator_emulator import VERBS, Cluster
from operator_fakes import EngineState, FakeDeploymentController
from operator_harness import Harness, eventually, operator_running

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.operator import adapters
from kvflow.operator.adapters import Load, PodAdapters, Unload, plan_adapters
from kvflow.operator.spec import LLMService, parse

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONHASHSEED": "0"}
NS, NAME = "default", "lora-llm"
LLMS = f"/apis/kvflow.io/v1alpha1/namespaces/{NS}/llmservices"

# ---- the plan ------------------------------------------------------------------------------

PLANS = {
    "nothing-to-do": ({"sql": "/a/sql"}, {"sql": "/a/sql"}, ()),
    "load-the-missing": ({"sql": "/a/sql", "chat": "/a/chat"}, {"sql": "/a/sql"}, (Load("chat", "/a/chat"),)),
    "unload-the-removed": ({}, {"sql": "/a/sql"}, (Unload("sql"),)),
    "a-new-path-reloads-in-place": ({"sql": "/a/sql-v2"}, {"sql": "/a/sql"}, (Load("sql", "/a/sql-v2", True),)),
    "unloads-first-then-loads-by-name": (
        {"b": "/b", "a": "/a"}, {"z": "/z", "y": "/y"}, (Unload("y"), Unload("z"), Load("a", "/a"), Load("b", "/b"))),
    "never-the-base-model": ({"base": "/x"}, {"base": "/m"}, ()),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_plan_adapters(case: str) -> None:
    desired, loaded, expected = PLANS[case]
    assert plan_adapters(desired, loaded, base={"base"}) == expected


def service(port: int, adapter_list: list[dict[str, str]], replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "kvflow.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"name": "sim-model", "source": "hf://kvflow/sim-tiny", "loraAdapters": adapter_list},
            "engine": {"kind": "sim", "port": port},
            "decode": {"replicas": replicas},
        },
    }


def parsed(port: int, adapter_list: list[dict[str, str]]) -> LLMService:
    body = service(port, adapter_list)
    body["metadata"] |= {"uid": "u1", "generation": 1}
    return parse(body)


def pod(name: str, ip: str, *, ready: bool = True, role: str = "both", engine: str = "true") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kvflow.io/role": role, "kvflow.io/engine": engine}},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_engine_pods_are_called_and_a_group_only_at_its_leader() -> None:
    svc = parsed(8123, [])
    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready=False), pod("c", "10.0.0.3", engine="worker"),
            pod("d", "10.0.0.4", role="prefill")]  # no prefill pool is rendered for this spec
    assert adapters.engine_targets(svc, pods) == [("a", "http://10.0.0.1:8123")]


def test_the_condition_names_each_failing_pod_and_warns_once_per_message() -> None:
    failed = [PodAdapters("p1", errors=("load sql: 500 boom",)), PodAdapters("p2")]
    status: dict[str, Any] = {"conditions": []}
    events = adapters.report(status, failed, {"sql": "/s"}, 3, "T1", previous={})
    [cond] = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"], cond["message"], cond["observedGeneration"]) == (
        "AdaptersLoaded", "False", "LoadFailed", "pod p1: load sql: 500 boom", 3)
    assert [(e.type, e.reason) for e in events] == [("Warning", "LoadFailed")]
    again = adapters.report({"conditions": []}, failed, {"sql": "/s"}, 3, "T2", previous=status)
    assert again == []  # the same failure: no second Warning
    carried: dict[str, Any] = {"conditions": []}
    assert adapters.report(carried, None, {"sql": "/s"}, 3, "T3", previous=status) == []
    assert carried["conditions"] == [cond]  # a round that did not sync keeps the last word


# ---- the calls, on real simulators --------------------------------------------------------


@dataclasses.dataclass
class SimEngines:
    """Real ``kvflow sim`` processes on 127.0.0.x, one port: the pods the fake controller places."""

    ips: list[str]
    port: int
    state: dict[str, EngineState] = dataclasses.field(default_factory=dict)

    def models(self, ip: str) -> dict[str, str | None]:
        with urllib.request.urlopen(f"http://{ip}:{self.port}/v1/models", timeout=10) as r:
            return {m["id"]: m["parent"] for m in json.loads(r.read())["data"]}


@contextlib.contextmanager
def sim_engines(tmp_path: Path, ips: list[str], *, runtime: list[bool]) -> Iterator[SimEngines]:
    port = free_port(ips[0])
    with ProcessGroup(tmp_path / "sims") as group:
        children = [group.start(f"sim-{ip}", kvflow_argv("sim", "--host", ip, "--port", str(port), "--profile",
                                                         "instant", "--enable-lora", "--max-loras", "4"),
                                env=RUNTIME if on else {"PYTHONHASHSEED": "0"}, ready_url=f"http://{ip}:{port}/health")
                    for ip, on in zip(ips, runtime, strict=True)]
        group.wait_ready(30, children)
        yield SimEngines(ips, port)


async def test_sync_loads_unloads_and_names_a_pod_without_the_runtime_api(tmp_path: Path) -> None:
    ips = ["127.0.0.91", "127.0.0.92", "127.0.0.93"]
    with sim_engines(tmp_path, ips, runtime=[True, True, False]) as sims:
        targets = [(f"pod-{i}", f"http://{ip}:{sims.port}") for i, ip in enumerate(ips)]
        first = await adapters.sync_adapters(targets[:2], {"sql": "/a/sql", "chat": "/a/chat"}, timeout=5)
        assert [(r.pod, r.loaded, r.done, r.errors) for r in first] == [
            (p, (), (Load("chat", "/a/chat"), Load("sql", "/a/sql")), ()) for p in ("pod-0", "pod-1")]
        assert sims.models(ips[0]) == {"sim-model": None, "chat": "sim-model", "sql": "sim-model"}

        second = await adapters.sync_adapters(targets, {"sql": "/a/sql-v2"}, timeout=5)
        assert [(r.loaded, r.done) for r in second[:2]] == [
            (("chat", "sql"), (Unload("chat"), Load("sql", "/a/sql-v2", True)))] * 2
        assert sims.models(ips[1]) == {"sim-model": None, "sql": "sim-model"}
        off = second[2]
        assert (off.pod, off.reachable, off.errors) == ("pod-2", True, (
            "load sql: 404 the engine has no dynamic LoRA API (is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True set?)",))

        gone = await adapters.sync_adapters([("pod-x", "http://127.0.0.94:1")], {"sql": "/a/sql"}, timeout=2)
        assert [(r.reachable, r.errors) for r in gone] == [(False, ("/v1/models did not answer",))]


# ---- the operator's loop ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def cluster_of_sims(tmp_path: Path, runtime: list[bool]) -> AsyncIterator[tuple[Harness, SimEngines]]:
    ips = [f"127.0.0.{i}" for i in range(95, 95 + len(runtime))]
    with sim_engines(tmp_path, ips, runtime=runtime) as sims:
        async with contextlib.AsyncExitStack() as stack:
            k8s = await stack.enter_async_context(Cluster())
            # the pool's model cache claim, when the spec renders one
            k8s.resources.setdefault("v1/persistentvolumeclaims", kmock.ResourceInfo(
                kind="PersistentVolumeClaim", namespaced=True, verbs=VERBS))
            server = await stack.enter_async_context(kmock.Server(k8s))
            controller = await stack.enter_async_context(FakeDeploymentController(k8s, sims))  # type: ignore[arg-type]
            h = await stack.enter_async_context(operator_running(Harness(k8s, server, sims, controller)))  # type: ignore[arg-type]
            yield h, sims


def status(h: Harness) -> dict[str, Any]:
    return (h.k8s.read("kvflow.io/v1alpha1/llmservices", NS, NAME) or {}).get("status") or {}


def adapters_condition(h: Harness) -> dict[str, Any]:
    return next((c for c in status(h).get("conditions") or [] if c["type"] == "AdaptersLoaded"), {})


def pod_names(h: Harness) -> set[str]:
    return {p["metadata"]["name"] for p in h.k8s.items("v1/pods", NS)}


async def test_editing_the_spec_loads_and_unloads_adapters_without_restarting_pods(tmp_path: Path) -> None:
    async with cluster_of_sims(tmp_path, [True, True]) as (h, sims):
        await h.request("POST", LLMS, service(sims.port, [{"name": "sql", "source": "pvc://adapters/sql"}]),
                        content_type="application/json")
        await eventually(lambda: all("sql" in sims.models(ip) for ip in sims.ips), what="sql loaded on both pods")
        await eventually(lambda: adapters_condition(h).get("status") == "True", what="AdaptersLoaded True")
        assert adapters_condition(h)["reason"] == "Loaded"
        before = pod_names(h)

        await h.request("PATCH", f"{LLMS}/{NAME}",
                        {"spec": {"model": {"loraAdapters": [{"name": "chat", "source": "pvc://adapters/chat"}]}}})
        await eventually(lambda: all(set(sims.models(ip)) == {"sim-model", "chat"} for ip in sims.ips),
                         what="sql unloaded, chat loaded")
        assert pod_names(h) == before  # no pod was restarted for it
        events = {e.get("reason") for e in h.k8s.items("v1/events", NS)}
        assert "AdaptersChanged" in events


async def test_a_pod_that_cannot_load_turns_the_condition_false_with_a_warning(tmp_path: Path) -> None:
    async with cluster_of_sims(tmp_path, [True, False]) as (h, sims):
        await h.request("POST", LLMS, service(sims.port, [{"name": "sql", "source": "pvc://adapters/sql"}]),
                        content_type="application/json")
        await eventually(lambda: adapters_condition(h).get("status") == "False", what="AdaptersLoaded False")
        cond = adapters_condition(h)
        assert cond["reason"] == "LoadFailed" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in cond["message"]
        assert "sql" in sims.models(sims.ips[0])  # the other pod got it
        await eventually(lambda: [e for e in h.k8s.items("v1/events", NS) if e.get("reason") == "LoadFailed"],
                         what="a LoadFailed Warning")
