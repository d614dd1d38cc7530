"""/metrics: one registry with the gateway's families and every pool router's, each family once."""

from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest

from kvflow.endpoints import Endpoint
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kvflow.gateway.server import start_gateway
from kvflow.router.observability import RouterMetrics
from tests.gateway.fakes import ScriptedRouter



def rendered(metrics: GatewayMetrics) -> list[str]:
    """The fast render's lines, once it is checked to be ``generate_latest``'s byte for byte."""
    fast = metrics.render()
    reference = CollectorRegistry(auto_describe=False)
    reference.register(metrics.registry)
    assert fast == generate_latest(reference)
    return fast.decode().splitlines()


def test_router_registries_merge_family_by_family() -> None:
    gateway = GatewayMetrics()
    gateway.count(gateway.requests, "m", "200")
    for pool, n in (("a", 1), ("b", 3)):
        router = RouterMetrics(pool)
        router.decisions.labels(pool, "default", "aggregated").inc(n)
        gateway.join(router.registry)
    lines = rendered(gateway)
    assert lines.count("# TYPE kvflow_router_decisions_total counter") == 1
    assert 'kvflow_router_decisions_total{pool="a",profile="default",result="aggregated"} 1.0' in lines
    assert 'kvflow_router_decisions_total{pool="b",profile="default",result="aggregated"} 3.0' in lines
    assert 'kvflow_gateway_requests_total{model="m",status="200"} 1.0' in lines


def test_histograms_are_cumulative_with_le_buckets() -> None:
    metrics = GatewayMetrics()
    e2e = metrics.model("m").e2e
    for seconds in (0.001, 0.003, 0.2, 500.0):  # 0.001 sits in the le="0.001" bucket
        e2e.observe(seconds)
    lines = metrics.render().decode().splitlines()
    for le, count in (("0.001", 1.0), ("0.005", 2.0), ("0.25", 3.0), ("120.0", 3.0), ("+Inf", 4.0)):
        assert f'kvflow_gateway_request_duration_seconds_bucket{{le="{le}",model="m"}} {count}' in lines
    assert 'kvflow_gateway_request_duration_seconds_count{model="m"} 4.0' in lines
    assert 'kvflow_gateway_request_duration_seconds_sum{model="m"} 500.204' in lines


def test_the_fast_render_is_generate_latest_byte_for_byte() -> None:
    metrics = GatewayMetrics()
    for model in ("m", 'quo"te', "new\nline", "ünïcode"):
        m = metrics.model(model)
        for seconds in (0.0005, 0.001, 0.2, 3.0, 500.0):
            m.ttft.observe(seconds)
            m.itl.observe(seconds / 10)
            m.e2e.observe(seconds * 2)
        m.inflight.set(3)
        m.queued.set(0.5)
        metrics.count(metrics.requests, model, "200")
        metrics.count(metrics.mode, model, "pd")
    metrics.count(metrics.failures, "m", "midstream")
    metrics.http_refusals = {"write_timeout": 2, "header_too_large": 1}
    fast = metrics.render()
    reference = CollectorRegistry(auto_describe=False)
    reference.register(metrics.registry)  # the same families, through prometheus_client
    assert fast == generate_latest(reference)
    assert 'kvflow_gateway_http_refusals_total{reason="write_timeout"} 2.0' in fast.decode().splitlines()
    metrics.http_refusals = {"write_timeout": 5}
    assert 'kvflow_gateway_http_refusals_total{reason="write_timeout"} 5.0' in metrics.render().decode().splitlines()


def test_a_joined_router_renders_on_the_same_registry_as_generate_latest_would() -> None:
    metrics = GatewayMetrics()
    metrics.count(metrics.requests, "m", "200")
    router = RouterMetrics("pool-a")
    router.prompt_tokens.labels("pool-a").inc(5)
    router.in_flight.labels("pool-a", "10.0.0.1:8000").set(2)
    metrics.join(router.registry)
    lines = rendered(metrics)
    assert 'kvflow_router_prompt_tokens_total{pool="pool-a"} 5.0' in lines
    assert 'kvflow_router_endpoint_in_flight{endpoint="10.0.0.1:8000",pool="pool-a"} 2.0' in lines
    assert lines.index('kvflow_gateway_requests_total{model="m",status="200"} 1.0') < lines.index(
        'kvflow_router_prompt_tokens_total{pool="pool-a"} 5.0')


async def test_the_gateway_metrics_route_refreshes_and_renders_each_pool_router() -> None:
    routers = {"a": ScriptedRouter([Endpoint("127.0.0.2", 1)], metrics=RouterMetrics("a")),
               "b": ScriptedRouter([Endpoint("127.0.0.3", 1)], metrics=RouterMetrics("b"))}
    routers["a"].started.extend(["r1", "r2"])  # two requests in flight on a's pod, none on b's
    config = GatewayConfig.model_validate({"host": "127.0.0.1", "port": 0,
                                           "pools": [{"model": m, "endpoints": ["127.0.0.9:1"]} for m in routers]})
    running = await start_gateway(config, routers)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{running.port}/metrics") as r:
                assert r.status == 200 and r.headers["content-type"] == CONTENT_TYPE
                lines = (await r.text()).splitlines()
    finally:
        await running.close()
    assert lines.count("# TYPE kvflow_router_endpoint_in_flight gauge") == 1
    assert 'kvflow_router_endpoint_in_flight{endpoint="scripted",pool="a"} 2.0' in lines
    assert 'kvflow_router_endpoint_in_flight{endpoint="scripted",pool="b"} 0.0' in lines
