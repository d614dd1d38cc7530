"""vLLM's ``http_request*`` metric families: what prometheus-fastapi-instrumentator 8.1 records for
vLLM 0.32's API server (``vllm/entrypoints/serve/instrumentator/metrics.py``), for aiohttp.

vLLM calls ``Instrumentator(excluded_handlers=[...]).add()``: the default instrumentation, with
``should_group_status_codes`` (``2xx``), ``should_group_untemplated`` (an unrouted path counts as
handler ``none``) and no rounding. Per request it records:

* ``http_requests_total{handler,method,status}``
* ``http_request_size_bytes{handler}`` (summary of the request's Content-Length header, 0 without)
* ``http_response_size_bytes{handler}`` (the response's Content-Length, 0 for a stream)
* ``http_request_duration_highr_seconds`` (no labels, 21 buckets)
* ``http_request_duration_seconds{handler,method}`` (buckets 0.1, 0.5, 1)

Durations run from the request reaching the app until its handler returns (a stream's last
chunk included), in ``time.perf_counter`` (the instrumentator's ``default_timer``). A handler
excluded by vLLM (a regex *search* over the route: ``/metrics``, ``/health``, ``/load``,
``/ping``, ``/version``, ``/server_info``) records nothing; neither do the simulator's own
``/_sim/`` routes, which vLLM does not have.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvflow.exposition import Counter, Histogram, Registry, Summary

VLLM_EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
SIM_EXCLUDED_HANDLERS = ("^/_sim/",)
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60)
LOWR_BUCKETS = (0.1, 0.5, 1)
_SIZE_DOC = ("Content length of {} by handler. Only value of header is respected. Otherwise ignored. "
             "No percentile calculated. ")
_PREPARED = web.RequestKey("kvflow_sim_prepared_status", dict)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpMetrics:
    def __init__(self, registry: Registry) -> None:
        self.requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.request_size = Summary("http_request_size_bytes", _SIZE_DOC.format("incoming requests"), ["handler"],
                                    registry=registry)
        self.response_size = Summary("http_response_size_bytes", _SIZE_DOC.format("outgoing responses"),
                                     ["handler"], registry=registry)
        self.latency_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
            buckets=HIGHR_BUCKETS, registry=registry).labels()
        self.latency_lowr = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
            ["method", "handler"], buckets=LOWR_BUCKETS, registry=registry)
        self._excluded = [re.compile(p) for p in (*VLLM_EXCLUDED_HANDLERS, *SIM_EXCLUDED_HANDLERS)]

    def record(self, *, method: str, handler: str, status: int, request_size: int, response_size: int,
               seconds: float) -> None:
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.request_size.labels(handler).observe(request_size)
        self.response_size.labels(handler).observe(response_size)
        self.latency_highr.observe(seconds)
        self.latency_lowr.labels(method, handler).observe(seconds)

    def instrument(self, app: web.Application) -> None:
        """Record every request ``app`` serves. The middleware goes first (outermost), so it sees
        the status the error middleware gave an exception; a response-prepare hook tells it the
        status of a stream that was cut off (a client gone mid-stream is a 2xx, as in vLLM)."""
        app.middlewares.insert(0, self._middleware)
        app.on_response_prepare.append(self._on_prepare)

    @staticmethod
    async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        prepared = request.get(_PREPARED)
        if prepared is not None:
            prepared["status"] = response.status

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None and request.match_info.http_exception is None else None
        if any(p.search(path or request.path) for p in self._excluded):
            return await handler(request)
        start = time.perf_counter()
        prepared: dict[str, int] = {}
        request[_PREPARED] = prepared
        status, size = 500, 0
        try:
            response = await handler(request)
            status = response.status
            size = (response.content_length or 0) if type(response) is web.Response else 0
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = prepared.get("status", 500)
            raise
        finally:
            self.record(method=request.method, handler=path or "none", status=status,
                        request_size=_content_length(request), response_size=size,
                        seconds=max(time.perf_counter() - start, 0.0))


def _content_length(request: web.Request) -> int:
    try:
        return int(request.headers.get("Content-Length", 0))
    except ValueError:
        return 0
