"""P/D pairs only share a model revision: the pure pieces (pod label -> endpoint -> pairing)."""

from __future__ import annotations

import pytest

from kvflow.endpoints import Endpoint, Role
from kvflow.router import load_config
from kvflow.router.k8s import pod_endpoint
from kvflow.router.model import SchedulingRequest
from kvflow.router.pd import same_revision
from kvflow.router.model import EndpointView
from kvflow.router.router import Router


def view(host: str, role: Role, revision: str) -> EndpointView:
    return EndpointView(Endpoint(host, 8000, role=role, revision=revision))


@pytest.mark.parametrize("decode, prefill, paired", [
    ("a", ["a", "b"], ["10.0.0.1"]),
    ("b", ["a", "b"], ["10.0.0.2"]),
    ("c", ["a", "b"], []),
    ("", ["", ""], ["10.0.0.1", "10.0.0.2"]),  # no labels (static pools): everything pairs as before
])
def test_same_revision(decode: str, prefill: list[str], paired: list[str]) -> None:
    prefillers = [view(f"10.0.0.{i + 1}", Role.PREFILL, r) for i, r in enumerate(prefill)]
    chosen = same_revision(prefillers, view("10.0.1.1", Role.DECODE, decode))
    assert [p.endpoint.host for p in chosen] == paired


def test_pod_label_becomes_the_endpoint_revision() -> None:
    pod = {"metadata": {"name": "p", "labels": {"kvflow.io/role": "prefill", "kvflow.io/revision": "r1"}},
           "status": {"podIP": "10.0.0.9", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    endpoint = pod_endpoint(pod, 8000, "kvflow.io/role")
    assert endpoint is not None and (endpoint.role, endpoint.revision) == (Role.PREFILL, "r1")


def test_a_decode_pod_without_a_same_revision_prefill_pod_stays_aggregated() -> None:
    config = load_config({"kvEvents": {"enabled": False}, "pd": {"threshold": 10}})
    pods = [Endpoint("10.0.0.1", 8000, role=Role.DECODE, revision="new"),
            Endpoint("10.0.0.2", 8000, role=Role.PREFILL, revision="old")]
    router = Router(config, pods, profile="least-load")
    result = router.decide(SchedulingRequest("r", "", list(range(100)))).result
    assert result.targets[0].host == "10.0.0.1" and result.prefill is None
    router.set_endpoints([*pods, Endpoint("10.0.0.3", 8000, role=Role.PREFILL, revision="new")])
    result = router.decide(SchedulingRequest("r2", "", list(range(100, 200)))).result
    assert result.prefill is not None and result.prefill.host == "10.0.0.3"
