"""Real Envoy speaking TLS to ``kvflow router``, as gateways built for the Inference Extension's
endpoint picker (EPP) do.

Two routers in front of the same simulated pods: one with a certificate from a folder (a
Secret's mount: ``--cert-path``) that demands client certificates (``--client-ca``), and one
with the default self-signed certificate. One Envoy has three listeners: with a client
certificate and server verification against the CA (mutual TLS), without a client certificate
(refused: the listener fails closed), and to the self-signed router without verification (what
GIE's gateways do by default). Each router also answers gRPC health on its own plaintext port
for the service name ``inference-extension``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvflow import certs
from kvflow.endpoints import Endpoint
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router.envoy_config import Listener, envoy_binary, render

MODEL = "sim-model"
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


@dataclass
class Stack:
    mtls: str  # Envoy listener: client certificate + verified router certificate
    no_client_cert: str  # Envoy listener: verified router, but no client certificate
    self_signed: str  # Envoy listener to the self-signed router, unverified
    health_ports: tuple[int, int]
    logs: Path


def tls_socket(*, ca: Path | None = None, cert: Path | None = None, key: Path | None = None) -> dict[str, Any]:
    context: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if ca is not None:
        context["validation_context"] = {"trusted_ca": {"filename": str(ca)},
                                         "match_typed_subject_alt_names": [
                                             {"san_type": "DNS", "matcher": {"exact": "kvflow-router"}}]}
    if cert is not None and key is not None:
        context["tls_certificates"] = [{"certificate_chain": {"filename": str(cert)},
                                        "private_key": {"filename": str(key)}}]
    return {"name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _TLS, "sni": "kvflow-router", "common_tls_context": context}}


def bootstrap(ports: list[int], routers: list[tuple[int, dict[str, Any]]], pods: list[Endpoint],
              admin: int) -> dict[str, Any]:
    """``render``'s bootstrap, with one ext_proc cluster (and TLS settings) per listener."""
    config = render([Listener("127.0.0.1", p) for p in ports], ("127.0.0.1", routers[0][0]), pods,
                    admin=("127.0.0.1", admin), expose_picked_endpoint=True)  # the tests read the pick
    clusters = config["static_resources"]["clusters"]
    template = next(c for c in clusters if c["name"] == "router")
    clusters.remove(template)
    for index, (listener, (port, socket)) in enumerate(zip(config["static_resources"]["listeners"], routers)):
        cluster = json.loads(json.dumps(template))
        cluster["name"] = f"router-{index}"
        cluster["load_assignment"]["cluster_name"] = cluster["name"]
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = port
        cluster["transport_socket"] = socket
        clusters.append(cluster)
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = cluster["name"]
    return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("envoy-tls")
    ca = certs.authority()
    server = certs.issue(ca, ["kvflow-router", "127.0.0.1"])
    client = certs.issue(ca, ["envoy-gateway"], client=True)
    secret = tmp / "secret"  # laid out as a kubernetes.io/tls Secret mounts
    secret.mkdir()
    (secret / "tls.crt").write_bytes(server.cert_pem)
    (secret / "tls.key").write_bytes(server.key_pem)
    files = {"ca.crt": ca.cert_pem, "client.crt": client.cert_pem, "client.key": client.key_pem}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    with ProcessGroup(tmp / "logs") as group:
        host = "127.0.0.70"
        port = free_port(host)
        group.start("sim", kvflow_argv("sim", "--host", host, "--port", str(port), "--profile", "fast"),
                    ready_url=f"http://{host}:{port}/health")
        pods = [Endpoint(host, port)]
        config = tmp / "router.yaml"
        config.write_text(yaml.safe_dump({"kvEvents": {"enabled": False},
                                          "pool": {"endpoints": [{"address": f"{host}:{port}", "models": [MODEL]}]}}))
        grpc_ports = [free_port(), free_port()]
        health_ports = (free_port(), free_port())
        flags = [["--cert-path", str(secret), "--client-ca", str(tmp / "ca.crt")], []]
        for index, extra in enumerate(flags):
            metrics = free_port()
            group.start(f"router{index}", kvflow_argv(
                "router", "--config", str(config), "--grpc-port", str(grpc_ports[index]),
                "--grpc-health-port", str(health_ports[index]), "--metrics-port", str(metrics), *extra),
                ready_url=f"http://127.0.0.1:{metrics}/healthz")
        listeners, admin = [free_port(), free_port(), free_port()], free_port()
        routers = [
            (grpc_ports[0], tls_socket(ca=tmp / "ca.crt", cert=tmp / "client.crt", key=tmp / "client.key")),
            (grpc_ports[0], tls_socket(ca=tmp / "ca.crt")),
            (grpc_ports[1], tls_socket()),
        ]
        (tmp / "envoy.json").write_text(json.dumps(bootstrap(listeners, routers, pods, admin)))
        group.start("envoy", [str(envoy_binary()), "-c", str(tmp / "envoy.json"), "--disable-hot-restart",
                              "-l", "warning"], ready_url=f"http://127.0.0.1:{admin}/ready")
        group.wait_ready(60)
        urls = [f"http://127.0.0.1:{p}" for p in listeners]
        yield Stack(urls[0], urls[1], urls[2], health_ports, tmp / "logs")


def post(url: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": MODEL, "prompt": "Hello over TLS", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def test_mutual_tls_between_envoy_and_the_router(stack: Stack) -> None:
    status, headers, body = post(stack.mtls)
    assert status == 200, body
    assert headers["x-kvflow-endpoint"].startswith("127.0.0.70:")  # the router picked it, over TLS
    assert json.loads(body)["choices"][0]["text"]


def test_without_a_client_certificate_the_router_refuses(stack: Stack) -> None:
    status, headers, _ = post(stack.no_client_cert)
    assert status >= 500 and "x-kvflow-endpoint" not in headers  # the TLS handshake fails: fail closed


def test_self_signed_router_by_default(stack: Stack) -> None:
    status, headers, _ = post(stack.self_signed)
    assert status == 200 and headers["x-kvflow-endpoint"].startswith("127.0.0.70:")


@pytest.mark.parametrize("service", ["inference-extension", "", "liveness", "readiness"])
def test_grpc_health_on_its_own_plaintext_port(stack: Stack, service: str) -> None:
    for port in stack.health_ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_needs_an_explicit_opt_out() -> None:
    from kvflow.router.cli import parse_args

    assert parse_args([]).secure_serving is True
    assert parse_args(["--no-secure-serving"]).secure_serving is False
