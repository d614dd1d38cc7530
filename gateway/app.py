"""The gateway: OpenAI routes in, pods out.

``Gateway.handle`` owns the edges of every request: it names it (``X-Request-Id``, passed
upstream), turns any exception into OpenAI's error JSON (never a traceback), and records the
metrics and the JSON access log. The route handlers only parse, admit, schedule and forward;
the body a client sent is forwarded byte for byte unless P/D must add ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvflow import openai_api
from kvflow.errors import KvflowError, ModelNotFoundError, NoCapacityError, from_exception
from kvflow.gateway.accesslog import AccessLog
from kvflow.gateway.auth import ApiKey, Authenticator
from kvflow.gateway.body import client_body, parse_json
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.flow import Rate, RateLimiter
from kvflow.gateway.hold import Hold
from kvflow.gateway.httpserver import HttpServer, Request, Responder
from kvflow.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kvflow.gateway.pd import decode_body, encode, prefill
from kvflow.gateway.pools import Pool, PoolRouter, build_pool, build_router
from kvflow.gateway.proxy import (
    AttemptFailed, Exchange, Upstream, first_byte_timeout, send_error, send_json, stream_response, try_targets,
    whole_response,
)
from kvflow.gateway.validation import validate
from kvflow.router import status_api
from kvflow.router.dashboard import HEADERS as PAGE_HEADERS, PAGE_PATH, page_file
from kvflow.router.flight import Flight
from kvflow.router.request import Incoming, PoolNames, tokens_off_loop
from kvflow.endpoints import Endpoint
from kvflow.routing_headers import EXPLAIN, PRIORITY, header_priority, strip_client_routing

if TYPE_CHECKING:  # the Batch API's service is built on the gateway: named here for its type only
    from kvflow.gateway.batch.service import BatchService

log = logging.getLogger("kvflow.gateway")
access_log = logging.getLogger("kvflow.gateway.access")

Route = Callable[[Request, Responder, Exchange], Awaitable[None]]
_QUIET_PATHS = frozenset({"/health", "/metrics", status_api.STATUS_PATH})


class RouteError(KvflowError):
    """An unknown path (404) or a wrong method (405), in our tree's JSON shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]
        self.type = "NotFoundError" if status == 404 else "MethodNotAllowedError"  # type: ignore[misc]


