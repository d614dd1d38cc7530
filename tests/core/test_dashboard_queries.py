"""The chart's Grafana dashboard asks only for series that exist: every metric a PromQL query
names is exported by kvflow (the gateway's, the router's and the simulator's registries) or by
real vLLM (its captured /metrics, tests/golden/vllm_metrics.txt), and kvflow's own components
each have their panels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvflow.gateway.metrics import GatewayMetrics
from kvflow.router.observability import RouterMetrics
from kvflow.sim.metrics import SimMetrics, cache_config_info
from kvflow.sim.nixl.metrics import NixlMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "charts" / "kvflow" / "dashboards" / "kvflow.json").read_text())
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{")
SUFFIXES = {"counter": ("", "_total"), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
            "gauge": ("",), "info": ("", "_info"), "untyped": ("",)}


def series_of(exposition: str) -> set[str]:
    """The sample names a text exposition's ``# TYPE`` lines declare (a counter's with ``_total``)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + suffix for suffix in SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(SELECTOR.match(line + "{").group(1) if "{" in line else line.split()[0])  # type: ignore[union-attr]
    return names


def exported() -> set[str]:
    info = cache_config_info(block_size=16, num_blocks=64, num_blocks_override=None, enable_prefix_caching=True,
                             hash_algo="sha256", max_model_len=8192)
    sim = SimMetrics("m", max_model_len=8192, cache_info=info, max_loras=2)
    return (series_of(GatewayMetrics().render().decode())
            | series_of(generate_latest(RouterMetrics("pool").registry).decode())
            | series_of(sim.registry.render()) | series_of(NixlMetrics("m").registry.render())
            | series_of((ROOT / "tests" / "golden" / "vllm_metrics.txt").read_text()))


QUERIES = [(panel["title"], target["expr"]) for panel in DASHBOARD["panels"] for target in panel.get("targets", [])]


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[f"{t}#{i}" for i, (t, _) in enumerate(QUERIES)])
def test_every_query_names_only_exported_metrics(title: str, expr: str) -> None:
    names = set(SELECTOR.findall(expr))
    assert names, f"{title}: no metric selector in {expr}"
    assert names <= exported(), f"{title}: {sorted(names - exported())} are exported by neither kvflow nor vLLM"
    assert 'namespace="$namespace"' in expr


def test_kvflow_itself_has_panels_for_the_gateway_router_pd_nixl_and_batch() -> None:
    queried = {name for _, expr in QUERIES for name in SELECTOR.findall(expr)}
    assert queried >= {
        "kvflow_gateway_requests_total", "kvflow_gateway_failures_total", "kvflow_gateway_queued_requests",
        "kvflow_gateway_time_to_first_token_seconds_bucket", "kvflow_gateway_http_refusals_total",
        "kvflow_router_decisions_total", "kvflow_router_scheduling_seconds_bucket", "kvflow_router_kv_events_total",
        "kvflow_router_kv_event_problems_total", "kvflow_router_kv_event_lag_seconds",
        "kvflow_router_prefix_index_blocks", "kvflow_gateway_routed_total", "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total",
        "kvflow_sim:kv_pull_failures_total", "kvflow_gateway_batch_lines_total",
        "kvflow_gateway_batch_lines_in_flight",
    }
    rows = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert rows == ["vLLM engines", "Gateway", "Router", "P/D and NIXL", "Batch"]


def test_the_hit_rate_divides_by_the_queries_themselves_so_low_traffic_reads_true() -> None:
    """clamp_min(queries, 1) made 1 hit in 2 queries over 5 minutes read 0.5/300 s ÷ 1 instead of 50 %."""
    (expr,) = [e for t, e in QUERIES if t == "Prefix cache hit rate"]
    assert "clamp_min" not in expr and "> 0" in expr
    assert not [e for _, e in QUERIES if "clamp_min" in e]
