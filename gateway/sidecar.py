"""The decode pod's sidecar for when Envoy and the endpoint picker route (llm-d's routing sidecar).

Envoy sends the request to the decode pod the picker chose, on the sidecar's port; when the
picker also chose a prefill pod it says so in ``x-prefiller-host-port``. The sidecar then runs
the prefill step there and hands the request, with the returned ``kv_transfer_params``, to
the vLLM next to it (``--upstream``). Everything else is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

from kvflow.errors import InvalidRequestError, KvflowError, UpstreamError, from_exception
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.httpserver import Request, Responder
from kvflow.gateway.pd import decode_body, encode, prefill
from kvflow.gateway.proxy import AttemptFailed, Exchange, Upstream, send_error, stream_response, try_targets, \
    whole_response
from kvflow.gateway.server import listen, settle_heap
from kvflow.openai_api import decode_json
from kvflow.endpoints import Endpoint, parse_host_port

PREFILLER_HEADER = "x-prefiller-host-port"
log = logging.getLogger("kvflow.gateway.sidecar")
_GENERATE = frozenset({"/v1/completions", "/v1/chat/completions"})
_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect"})


class Sidecar:
    def __init__(self, config: GatewayConfig, local: Endpoint) -> None:
        self.config, self.local = config, local
        self.upstream = Upstream(config.timeouts)
        self.counts: dict[str, int] = {"pd": 0, "pd_fallback": 0, "passthrough": 0}
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()

    async def handle(self, request: Request, out: Responder) -> None:
        ex = Exchange(request.headers.get("x-request-id") or f"{self._id_prefix}-{next(self._ids)}", request.path)
        try:
            if request.method == "POST" and request.path in _GENERATE and PREFILLER_HEADER in request.headers:
                await self._disaggregated(request, out, ex)
            else:
                await self._pass_through(request, out, ex)
        except KvflowError as exc:
            if not out.closed and not out.started:
                send_error(out, exc, ex.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request %s failed", ex.request_id)
            if not out.closed and not out.started:
                send_error(out, from_exception(exc), ex.request_id)

    async def _disaggregated(self, request: Request, out: Responder, ex: Exchange) -> None:
        try:
            prefiller = Endpoint(*parse_host_port(request.headers[PREFILLER_HEADER]))
        except ValueError as exc:
            raise InvalidRequestError(f"{PREFILLER_HEADER}: {exc}") from None
        body = decode_json(request.body)
        headers = {"Content-Type": "application/json", "X-Request-Id": ex.request_id}
        try:
            params = await prefill(self.upstream, prefiller, request.path, body, headers)
            ex.mode = "pd"
        except AttemptFailed as failure:  # decode computes the prompt itself: slower, but served
            log.warning("prefill on %s failed, decoding without it: %s", prefiller.id, failure)
            params, ex.mode = None, "pd_fallback"
        self.counts[ex.mode] += 1
        answer = await try_targets(self.upstream, ex, [self.local], request.path, encode(decode_body(body, params)),
                                   headers, stream=body.get("stream") is True)
        if answer.first_chunk is None:
            whole_response(out, ex, answer)
        else:
            await stream_response(out, ex, answer, self.config.timeouts.idle)

    async def _pass_through(self, request: Request, out: Responder, ex: Exchange) -> None:
        self.counts["passthrough"] += 1
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_BY_HOP]
        path = request.path + (f"?{request.query}" if request.query else "")
        try:
            response = await self.upstream.pool.post(self.local.host, self.local.port, path, request.body, headers,
                                                     timeout=self.config.timeouts.first_byte, method=request.method)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"local model server {self.local.id}: {exc}") from None
        passed = [(k, v) for k, v in response.headers.items() if k not in _HOP_BY_HOP]
        if "text/event-stream" not in response.content_type:
            try:
                data = await response.read(self.config.timeouts.idle)
            except (OSError, TimeoutError) as exc:
                response.close()
                raise UpstreamError(f"local model server {self.local.id}: {exc}") from None
            response.release()
            out.send(response.status, data, passed)
            return
        out.start(response.status, passed)
        try:
            while chunk := await response.readany(self.config.timeouts.idle):
                await out.write(chunk)
            response.release()
            out.end()
        except (OSError, TimeoutError, asyncio.CancelledError):
            response.close()
            raise


async def serve_sidecar(config: GatewayConfig, upstream: str) -> None:
    sidecar = Sidecar(config, Endpoint(*parse_host_port(upstream)))
    await sidecar.upstream.start()
    server, port = await listen(sidecar.handle, config.host, config.port, config.max_body_bytes,
                                reuse_port=config.workers > 1)
    settle_heap()
    print(f"kvflow sidecar listening on http://{config.host}:{port} -> {sidecar.local.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        server.close()
        await sidecar.upstream.stop()
