"""The operator end to end against the emulated cluster, switching the InferencePool's endpoint
picker between kvflow's router and GIE's EPP image; then an RBAC audit of every call."""

from __future__ import annotations

from typing import Any

import yaml
from operator_harness import Harness, eventually
from operator_rbac import audit_against_chart
from operator_tools import SAMPLES

from kvflow.operator.spec import GIE_EPP_IMAGE

NS = "default"
NAME = "gie-llm"
LLMS = f"/apis/kvflow.io/v1alpha1/namespaces/{NS}/llmservices"
PICKER = f"{NAME}-router"


def status(h: Harness) -> dict[str, Any]:
    return (h.k8s.read("kvflow.io/v1alpha1/llmservices", NS, NAME) or {}).get("status") or {}


def picker_image(h: Harness) -> str | None:
    deployment = h.k8s.read("apps/v1/deployments", NS, PICKER)
    if not deployment:
        return None
    image: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


async def test_switching_the_picker_keeps_the_inference_pool(harness: Harness) -> None:
    h = harness
    body: dict[str, Any] = yaml.safe_load((SAMPLES / "gie-epp.yaml").read_text())
    body["spec"]["engine"]["port"] = h.engines.port
    body["spec"]["gateway"] = {"mode": "none"}  # the emulator serves no HTTPRoute
    body["spec"]["routing"]["picker"] = "kvflow"
    await h.request("POST", LLMS, body, content_type="application/json")
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready with kvflow's router")
    kvflow_image = picker_image(h)
    pool = h.k8s.read("inference.networking.k8s.io/v1/inferencepools", NS, NAME)
    assert pool is not None and pool["spec"]["endpointPickerRef"]["name"] == PICKER

    # GIE's EPP replaces the router in place; the InferencePool still points at the same Service.
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"routing": {"picker": "gie"}}})
    await eventually(lambda: picker_image(h) == GIE_EPP_IMAGE, what="GIE's EPP image")
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready with GIE's EPP")
    config = h.k8s.read("v1/configmaps", NS, PICKER)
    assert config is not None and "EndpointPickerConfig" in config["data"]["epp-config.yaml"]
    role = h.k8s.read("rbac.authorization.k8s.io/v1/roles", NS, PICKER)
    assert role is not None and "inferenceobjectives" in {r for rule in role["rules"] for r in rule["resources"]}
    after = h.k8s.read("inference.networking.k8s.io/v1/inferencepools", NS, NAME)
    assert after is not None and after["spec"] == pool["spec"]

    # P/D with GIE's EPP (possible when CEL is bypassed) is refused; nothing changes.
    # (the Deployment's spec is what the operator writes; its status moves with the emulated pods)
    before = h.k8s.read("apps/v1/deployments", NS, PICKER)["spec"]  # type: ignore[index]
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"prefill": {"replicas": 1}}})
    await eventually(lambda: status(h).get("phase") == "Invalid", what="phase Invalid")
    degraded = next(c for c in status(h)["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "gie does no prefill/decode disaggregation" in degraded["message"]
    assert h.k8s.read("apps/v1/deployments", NS, PICKER)["spec"] == before  # type: ignore[index]
    assert not h.k8s.read("apps/v1/deployments", NS, f"{NAME}-prefill")

    # And back to kvflow's router, which takes P/D again.
    await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"routing": {"picker": "kvflow"}}})
    await eventually(lambda: picker_image(h) == kvflow_image, what="kvflow's router again")
    await eventually(lambda: status(h).get("phase") == "Ready", what="Ready with P/D")
    assert h.k8s.read("apps/v1/deployments", NS, f"{NAME}-prefill")

    calls = [e for e in h.k8s.audit if e.user_agent.startswith(("kvflow-operator", "kopf"))]
    audit_against_chart(calls, check_unused=False)
