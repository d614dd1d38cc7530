"""``kvflow bench routing --llmservice FILE``: the kvflow rows run the router config the operator
renders for that LLMService (its pool replaced by the benchmark's pods)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from bench_routing import rendered_router_config
from kvbench import routers
from kvbench.pods import Pod

from kvflow.endpoints import Endpoint
from kvflow.operator.render import render_yaml
from kvflow.router.config import load_config

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def test_the_kvflow_row_runs_the_rendered_router_config(tmp_path: Path) -> None:
    sample = tmp_path / "svc.yaml"
    body = yaml.safe_load((SAMPLES / "sim.yaml").read_text())
    body["spec"]["routing"] = {"plugins": [{"type": "healthy-filter"}, {"type": "precise-prefix-cache-scorer", "weight": 3},
                                           {"type": "queue-scorer", "weight": 1}, {"type": "max-score-picker"}]}
    sample.write_text(yaml.safe_dump(body))
    base = rendered_router_config(sample)
    rendered = next(yaml.safe_load(o["data"]["router.yaml"]) for o in yaml.safe_load_all(render_yaml(sample.read_text()))
                    if o["kind"] == "ConfigMap" and "router.yaml" in o["data"])
    assert base == {k: v for k, v in rendered.items() if k != "pool"}

    pods = [Pod(Endpoint("127.0.0.9", 8000 + i), "both", f"tcp://127.0.0.9:{5557 + i}") for i in range(2)]
    spec = routers.RouterSpec.parse("kvflow")
    argv = routers.argv(spec, pods, 9999, tmp_path, base)
    assert argv[argv.index("--profile") + 1] == "custom"
    config = load_config(json.loads(Path(argv[argv.index("--router-config") + 1]).read_text()))
    assert [e.address for e in config.pool.endpoints] == ["127.0.0.9:8000", "127.0.0.9:8001"]
    assert [(r.plugin_ref, r.weight) for r in config.profiles["custom"].plugins] == [
        ("healthy-filter", None), ("precise-prefix-cache-scorer", 3.0), ("queue-scorer", 1.0), ("max-score-picker", None)]
