"""The decode pod's sidecar for when Envoy and the endpoint picker route (llm-d's routing sidecar).

Envoy sends the request to the decode pod the picker chose, on the sidecar's port; when the
picker also chose a prefill pod it says so in ``x-prefiller-host-port``. The sidecar then runs
the prefill step there and hands the request, with the returned ``kv_transfer_params``, to
the vLLM next to it (``--upstream``). Other requests on the allowed paths pass through.

The sidecar is a trust boundary too: its port can be reached without Envoy. So it

* sends a prompt only to a prefill pod on its allow-list (``sidecar.prefillers``; an address the
  header names that is not on it is refused with a 400: server-side request forgery);
* passes only ``sidecar.paths`` to the model server (a 404 for admin, dev and fault routes);
* refuses (or strips) ``kv_transfer_params`` in client bodies, removes other routing headers, and
  removes ``kv_transfer_params`` (engine id, host, port) from answers;
* applies the gateway's HTTP limits and timeouts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

from kvflow.errors import InvalidRequestError, KvflowError, UpstreamError, from_exception
from kvflow.gateway.allowlist import PrefillerAllowList
from kvflow.gateway.app import RouteError
from kvflow.gateway.body import client_body, scrub_answer
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.httpserver import Request, Responder
from kvflow.gateway.pd import decode_body, encode, prefill
from kvflow.gateway.proxy import AttemptFailed, Exchange, Upstream, first_byte_timeout, relay, send_error, \
    stream_response, try_targets, whole_response
from kvflow.gateway.server import limits_of, listen
from kvflow.heap import settle_heap
from kvflow.endpoints import Endpoint, parse_host_port
from kvflow.routing_headers import PREFILLER, strip_client_routing

PREFILLER_HEADER = PREFILLER
log = logging.getLogger("kvflow.sidecar")
_GENERATE = frozenset({"/v1/completions", "/v1/chat/completions"})
_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect"})


class Sidecar:
    def __init__(self, config: GatewayConfig, local: Endpoint) -> None:
        self.config, self.local = config, local
        self.upstream = Upstream(config.timeouts)
        self.prefillers = PrefillerAllowList(config.sidecar.prefillers)
        self.paths = frozenset(config.sidecar.paths)
        self.counts: dict[str, int] = {"pd": 0, "pd_fallback": 0, "passthrough": 0}
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()

    async def handle(self, request: Request, out: Responder) -> None:
        ex = Exchange(request.headers.get("x-request-id") or f"{self._id_prefix}-{next(self._ids)}", request.path)
        try:
            if request.path not in self.paths:
                raise RouteError(404, f"no route for {request.path}")
            prefiller = request.headers.get(PREFILLER_HEADER)
            strip_client_routing(request.headers)  # whatever is left goes to the model server
            if request.method == "POST" and request.path in _GENERATE and prefiller is not None:
                await self._disaggregated(request, out, ex, prefiller)
            else:
                await self._pass_through(request, out, ex)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if out.started:  # an answer cut short: the server drops the connection, so the client sees it
                raise
            if not isinstance(exc, KvflowError):
                log.exception("request %s failed", ex.request_id)
            if not out.closed:
                send_error(out, from_exception(exc), ex.request_id)

    def _prefiller(self, value: str) -> Endpoint:
        try:
            host, port = parse_host_port(value)
        except ValueError as exc:
            raise InvalidRequestError(f"{PREFILLER_HEADER}: {exc}") from None
        if not self.prefillers.allows(host, port):
            log.warning("refused %s=%s: not an allowed prefill pod", PREFILLER_HEADER, value)
            raise InvalidRequestError(f"{PREFILLER_HEADER} does not name an allowed prefill pod")
        return Endpoint(host, port)

    async def _disaggregated(self, request: Request, out: Responder, ex: Exchange, header: str) -> None:
        prefiller = self._prefiller(header)
        body, _ = client_body(request.body, self.config.http.max_json_depth, self.config.client_kv_transfer_params)
        headers = {"Content-Type": "application/json", "X-Request-Id": ex.request_id}
        try:
            params = await prefill(self.upstream, prefiller, request.path, body, headers)
            ex.mode = "pd"
        except AttemptFailed as failure:  # decode computes the prompt itself: slower, but served
            log.warning("prefill on %s failed, decoding without it: %s", prefiller.id, failure)
            params, ex.mode = None, "pd_fallback"
        self.counts[ex.mode] += 1
        answer = await try_targets(self.upstream, ex, [self.local], request.path, encode(decode_body(body, params)),
                                   headers, stream=body.get("stream") is True,
                                   first_byte=first_byte_timeout(self.config.timeouts, body))
        if answer.first_chunk is None:
            whole_response(out, ex, answer)
        else:
            await stream_response(out, ex, answer, self.config.timeouts.idle)

    async def _pass_through(self, request: Request, out: Responder, ex: Exchange) -> None:
        self.counts["passthrough"] += 1
        body, timeout = request.body, self.config.timeouts.first_byte
        if request.path in _GENERATE and body:  # parsed, not searched: JSON may spell the key with escapes
            parsed, stripped = client_body(body, self.config.http.max_json_depth, self.config.client_kv_transfer_params)
            if stripped:
                body = encode(parsed)
            timeout = first_byte_timeout(self.config.timeouts, parsed)  # a whole answer's head comes at its end
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_BY_HOP]
        path = request.path + (f"?{request.query}" if request.query else "")
        try:
            response = await self.upstream.pool.post(self.local.host, self.local.port, path, body, headers,
                                                     timeout=timeout, method=request.method)
        except (OSError, TimeoutError) as exc:
            log.warning("request %s: local model server %s: %s", ex.request_id, self.local.id, exc)
            raise UpstreamError(f"the local model server failed ({type(exc).__name__})") from None
        passed = [(k, v) for k, v in response.headers.items() if k not in _HOP_BY_HOP]
        if "text/event-stream" not in response.content_type:
            try:
                data = await response.read(self.config.timeouts.idle)
            except (OSError, TimeoutError) as exc:
                response.close()
                log.warning("request %s: local model server %s: %s", ex.request_id, self.local.id, exc)
                raise UpstreamError(f"the local model server failed ({type(exc).__name__})") from None
            except asyncio.CancelledError:  # the client left: closing the connection aborts the generation
                response.close()
                raise
            response.release()
            out.send(response.status, scrub_answer(data) if request.path in _GENERATE else data, passed)
            return
        out.start(response.status, passed)
        try:
            await relay(response, out, self.config.timeouts.idle)
            out.end()
        except (OSError, TimeoutError, asyncio.CancelledError):  # the server drops the client's connection too
            response.close()
            raise


async def serve_sidecar(config: GatewayConfig, upstream: str) -> None:
    sidecar = Sidecar(config, Endpoint(*parse_host_port(upstream)))
    await sidecar.upstream.start()
    resolver = asyncio.ensure_future(sidecar.prefillers.keep_resolving())
    server, port = await listen(sidecar.handle, config.host, config.port, limits_of(config),
                                reuse_port=config.workers > 1)
    settle_heap()
    print(f"kvflow sidecar listening on http://{config.host}:{port} -> {sidecar.local.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        resolver.cancel()
        server.close()
        await sidecar.upstream.stop()
