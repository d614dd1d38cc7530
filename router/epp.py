"""The router as a Gateway API Inference Extension endpoint picker (EPP): TLS and gRPC health.

GIE's EPP serves ext_proc over TLS by default, with a self-signed certificate unless
``--cert-path`` names a folder holding ``tls.crt`` and ``tls.key`` (a Secret's mount);
``--secure-serving=false`` is the explicit way to plaintext. Gateways built for it speak TLS
to the picker. Its gRPC health service runs on a port of its own (9003), in plaintext because
kubelet's gRPC probes speak no TLS, and answers for the service name ``inference-extension``
(the chart's probes ask for it). kvflow's router does the same, and can also require client
certificates signed by a CA (``--client-ca``): mutual TLS between gateway and picker.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from grpc_health.v1 import health_pb2

from kvflow import certs
from kvflow.router.grpc_h2 import CallError, GrpcServer, Message, Method, Status

log = logging.getLogger(__name__)

HEALTH_SERVICE = "inference-extension"
# Answered SERVING as well: the EPP chart's probes with leader election, grpc's overall status,
# and the ext_proc service itself.
HEALTH_SERVICES = ("", HEALTH_SERVICE, "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@dataclasses.dataclass(frozen=True, slots=True)
class TlsOptions:
    secure: bool = True
    cert_path: Path | None = None  # a folder with tls.crt and tls.key
    client_ca: Path | None = None  # require client certificates signed by this CA bundle


def server_ssl_context(options: TlsOptions, hosts: tuple[str, ...] = ()) -> ssl.SSLContext | None:
    """The ext_proc port's TLS (HTTP/2 by ALPN, as gRPC wants); None for plaintext (only when
    asked for explicitly)."""
    if not options.secure:
        if options.client_ca is not None:
            raise ValueError("--client-ca needs TLS: drop --no-secure-serving")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if options.cert_path is not None:
        context.load_cert_chain(options.cert_path / "tls.crt", options.cert_path / "tls.key")
    else:
        pair = certs.self_signed(hosts or ("localhost", socket.gethostname()))
        log.info("ext_proc TLS: a self-signed certificate (give --cert-path for your own)")
        with tempfile.TemporaryDirectory() as folder:  # the ssl module loads keys from files only
            cert, key = Path(folder) / "tls.crt", Path(folder) / "tls.key"
            cert.write_bytes(pair.cert_pem)
            key.write_bytes(pair.key_pem)
            context.load_cert_chain(cert, key)
    if options.client_ca is not None:
        context.load_verify_locations(cadata=options.client_ca.read_text())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def health_methods() -> dict[str, Method]:
    """gRPC health's ``Check``: SERVING for ``HEALTH_SERVICES``, NOT_FOUND for others (as
    grpcio's health servicer answers); ``Watch`` is not served (UNIMPLEMENTED)."""

    async def check(requests: AsyncIterator[health_pb2.HealthCheckRequest]) -> AsyncIterator[Message]:
        async for request in requests:
            if request.service not in HEALTH_SERVICES:
                raise CallError(Status.NOT_FOUND, f"unknown service {request.service!r}")
            yield _SERVING
            return

    return {"/grpc.health.v1.Health/Check": Method(health_pb2.HealthCheckRequest, check)}


_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def serve_health(host: str, port: int) -> GrpcServer:
    """A plaintext gRPC server with only the health service (kubelet's probes)."""
    server = GrpcServer(health_methods())
    try:
        await server.start(host, port)
    except OSError as exc:
        raise OSError(f"cannot bind the gRPC health server to {host}:{port}: {exc.strerror or exc}") from None
    return server
