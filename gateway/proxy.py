"""Upstream calls: one attempt per pod, retried on the router's next candidate, and the
pass-through of streamed answers.

A failure is retried only while nothing has reached the client: a refused or reset
connection, a timeout, a 5xx, or a stream that ends before its first chunk. The client's
response headers are therefore sent only once the first chunk is in hand; after that a
dying pod ends the stream with an OpenAI-style error event (what vLLM itself sends), and a
client that goes away closes the upstream connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


from kvflow.errors import KvflowError, UpstreamError
from kvflow.gateway.body import scrub_answer
from kvflow.gateway.config import TimeoutConfig
from kvflow.gateway.http1 import ConnectError, ConnectionPool, Response
from kvflow.gateway.httpserver import Responder
from kvflow.endpoints import Endpoint
from kvflow.routing_headers import ROUTE

log = logging.getLogger("kvflow.gateway")
SSE_CONTENT_TYPE = "text/event-stream"
_DONE = b"data: [DONE]\n\n"


class AttemptFailed(Exception):
    """One pod failed before anything reached the client; ``dead`` when it could not be reached."""

    def __init__(self, reason: str, message: str, *, dead: bool = False) -> None:
        super().__init__(message)
        self.reason, self.dead = reason, dead


OnFailure = Callable[[Endpoint, AttemptFailed], None]
OnAttempt = Callable[[Endpoint], None]


@dataclass(slots=True)
class Exchange:
    """What the gateway learns about one request while serving it (access log and metrics)."""

    request_id: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    model: str = "unknown"
    key: str = "-"
    status: int = 0
    mode: str = "-"
    endpoint: Endpoint | None = None
    """The pod that answered."""
    retries: int = 0
    error: str | None = None
    first_token: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    prefill: Endpoint | None = None
    """The pod asked to prefill (P/D), whether or not it did."""
    cached_tokens: int = 0
    """Prompt tokens the router expected cached on its pick."""
    explain: bool = False
    """The client asked (``x-kvflow-explain``, where allowed) for the ``x-kvflow-route`` header."""

    @property
    def upstream(self) -> str:
        return "-" if self.endpoint is None else self.endpoint.id

    def route_headers(self) -> list[tuple[str, str]]:
        """``x-kvflow-route: pod=…; mode=aggregated|pd|pd_fallback; prefill=…|-; cached_tokens=N``, if asked."""
        if not self.explain:
            return []
        prefill = "-" if self.prefill is None else self.prefill.id
        return [(ROUTE, f"pod={self.upstream}; mode={self.mode}; prefill={prefill}; cached_tokens={self.cached_tokens}")]


def sse_error(exc: KvflowError) -> bytes:
    """An error event in the shape vLLM streams, which the OpenAI clients raise as APIError."""
    return b"data: " + json.dumps(exc.body()).encode() + b"\n\n" + _DONE


class Upstream:
    """The gateway's connections to the pods: one keep-alive pool, shared by all requests."""

    def __init__(self, timeouts: TimeoutConfig) -> None:
        self.timeouts = timeouts
        self.pool = ConnectionPool(timeouts.connect)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.pool.close()

    async def send(self, endpoint: Endpoint, path: str, body: bytes, headers: Mapping[str, str],
                   timeout: float | None = None) -> Response:
        """The pod's response, headers read within ``timeout`` (default ``timeouts.first_byte``).

        A 5xx, a 404 (the gateway checked the model: a pod that does not know it serves another)
        or an unreachable pod raises AttemptFailed: nothing has reached the client, so the next
        candidate may serve it, and the router counts the failure against the pod."""
        timeout = timeout or self.timeouts.first_byte
        try:
            response = await self.pool.post(endpoint.host, endpoint.port, path, body, headers.items(),
                                            timeout=timeout)
        except ConnectError as exc:
            raise AttemptFailed("connect", f"{endpoint.id}: {exc}", dead=True) from None
        except TimeoutError:
            raise AttemptFailed("timeout", f"{endpoint.id}: no answer in {timeout:g}s") from None
        except OSError as exc:
            raise AttemptFailed("disconnect", f"{endpoint.id}: {exc}") from None
        if response.status >= 500 or response.status == 404:
            detail = await self._drain(response)
            raise AttemptFailed(f"status_{response.status}", f"{endpoint.id}: HTTP {response.status} {detail}")
        return response

    async def read_body(self, endpoint: Endpoint, response: Response) -> bytes:
        try:
            body = await response.read(self.timeouts.idle)
        except (OSError, TimeoutError) as exc:
            response.close()
            raise AttemptFailed("body", f"{endpoint.id}: answer cut short: {exc}") from None
        except asyncio.CancelledError:  # the client left: closing the connection aborts the pod's generation
            response.close()
            raise
        response.release()
        return body

    async def first_chunk(self, endpoint: Endpoint, response: Response, timeout: float | None = None) -> bytes:
        try:
            chunk = await response.readany(timeout or self.timeouts.first_byte)
        except (OSError, TimeoutError) as exc:
            response.close()
            raise AttemptFailed("stream_start", f"{endpoint.id}: stream failed: {exc}") from None
        except asyncio.CancelledError:  # the client left before the first token: the pod stops too
            response.close()
            raise
        if not chunk:
            response.close()
            raise AttemptFailed("stream_start", f"{endpoint.id}: stream ended before its first chunk")
        return chunk

    async def _drain(self, response: Response) -> str:
        try:
            text = (await response.read(self.timeouts.idle))[:200].decode(errors="replace")
        except (OSError, TimeoutError):
            text = ""
        except asyncio.CancelledError:
            response.close()
            raise
        response.release()
        return text


