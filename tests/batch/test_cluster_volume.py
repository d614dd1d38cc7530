"""On a cluster: the operator gives each gateway a writable batch directory, on the LLMService's
PersistentVolumeClaim when it names one (replicas then share one node, as one SQLite file needs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvflow.operator import names
from kvflow.operator.render import render
from kvflow.operator.render_control import BATCH_DIR
from kvflow.operator.spec import parse

SAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "sim.yaml"
IMAGES = names.Images(kvflow="ghcr.io/kvflow/kvflow:test", vllm="vllm/vllm-openai:test")


def gateway_pod(**gateway: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    body["spec"]["gateway"] = {**body["spec"].get("gateway", {}), **gateway}
    objs = render(parse(body), IMAGES)
    deployment = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway"))
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-gateway"))
    return deployment["spec"]["template"]["spec"], yaml.safe_load(config["data"][names.GATEWAY_CONFIG_FILE])


def batches_volume(pod: dict[str, Any]) -> dict[str, Any]:
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["batches"] == BATCH_DIR
    return next(v for v in pod["volumes"] if v["name"] == "batches")


def test_without_a_claim_batches_live_in_an_empty_dir() -> None:
    pod, config = gateway_pod()
    assert batches_volume(pod) == {"name": "batches", "emptyDir": {}}
    assert config["batch"] == {"dir": BATCH_DIR}
    assert "podAffinity" not in pod["affinity"]  # nothing ties the replicas to one node


def test_a_claim_is_mounted_and_replicas_stay_on_its_node() -> None:
    pod, _ = gateway_pod(batchClaim="llm-batches", replicas=3)
    assert batches_volume(pod) == {"name": "batches", "persistentVolumeClaim": {"claimName": "llm-batches"}}
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def test_one_replica_with_a_claim_keeps_its_update_on_the_claims_node() -> None:
    """The rolling update's surge pod must start where the old pod holds the claim."""
    pod, _ = gateway_pod(batchClaim="llm-batches")
    assert batches_volume(pod)["persistentVolumeClaim"] == {"claimName": "llm-batches"}
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
