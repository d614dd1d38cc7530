"""Start and stop a gateway in a running event loop: ``serve(config)`` for the CLI and
``kvflow up``, ``start_gateway(config)`` for tests that want a handle back.

Stopping is a drain, as Kubernetes stops a pod: once ``stopping`` is set (the CLI sets it on
SIGTERM), the gateway stops listening, finishes every request it has begun (streams included)
within the grace period, and only then closes its routers and its connections to the pods. A
request sent to a replica that is stopping is refused at connect, so a Service or Envoy sends
it to another replica; none that a replica took is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.errors import (
    HeadersTooLargeError, InvalidRequestError, KvflowError, NoCapacityError, PayloadTooLargeError, RequestTimeoutError,
    UriTooLongError,
)
from kvflow.gateway import auth as auth_mod
from kvflow.gateway.app import Gateway, build_gateway
from kvflow.gateway.config import AuthConfig, GatewayConfig
from kvflow.gateway.httpserver import Handler, HttpServer, Limits, Responder, serve_http
from kvflow.gateway.pools import PoolRouter
from kvflow.gateway.proxy import send_error
from kvflow.heap import settle_heap

if TYPE_CHECKING:
    from kvflow.gateway.batch.service import BatchService

log = logging.getLogger("kvflow.gateway")

SHUTDOWN_GRACE = 25.0
"""Seconds a stopping gateway gives its requests in flight: under Kubernetes' default
``terminationGracePeriodSeconds`` (30), so it exits on its own before the SIGKILL."""


async def load_auth(config: AuthConfig) -> auth_mod.Authenticator:
    if not config.enabled:
        return auth_mod.Authenticator(None)
    keys: dict[bytes, auth_mod.ApiKey] = {}
    if config.keys_file:
        keys.update(auth_mod.load_file(config.keys_file))
    if config.secret:
        keys.update(await auth_mod.load_secret(config.secret))
    return auth_mod.Authenticator(keys)


_REJECTIONS: dict[int, type[KvflowError]] = {
    400: InvalidRequestError, 408: RequestTimeoutError, 413: PayloadTooLargeError, 414: UriTooLongError,
    431: HeadersTooLargeError, 503: NoCapacityError,
}


def reject(out: Responder, status: int, message: str) -> None:
    """Answers for requests that never reach a handler (malformed HTTP, limits, timeouts, overload)."""
    exc = _REJECTIONS.get(status, KvflowError)(message, retry_after=1.0 if status == 503 else None)
    send_error(out, exc, "-")


def limits_of(config: GatewayConfig) -> Limits:
    h = config.http
    return Limits(max_body=config.max_body_bytes, max_request_line=h.max_request_line_bytes,
                  max_header_bytes=h.max_header_bytes, max_headers=h.max_headers, header_timeout=h.header_timeout,
                  body_timeout=h.body_timeout, keep_alive_timeout=h.keep_alive_timeout,
                  write_timeout=h.write_timeout, max_connections=h.max_connections, max_pipelined=h.max_pipelined,
                  max_buffered_bodies=h.max_buffered_body_bytes)


async def listen(handler: Handler, host: str, port: int, limits: Limits | int,
                 reuse_port: bool = False) -> tuple[HttpServer, int]:
    """Serve ``handler``; ``limits`` (or just the largest body) bounds what clients may send."""
    if isinstance(limits, int):
        limits = Limits(max_body=limits)
    allowed = raise_fd_limit(limits.max_connections)
    if allowed < limits.max_connections:
        log.warning("max_connections lowered from %d to %d by the open-file limit", limits.max_connections, allowed)
        limits = dataclasses.replace(limits, max_connections=allowed)
    server = await serve_http(handler, reject, host, port, limits, reuse_port=reuse_port)
    return server, server.port


def raise_fd_limit(connections: int) -> int:
    """Let the process hold ``connections`` client sockets and as many to the pods, if the hard
    limit allows (the soft limit is often 1024): past it accept() fails instead of degrading.
    The number of client connections the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return connections if soft == resource.RLIM_INFINITY else max(1, min(connections, (soft - 256) // 2))


@dataclass
class RunningGateway:
    gateway: Gateway
    routers: dict[str, PoolRouter]
    server: HttpServer
    port: int
    batch: BatchService | None = None

    async def drain(self, grace: float = SHUTDOWN_GRACE) -> int:
        """Stop taking requests and finish those begun, for at most ``grace`` seconds; how many
        connections were cut at the deadline. ``close`` after it."""
        return await self.server.shutdown(grace)

    async def close(self) -> None:
        self.server.close()
        if self.batch is not None:
            await self.batch.close()
        self.gateway.close()
        for router in self.routers.values():
            await router.stop()
        await self.gateway.upstream.stop()


async def start_gateway(config: GatewayConfig, routers: Mapping[str, PoolRouter] | None = None) -> RunningGateway:
    """Serve ``config`` (``port=0`` picks a free port); ``routers`` stand in for kvflow.router (tests)."""
    gateway, chosen = build_gateway(config, await load_auth(config.auth), routers)
    batch = None
    if config.batch.enabled:
        from kvflow.gateway.batch.service import BatchService

        batch = BatchService(gateway, config.batch)
        gateway.batch_service = batch
    await gateway.upstream.start()
    for router in chosen.values():
        await router.start()
    server, port = await listen(gateway.handle, config.host, config.port, limits_of(config),
                                reuse_port=config.workers > 1)
    gateway.http = server
    if batch is not None:
        from kvflow.gateway.batch.service import replica_name

        await batch.resume(replica_name(config.batch, config.host, port))
    return RunningGateway(gateway, chosen, server, port, batch)


async def serve(config: GatewayConfig, stopping: asyncio.Event | None = None,
                grace: float = SHUTDOWN_GRACE) -> None:
    """Run the gateway until ``stopping`` is set, then drain it for at most ``grace`` seconds
    (or until cancelled: then it closes at once)."""
    running = await start_gateway(config)
    settle_heap()
    print(f"kvflow gateway listening on http://{config.host}:{running.port} "
          f"(models: {', '.join(p.model for p in config.pools)})", flush=True)
    try:
        await (stopping or asyncio.Event()).wait()
        log.warning("kvflow gateway stopping: finishing the requests in flight (at most %gs)", grace)
        cut = await running.drain(grace)
        if cut:
            log.warning("kvflow gateway: %d connections still busy after %gs were cut", cut, grace)
    finally:
        await running.close()