@dataclass(frozen=True, slots=True)
class Answer:
    """A pod's answer that nothing has been sent of yet: a whole body, or a stream's first chunk."""

    endpoint: Endpoint
    response: Response
    body: bytes | None = None
    first_chunk: bytes | None = None


async def try_targets(upstream: Upstream, ex: Exchange, targets: Sequence[Endpoint], path: str,
                      body: bytes, headers: Mapping[str, str], *, stream: bool,
                      on_attempt: OnAttempt | None = None, on_failure: OnFailure | None = None,
                      first_byte: float | None = None) -> Answer:
    """The first pod in ``targets`` that answers; UpstreamError when none does.

    ``on_attempt(endpoint)`` hears about every attempt before it is sent, and
    ``on_failure(endpoint, failure)`` about every one that failed (metrics, the router's accounting).
    Each attempt has ``first_byte`` seconds (``first_byte_timeout``) until its first chunk, or
    its whole answer when not streamed.
    """
    failures: list[str] = []
    timeout = first_byte or upstream.timeouts.first_byte
    for endpoint in targets:
        if failures:
            ex.retries += 1
        if on_attempt is not None:
            on_attempt(endpoint)
        try:
            due = time.monotonic() + timeout  # not the loop's clock: looking the loop up costs a getpid()
            response = await upstream.send(endpoint, path, body, headers, timeout)
            ex.endpoint = endpoint
            if stream and response.status == 200:
                chunk = await upstream.first_chunk(endpoint, response, max(0.001, due - time.monotonic()))
                return Answer(endpoint, response, first_chunk=chunk)
            return Answer(endpoint, response, body=await upstream.read_body(endpoint, response))
        except AttemptFailed as failure:
            failures.append(_said(failure.reason))
            if on_failure is not None:
                on_failure(endpoint, failure)
            else:
                log.warning("request %s: attempt on %s failed: %s", ex.request_id, endpoint.id, failure)
    # the client learns what went wrong, not which pods exist (their addresses are in the log)
    tried = f"{len(failures)} attempt(s) failed: {', '.join(failures)}" if failures else "no endpoint to try"
    raise UpstreamError(f"no model server could serve the request ({tried})")


def first_byte_timeout(timeouts: TimeoutConfig, body: Mapping[str, Any], *, batch: bool = False) -> float:
    """Seconds an attempt may take to its first byte: ``first_byte`` for a stream's first chunk
    (interactive: a hung pod is left for the next one soon); a non-streamed answer's head comes
    with the whole answer, so it also gets ``per_token`` for each token it may generate (at most
    ``answer``); a Batch API line gets ``batch``."""
    if batch:
        return timeouts.batch
    if body.get("stream") is True:
        return timeouts.first_byte
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        return timeouts.answer
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return min(timeouts.answer, timeouts.first_byte + timeouts.per_token * tokens * choices)


