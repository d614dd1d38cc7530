"""One batch line through the gateway's own data path, without a client connection.

A line is scheduled, forwarded, retried on the router's fallbacks and P/D-orchestrated exactly
as an interactive request is (``Gateway._serve``); only admission differs (the batch band
instead of the gate) and the answer is captured instead of written to a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import KvflowError, NoCapacityError, RateLimitError, UpstreamError, from_exception
from kvflow.gateway.app import Gateway
from kvflow.gateway.batch.lines import ENDPOINTS, encode_body
from kvflow.gateway.body import client_body
from kvflow.gateway.httpserver import Request
from kvflow.gateway.pools import Pool
from kvflow.gateway.proxy import Exchange
from kvflow.gateway.validation import validate

BATCH_PRIORITY = -1
"""Batch lines are sheddable: when every pod is saturated the router refuses them (429, tried
again later) and sends interactive requests on, so batches use only the capacity left over."""
TRANSIENT = (UpstreamError, NoCapacityError, RateLimitError)
"""No pod could take the line now: it is tried again later rather than failed."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    request_id: str


class Transient(Exception):
    """The line could not be served now (no pod reachable); ``answer`` is what a client would get."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.body.decode(errors="replace"))
        self.answer = answer


class _Capture:
    """What ``whole_response`` writes to a client connection, kept in memory."""

    __slots__ = ("status", "body", "started", "closed")

    def __init__(self) -> None:
        self.status, self.body, self.started, self.closed = 0, b"", False, False

    def send(self, status: int, body: bytes, headers: Any = ()) -> None:
        self.status, self.body, self.started = status, body, True


@dataclass(frozen=True, slots=True)
class Prepared:
    """A line checked and matched to its pool: ready to wait for room in that pool's band."""

    pool: Pool
    lora: str | None
    body: dict[str, Any]
    payload: bytes
    """The body as sent upstream."""


def prepare(gateway: Gateway, endpoint: str, request: bytes, request_id: str) -> Prepared | Answer:
    """The line's pool, or the answer a client would get for its body (400, 404); never raises.

    The model is found as an interactive request's is (``Gateway._pool_of``: a body without one
    goes to a gateway's only pool), so a line is accepted exactly when the same body would be.
    """
    try:
        # the one body parser, with an interactive request's limits; P/D is the gateway's own
        body, changed = client_body(request, gateway.config.http.max_json_depth,
                                    gateway.config.client_kv_transfer_params)
        validate(ENDPOINTS[endpoint], body)
        pool, lora = gateway._pool_of(body)
    except Exception as exc:  # a line's answer, never an exception out of the runner
        return failed(exc, request_id)
    return Prepared(pool, lora, body, encode_body(body) if changed else request)


def failed(exc: BaseException, request_id: str) -> Answer:
    """The answer for a line that raised: ours keep their status, anything else is a 500."""
    error = from_exception(exc)
    return Answer(error.status, msgspec.json.encode(error.body()), request_id)


async def run(gateway: Gateway, line: Prepared, endpoint: str, request_id: str) -> Answer:
    """Serve the line; raise ``Transient`` when no pod could take it."""
    ex = Exchange(request_id, endpoint, model=line.pool.model, mode="batch")
    headers = {"x-request-id": request_id}
    capture = _Capture()
    try:
        # the gateway's own forwarding path: routing, retries, P/D (it only calls capture.send)
        await gateway._serve(Request("POST", endpoint, "", headers, line.payload, True),
                             capture, ex, line.pool, line.body, BATCH_PRIORITY)  # type: ignore[arg-type]
    except TRANSIENT as exc:
        raise Transient(Answer(exc.status, msgspec.json.encode(exc.body()), request_id)) from None
    except KvflowError as exc:
        return Answer(exc.status, msgspec.json.encode(exc.body()), request_id)
    if capture.status >= 500:
        raise Transient(Answer(capture.status, capture.body, request_id))
    return Answer(capture.status, capture.body, request_id)
