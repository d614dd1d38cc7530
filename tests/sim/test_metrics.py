"""/metrics as real vLLM 0.32 writes it: every family of the golden scrape (runtime, engine and
HTTP), in vLLM's order, rendered by the fast path exactly as prometheus_client would render it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.sim.clock import FakeClock
from kvflow.sim.engine import Engine
from kvflow.sim.kv_transfer import NoTransfer, TransferConfig
from kvflow.sim.metrics import SimMetrics, cache_config_info
from kvflow.sim.profiles import PROFILES

from .helpers import make_request, make_scheduler

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm_metrics.txt"
LORA_ONLY = {"vllm:lora_requests_info"}
COMPLETION = {"model": "sim-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    matches = [s.value for s in fams[family].samples if s.name == sample and s.labels == labels]
    assert len(matches) == 1, f"{sample}{labels}: {matches}"
    return float(matches[0])


def request(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def scraped(sim_pods: Any) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """A pod after a little traffic of every kind: its parsed families, their order, body sizes."""
    [pod] = sim_pods(1, "--profile", "instant")
    sizes: dict[str, int] = {}
    plain = json.dumps(COMPLETION).encode()
    stream = json.dumps({**COMPLETION, "stream": True}).encode()
    bad = json.dumps({**COMPLETION, "max_tokens": "many"}).encode()
    status, body = request(pod.url + "/v1/completions", "POST", plain)
    sizes["plain"] = len(body)
    assert request(pod.url + "/v1/completions", "POST", stream)[0] == 200
    status, body = request(pod.url + "/v1/completions", "POST", bad)
    assert status == 400
    sizes["bad"] = len(body)
    sizes["in"] = len(plain) + len(stream) + len(bad)
    for path in ("/v1/models", "/health", "/version", "/_sim/state", "/no/such/route", "/metrics"):
        request(pod.url + path)
    text = pod.get("/metrics").decode()
    order = [f.name for f in text_string_to_metric_families(text)]
    return families(text), order, sizes


def test_every_family_of_real_vllm_is_there_with_its_type_help_and_labels(scraped: Any) -> None:
    got, _, _ = scraped
    want = families(GOLDEN.read_text())
    for name, family in want.items():
        if name in LORA_ONLY:
            continue
        assert name in got, name
        assert (got[name].type, got[name].documentation) == (family.type, family.documentation), name
        assert {frozenset(s.labels) for s in got[name].samples} == {frozenset(s.labels) for s in family.samples}, name


def test_families_come_in_vllms_order(scraped: Any) -> None:
    _, order, _ = scraped
    golden = [f.name for f in text_string_to_metric_families(GOLDEN.read_text())]
    assert [n for n in order if n in golden] == [n for n in golden if n in order]
    assert order[0] == "python_gc_objects_collected" and order[-1] == "http_request_duration_seconds_created"


def test_http_families_count_what_vllms_instrumentator_counts(scraped: Any) -> None:
    got, _, sizes = scraped
    total = "http_requests"
    assert value(got, total, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert value(got, total, "http_requests_total", handler="/v1/completions", method="POST", status="4xx") == 1
    assert value(got, total, "http_requests_total", handler="/v1/models", method="GET", status="2xx") == 1
    assert value(got, total, "http_requests_total", handler="none", method="GET", status="4xx") == 1
    handlers = {s.labels["handler"] for s in got[total].samples}
    assert handlers == {"/v1/completions", "/v1/models", "none"}  # /health, /version, /metrics, /_sim/ excluded
    size_in = "http_request_size_bytes"
    assert value(got, size_in, "http_request_size_bytes_sum", handler="/v1/completions") == sizes["in"]
    assert value(got, size_in, "http_request_size_bytes_count", handler="/v1/completions") == 3
    out = value(got, "http_response_size_bytes", "http_response_size_bytes_sum", handler="/v1/completions")
    assert out == sizes["plain"] + sizes["bad"]  # a stream has no Content-Length: 0
    assert value(got, "http_request_duration_highr_seconds", "http_request_duration_highr_seconds_count") == 5
    assert value(got, "http_request_duration_seconds", "http_request_duration_seconds_count",
                 handler="/v1/completions", method="POST") == 3


def test_the_engine_families_render_as_generate_latest_renders_them() -> None:
    info = cache_config_info(block_size=4, num_blocks=17, num_blocks_override=None, enable_prefix_caching=True,
                             hash_algo="sha256", max_model_len=8192)
    metrics = SimMetrics("m", max_model_len=8192, cache_info=info, max_loras=2)
    clock = FakeClock()
    engine = Engine(make_scheduler(), PROFILES["cpu-tiny"], transfer=NoTransfer(TransferConfig()), metrics=metrics,
                    clock=clock)
    metrics.bind(engine.gauges())
    for i in range(6):
        engine.submit(make_request(f"r{i}", list(range(i, i + 9)), max_tokens=i + 1))
        clock.advance(0.001)
    engine.abort("r5")
    while (deadline := engine.poll()) is not None:
        clock.set(max(clock.now(), deadline))
    metrics.refresh()
    prom = CollectorRegistry(auto_describe=False)
    prom.register(metrics.registry)
    assert metrics.registry.render().encode() == generate_latest(prom)
    assert metrics.render().startswith(b"# HELP python_gc_objects_collected_total")
