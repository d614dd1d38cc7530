"""``kvflow gateway --endpoint ...`` without ``--model`` serves what the pods list in /v1/models."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kvflow.gateway.discovery import discover, plan_pools
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv


def entry(name: str, parent: str | None = None, length: int | None = 4096) -> dict[str, object]:
    return {"id": name, "object": "model", "parent": parent, "max_model_len": length}


def test_one_pool_per_base_model_with_its_adapters_and_the_smallest_context() -> None:
    listings = {
        "10.0.0.1:8000": [entry("llama"), entry("sql", parent="llama")],
        "10.0.0.2:8000": [entry("llama", length=2048)],
        "10.0.0.3:8000": [entry("qwen")],
        "10.0.0.4:8000": [entry("llama")],
    }
    assert plan_pools(listings, prefill=["10.0.0.4:8000"]) == [
        {"model": "llama", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"], "prefill_endpoints": ["10.0.0.4:8000"],
         "loras": ["sql"], "max_model_len": 2048},
        {"model": "qwen", "endpoints": ["10.0.0.3:8000"], "prefill_endpoints": [], "loras": [],
         "max_model_len": 4096},
    ]


def test_a_pod_that_never_answers_is_a_clear_error() -> None:
    now = [0.0]

    def fetch(address: str) -> list[dict[str, object]]:
        raise OSError("connection refused")

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(ValueError, match="cannot list the models of 10.0.0.9:8000.*give --model"):
        discover(["10.0.0.9:8000"], wait=3.0, fetch=fetch, clock=lambda: now[0], sleep=sleep)


def test_the_gateway_without_model_serves_what_the_pods_serve(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pods = sim_pods(2, "--model", "tiny", "--profile", "instant", "--max-model-len", "64",
                    "--lora-modules", "sql=/adapters/sql")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), *[a for p in pods for a in ("--endpoint", p.id)]),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
        assert sorted(m["id"] for m in models["data"]) == ["sql", "tiny"]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "tiny", "prompt": " ".join(["word"] * 200), "max_tokens": 1}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:  # longer than the pods' context: vLLM's 400, early
            urllib.request.urlopen(request, timeout=10)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and "maximum context length is 64 tokens" in error["message"]
