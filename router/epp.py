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
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvflow import certs

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


def server_credentials(options: TlsOptions, hosts: tuple[str, ...] = ()) -> grpc.ServerCredentials | None:
    """The ext_proc port's credentials; None for plaintext (only when asked for explicitly)."""
    if not options.secure:
        if options.client_ca is not None:
            raise ValueError("--client-ca needs TLS: drop --no-secure-serving")
        return None
    if options.cert_path is not None:
        pair = certs.KeyPair((options.cert_path / "tls.crt").read_bytes(), (options.cert_path / "tls.key").read_bytes())
    else:
        pair = certs.self_signed(hosts or ("localhost", socket.gethostname()))
        log.info("ext_proc TLS: a self-signed certificate (give --cert-path for your own)")
    client_ca = options.client_ca.read_bytes() if options.client_ca is not None else None
    return grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


async def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for service in HEALTH_SERVICES:
        await servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return servicer


async def serve_health(host: str, port: int) -> grpc.aio.Server:
    """A plaintext gRPC server with only the health service (kubelet's probes)."""
    server = grpc.aio.server()
    await add_health(server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the gRPC health server to {host}:{port}")
    await server.start()
    return server