def _said(reason: str) -> str:
    return f"HTTP {reason[7:]}" if reason.startswith("status_") else reason


def whole_response(out: Responder, ex: Exchange, answer: Answer) -> None:
    assert answer.body is not None
    ex.status = answer.response.status
    out.send(ex.status, scrub_answer(answer.body), [("Content-Type", answer.response.content_type or "application/json"),
                                      ("X-Request-Id", ex.request_id), *ex.route_headers()])


async def stream_response(out: Responder, ex: Exchange, answer: Answer, idle: float) -> None:
    """Pass a stream through chunk by chunk as it arrives; never buffer.

    The head goes out with the first chunk, in one write. A pod that fails mid-stream ends the
    client's stream with an error event; a client that goes away closes (not releases) the pod's
    connection, which makes vLLM abort the request."""
    upstream = answer.response
    ex.status = upstream.status
    now = time.perf_counter()
    ex.first_token = now - ex.start
    try:
        out.start(upstream.status, [("Content-Type", upstream.content_type or SSE_CONTENT_TYPE),
                                    ("Cache-Control", "no-cache"), ("X-Request-Id", ex.request_id),
                                    *ex.route_headers()])
        await out.write(answer.first_chunk or b"")
        try:
            await relay(upstream, out, idle, ex.chunk_gaps, now)
        except ConnectionResetError:  # the client's (a ResponseError is the pod's)
            raise
        except (OSError, TimeoutError) as exc:
            await out.write(_midstream(upstream, ex, exc))
        out.end()
    except ConnectionResetError:
        upstream.close()
        ex.error = "client_disconnect"
    except asyncio.CancelledError:
        upstream.close()
        ex.error = "client_disconnect"
        raise


async def relay(upstream: Response, out: Responder, idle: float, gaps: list[float] | None = None,
                last: float = 0.0) -> None:
    """The rest of ``upstream``'s body, each piece written on to the client from the pod
    connection's data callback (no task wake-up per token), then the pod connection released.

    The one stream relay: the gateway's streamed answers and the sidecar's pass-through both run
    it. A client that stops reading pauses the pod (``drain``). With ``gaps``, the time between
    pieces is appended to it, counted from ``last`` (``time.perf_counter``). Raises
    ConnectionResetError when the client has gone, OSError or TimeoutError (nothing for ``idle``
    seconds) when the pod fails; the caller then closes ``upstream``."""
    forward = out.write_now if gaps is None else _timed(out.write_now, gaps, last)
    await upstream.pipe(forward, out.drain, idle)
    upstream.release()


def _timed(write: Callable[[bytes], bool], gaps: list[float], last: float) -> Callable[[bytes], bool]:
    """``write``, appending to ``gaps`` the time since the previous piece (the first: since ``last``)."""
    append, clock = gaps.append, time.perf_counter

    def forward(chunk: bytes) -> bool:
        nonlocal last
        now = clock()
        append(now - last)
        last = now
        return write(chunk)

    return forward


def _midstream(upstream: Response, ex: Exchange, exc: BaseException) -> bytes:
    """The pod failed mid-stream: drop its connection; the error event that ends the client's stream."""
    upstream.close()
    ex.error = "midstream"
    log.warning("request %s: %s failed mid-stream: %s", ex.request_id, ex.upstream, exc)
    return sse_error(UpstreamError(
        f"the model server failed mid-stream ({type(exc).__name__}); the answer is incomplete"
    ))


def send_json(out: Responder, status: int, data: object, request_id: str,
              extra: Sequence[tuple[str, str]] = ()) -> None:
    body = json.dumps(data, separators=(",", ":")).encode()
    out.send(status, body, [("Content-Type", "application/json"), ("X-Request-Id", request_id), *extra])


def send_error(out: Responder, exc: KvflowError, request_id: str) -> None:
    send_json(out, exc.status, exc.body(), request_id, list(exc.headers().items()))
