"""The Envoy bootstrap kvflow renders: what it lets clients do (checked on the config; the
end-to-end behaviour through a real Envoy is in test_envoy_e2e.py)."""

from __future__ import annotations

import json

import pytest

from kvflow.endpoints import Endpoint
from kvflow.router.envoy_config import Listener, render


def hcm(config: dict, i: int = 0) -> dict:  # type: ignore[type-arg]
    return config["static_resources"]["listeners"][i]["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def removed_on_ingress(config: dict) -> set[str]:  # type: ignore[type-arg]
    return {m["remove"] for ext in hcm(config)["early_header_mutation_extensions"] for m in ext["typed_config"]["mutations"]}


def test_every_listener_strips_client_routing_headers_before_routing() -> None:
    config = render([Listener("127.0.0.1", 1), Listener("127.0.0.1", 2, fail_open=True)], ("127.0.0.1", 3),
                    [Endpoint("127.0.0.2", 8000)])
    for i in (0, 1):
        names = {m["remove"] for ext in hcm(config, i)["early_header_mutation_extensions"]
                 for m in ext["typed_config"]["mutations"]}
        assert names >= {"x-gateway-destination-endpoint", "x-prefiller-host-port", "x-kvflow-profile",
                         "x-kvflow-priority"}
        assert hcm(config, i)["http_filters"][0]["name"] == "envoy.filters.http.header_mutation"  # hides the pick


def test_allowed_client_headers_are_kept_and_destinations_never_are() -> None:
    config = render([Listener("127.0.0.1", 1)], ("127.0.0.1", 3), [], allow_client_headers=["x-kvflow-profile"],
                    expose_picked_endpoint=True)
    assert "x-kvflow-profile" not in removed_on_ingress(config)
    assert "x-gateway-destination-endpoint" in removed_on_ingress(config)
    assert [f["name"] for f in hcm(config)["http_filters"]] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    with pytest.raises(ValueError):
        render([Listener("127.0.0.1", 1)], ("127.0.0.1", 3), [], allow_client_headers=["x-gateway-destination-endpoint"])


def test_only_openai_routes_are_forwarded() -> None:
    routes = hcm(render([Listener("127.0.0.1", 1)], ("127.0.0.1", 3), []))["route_config"]["virtual_hosts"][0]["routes"]
    forwarded = {(r["match"]["path"], r["match"]["headers"][0]["string_match"]["exact"]) for r in routes if "route" in r}
    assert forwarded == {("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET")}
    assert routes[-1]["match"] == {"prefix": "/"} and routes[-1]["direct_response"]["status"] == 404


def test_several_pickers_behind_one_envoy_share_its_ext_proc_cluster() -> None:
    """The Inference Extension's N endpoint-picker replicas: every request's ext_proc stream goes
    to one of them, round-robin; one picker is the same cluster with one address."""
    pickers = [("127.0.0.1", 9001), ("127.0.0.1", 9002), ("127.0.0.3", 9001)]
    clusters = {c["name"]: c for c in render([Listener("127.0.0.1", 1)], pickers, [])["static_resources"]["clusters"]}

    router = clusters["router"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in router["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == [{"address": h, "port_value": p} for h, p in pickers]
    assert router["lb_policy"] == "ROUND_ROBIN"
    assert "http2_protocol_options" in json.dumps(router)  # gRPC
    one = {c["name"]: c for c in render([Listener("127.0.0.1", 1)], ("127.0.0.1", 9001), [])["static_resources"]["clusters"]}
    assert one["router"]["load_assignment"]["endpoints"][0]["lb_endpoints"] == \
        router["load_assignment"]["endpoints"][0]["lb_endpoints"][:1]
    with pytest.raises(ValueError, match="at least one"):
        render([Listener("127.0.0.1", 1)], [], [])