class Gateway:
    def __init__(self, config: GatewayConfig, pools: Mapping[str, Pool], auth: Authenticator,
                 metrics: GatewayMetrics, upstream: Upstream) -> None:
        self.config, self.pools, self.auth, self.metrics, self.upstream = config, dict(pools), auth, metrics, upstream
        # model or LoRA name -> (pool, adapter); an adapter is scheduled in its base model's pool
        self.names: dict[str, tuple[Pool, str | None]] = {name: (pool, None) for name, pool in self.pools.items()}
        self.loras: dict[str, str] = {}
        self.pool_names: dict[str, PoolNames] = {name: PoolNames(name) for name in self.pools}
        for pc in config.pools:
            if pc.model in self.pools:
                self.pool_names[pc.model] = PoolNames(pc.model, frozenset(pc.loras))
            for lora in pc.loras:
                if pc.model in self.pools:
                    self.names[lora] = (self.pools[pc.model], lora)
                    self.loras[lora] = pc.model
        default = config.flow.default_rate
        self.limiter = RateLimiter(auth.rates(), Rate(default.rate, default.burst) if default else None)
        self.created = int(time.time())
        self.routes: dict[str, tuple[str, Route]] = {
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/models": ("GET", self.models),
            "/tokenize": ("POST", self.tokenize),
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.prometheus),
            status_api.STATUS_PATH: ("GET", self.status),
        }
        self.mounts: dict[str, Route] = {PAGE_PATH: self.dashboard}
        """Path prefixes served by a sub-application that checks methods itself (the Batch API)."""
        self.pod_stats = status_api.PodStats()
        self.batch_service: BatchService | None = None
        """The Batch API's service, when enabled (its active batches are in the status API)."""
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._attempts = config.max_attempts
        self._idle = config.timeouts.idle
        self._priority_header = config.flow.priority_header.lower()
        self._forward_auth = not auth.enabled  # pods behind an open gateway may want the client's key
        self._allowed_headers = frozenset(config.allow_client_headers)
        self._max_depth = config.http.max_json_depth
        self.access = AccessLog(access_log) if config.access_log else None
        self.http: HttpServer | None = None
        """The server in front of this gateway, once listening (its refusals are in /metrics)."""

    def close(self) -> None:
        """Write out what the access log still holds."""
        if self.access is not None:
            self.access.flush()

    # --- the edges: naming, errors, metrics, access log -------------------------------------

    async def handle(self, request: Request, out: Responder) -> None:
        ex = Exchange(request.headers.get("x-request-id") or f"{self._id_prefix}-{next(self._ids)}", request.path)
        try:
            route = self.routes.get(request.path)
            if route is None:
                await self._mounted(request.path)(request, out, ex)
            else:
                if request.method != route[0]:
                    raise RouteError(405, f"{request.path} takes {route[0]}, not {request.method}")
                await route[1](request, out, ex)
        except KvflowError as exc:
            self._fail(out, ex, exc)
        except asyncio.CancelledError:
            ex.status, ex.error = 499, ex.error or "client_disconnect"
            self._record(ex)
            raise
        except Exception as exc:  # a bug: logged with its traceback here, never sent to the client
            log.exception("request %s failed", ex.request_id)
            self._fail(out, ex, from_exception(exc))
        if not ex.status:
            ex.status = out.status
        if ex.path not in _QUIET_PATHS:
            self._record(ex)

    def _mounted(self, path: str) -> Route:
        for prefix, route in self.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                return route
        raise RouteError(404, f"no route for {path}")

    def _fail(self, out: Responder, ex: Exchange, exc: KvflowError) -> None:
        ex.status, ex.error = exc.status, ex.error or type(exc).__name__
        if not out.closed and not out.started:  # a stream already begun has ended with its error event
            send_error(out, exc, ex.request_id)

    def _record(self, ex: Exchange) -> None:
        elapsed = time.perf_counter() - ex.start
        pool = self.pools.get(ex.model)
        if pool is not None:
            m = pool.metrics
            m.e2e.observe(elapsed)
            if ex.first_token is not None:
                m.ttft.observe(ex.first_token)
                for gap in ex.chunk_gaps:
                    m.itl.observe(gap)
        if ex.endpoint is not None:
            self.pod_stats.observe(ex.endpoint.id, ex.status, ex.first_token, ex.chunk_gaps)
        self.metrics.count(self.metrics.requests, ex.model, str(ex.status))
        if ex.error:
            self.metrics.count(self.metrics.failures, ex.model, ex.error)
        if self.access is not None:
            self.access.write({
                "ts": round(time.time(), 3), "request_id": ex.request_id, "path": ex.path, "model": ex.model,
                "key": ex.key, "status": ex.status, "mode": ex.mode, "upstream": ex.upstream,
                "prefill": None if ex.prefill is None else ex.prefill.id,
                "retries": ex.retries, "ttft_ms": None if ex.first_token is None else round(ex.first_token * 1e3, 3),
                "duration_ms": round(elapsed * 1e3, 3), "error": ex.error,
            })

    # --- routes ---------------------------------------------------------------------------

    async def completions(self, request: Request, out: Responder, ex: Exchange) -> None:
        await self._generate(request, out, ex, "completions")

    async def chat(self, request: Request, out: Responder, ex: Exchange) -> None:
        await self._generate(request, out, ex, "chat")

    async def models(self, request: Request, out: Responder, ex: Exchange) -> None:
        self.auth.check(request.headers.get("authorization"))
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "kvflow",
                 "root": name, "parent": self.loras.get(name)} for name in self.names]
        send_json(out, 200, {"object": "list", "data": data}, ex.request_id)

    async def tokenize(self, request: Request, out: Responder, ex: Exchange) -> None:
        """vLLM's ``/tokenize`` (a prompt, or chat messages), answered by the gateway itself with
        its pool's tokenizer, the one the router fingerprints with: no pod is asked."""
        key = self.auth.check(request.headers.get("authorization"))
        ex.key = key.name
        body = parse_json(request.body, self._max_depth)
        req = openai_api.tokenize_request(body, lambda _model: self._pool_of(body))  # as the pods check it
        pool, _ = self._pool_of(body)
        ex.model = pool.model
        self.limiter.check(key.name)
        router = pool.router
        tokens = await tokens_off_loop(router.tokenizer, body, len(request.body))
        send_json(out, 200, openai_api.tokenize_answer(router.tokenizer, tokens, router.max_prompt_tokens, req),
                  ex.request_id)

    async def health(self, request: Request, out: Responder, ex: Exchange) -> None:
        send_json(out, 200, {"status": "ok", "models": list(self.pools)}, ex.request_id)

    async def prometheus(self, request: Request, out: Responder, ex: Exchange) -> None:
        for pool in self.pools.values():  # gauges are read when scraped: nothing on the hot path
            pool.metrics.inflight.set(pool.gate.queue.inflight)
            pool.metrics.queued.set(pool.gate.queue.waiting)
            pool.metrics.held.set(pool.hold.held if pool.hold is not None else 0)
            pool.router.refresh_gauges()  # the router's routable pods, in flight
        runner = self.batch_service.runner if self.batch_service is not None else None
        for model, n in (runner.inflight if runner is not None else {}).items():
            self.metrics.batch_in_flight.labels(model).set(n)
        if self.http is not None:
            self.metrics.http_refusals = self.http.counts
        out.send(200, self.metrics.render(), [("Content-Type", CONTENT_TYPE)])

    # --- what the gateway is doing: kvflow.router.status_api and .dashboard --------------

    async def status(self, request: Request, out: Responder, ex: Exchange) -> None:
        status_api.check_admin(self.auth, request.headers.get("authorization"))
        pools = [status_api.pool_status(p.model, p.router, admission=(p.gate.queue.inflight, p.gate.queue.waiting),
                                        stats=self.pod_stats, loras=self.pool_names[p.model].adapters)
                 for p in self.pools.values()]
        batches = await status_api.active_batches(self.batch_service)
        send_json(out, 200, status_api.status_document("gateway", pools, batches), ex.request_id,
                  [("Cache-Control", "no-store")])

    async def dashboard(self, request: Request, out: Responder, ex: Exchange) -> None:
        found = page_file(request.path)
        if found is None:
            raise RouteError(404, f"no route for {request.path}")
        if request.method != "GET":
            raise RouteError(405, f"{request.path} takes GET, not {request.method}")
        status_api.check_admin(self.auth, request.headers.get("authorization"), login=True)
        out.send(200, found[0], [("Content-Type", found[1]), *PAGE_HEADERS])

    # --- the data path --------------------------------------------------------------------

    async def _generate(self, request: Request, out: Responder, ex: Exchange, kind: str) -> None:
        key = self.auth.check(request.headers.get("authorization"))
        ex.key = key.name
        allowed = self._allowed_headers | key.allow_headers if key.allow_headers else self._allowed_headers
        strip_client_routing(request.headers, allowed)  # the router reads what is left
        ex.explain = EXPLAIN in request.headers
        body, stripped = client_body(request.body, self._max_depth, self.config.client_kv_transfer_params)
        validate(kind, body)
        if stripped:
            request.body = encode(body)  # forwarded without them
        pool, _ = self._pool_of(body)
        ex.model = pool.model
        self.limiter.check(key.name)
        if pool.hold is not None and pool.hold.empty():  # scaled to zero, or the first pod starting
            await self._held(ex, pool.hold)
        client = key.name if self.auth.enabled else request.peer  # fairness between clients
        priority = self._priority(request, key, allowed)
        await pool.gate.acquire(priority, client)
        try:
            await self._serve(request, out, ex, pool, body, priority)
        finally:
            pool.gate.release(client)

    @staticmethod
    async def _held(ex: Exchange, hold: Hold) -> None:
        try:
            await hold.wait()
        except NoCapacityError:
            ex.error = "hold_timeout"
            raise

    def _pool_of(self, body: dict[str, Any]) -> tuple[Pool, str | None]:
        """The pool serving the body's ``model`` and the LoRA adapter it names (404 for none)."""
        model = body.get("model")
        if model is None and len(self.pools) == 1:
            model = next(iter(self.pools))  # as vLLM answers with its one model when none is named
        found = self.names.get(model) if isinstance(model, str) else None
        if found is None:
            raise ModelNotFoundError(str(model))
        return found

    def _priority(self, request: Request, key: ApiKey, allowed: frozenset[str]) -> int:
        if key.priority is not None:
            return key.priority
        if PRIORITY not in allowed:  # choosing one's own priority is off unless configured
            return 0
        return header_priority(request.headers, self._priority_header)

    async def _serve(self, request: Request, out: Responder, ex: Exchange, pool: Pool, body: dict[str, Any],
                     priority: int = 0) -> None:
        """Route and forward one admitted request; ``priority`` is the router's (below 0 it may be
        shed when every pod is saturated)."""
        first_byte = first_byte_timeout(self.upstream.timeouts, body, batch=ex.mode == "batch")  # before mode is set
        flight = await pool.router.route(Incoming(body, request.headers, ex.request_id, len(request.body), priority))
        result = flight.result
        ex.prefill, ex.cached_tokens = result.prefill, result.cached_tokens
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": ex.request_id}
        if self._forward_auth and "authorization" in request.headers:
            upstream_headers["Authorization"] = request.headers["authorization"]
        with flight:  # released whatever happens below
            payload = request.body
            if result.prefill is not None:
                payload = await self._prefill(ex, pool, flight, result.prefill, request.path, body, upstream_headers)
            else:
                ex.mode = "aggregated"
            self.metrics.count(self.metrics.mode, pool.model, ex.mode)

            def failed(endpoint: Endpoint, failure: AttemptFailed) -> None:
                flight.failed(endpoint)
                self._attempt_failed(pool, endpoint, failure)

            answer = await try_targets(self.upstream, ex, result.targets[: self._attempts], request.path, payload,
                                       upstream_headers, stream=body.get("stream") is True,
                                       on_attempt=flight.send, on_failure=failed, first_byte=first_byte)
            if answer.first_chunk is None:
                flight.first_token(observe=False)  # the whole answer at once: no time to first token
                whole_response(out, ex, answer)
            else:
                flight.first_token()
                await stream_response(out, ex, answer, self._idle)
                if ex.error == "midstream":  # the pod stalled or broke after the first token: its failure too
                    flight.failed(answer.endpoint)

    async def _prefill(self, ex: Exchange, pool: Pool, flight: Flight, endpoint: Endpoint, path: str,
                       body: dict[str, Any], headers: Mapping[str, str]) -> bytes:
        flight.send_prefill(endpoint)
        try:
            params = await prefill(self.upstream, endpoint, path, body, headers)
            ex.mode = "pd"
        except AttemptFailed as failure:  # the decode pod computes the prompt itself
            self._attempt_failed(pool, endpoint, failure, retry=False)
            params, ex.mode = None, "pd_fallback"
        flight.prefill_done(ok=params is not None)
        return encode(decode_body(body, params))

    def _attempt_failed(self, pool: Pool, endpoint: Endpoint, failure: AttemptFailed, *, retry: bool = True) -> None:
        log.warning("attempt on %s failed: %s", endpoint.id, failure)
        self.metrics.count(self.metrics.failures, pool.model, failure.reason)
        if retry:
            self.metrics.count(self.metrics.retries, pool.model, failure.reason)
        if failure.dead:
            pool.router.mark_failed(endpoint)


def build_gateway(config: GatewayConfig, auth: Authenticator,
                  routers: Mapping[str, PoolRouter] | None = None) -> tuple[Gateway, dict[str, PoolRouter]]:
    """The gateway for ``config``; ``routers`` replaces the kvflow.router.Router of each model (tests)."""
    metrics = GatewayMetrics()
    chosen = dict(routers) if routers is not None else {p.model: build_router(p) for p in config.pools}
    holds = {p.model: p.hold_when_empty_seconds for p in config.pools}
    pools = {model: build_pool(model, router, config.flow, metrics, holds.get(model, 0.0))
             for model, router in chosen.items()}
    for router in chosen.values():
        metrics.join(router.metrics.registry)
    return Gateway(config, pools, auth, metrics, Upstream(config.timeouts)), chosen
