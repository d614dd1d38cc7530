"""The Envoy ext_proc server: the Gateway API Inference Extension's endpoint-picker protocol.

Envoy streams each HTTP request to us (``FULL_DUPLEX_STREAMED`` for bodies, as the Inference
Extension requires). Per request:

1. request headers — remembered; answered only once the body is complete (full duplex);
2. request body chunks — buffered until ``end_of_stream``; then the JSON is parsed and routed
   (one call, ``Router.route``), and we answer with a headers response that sets
   ``x-gateway-destination-endpoint`` (the pick; Envoy's ORIGINAL_DST cluster routes on it),
   ``x-prefiller-host-port`` (P/D), dynamic metadata ``envoy.lb`` /
   ``x-gateway-destination-endpoint`` = the ordered fallback list, and clears the route
   cache; then the unchanged body as a streamed body response;
3. response headers and body chunks — passed straight back (streaming stays streaming); the
   last chunk ends the request's in-flight accounting. A listener that keeps answers' bodies
   away from the picker (``response_body_mode: NONE``, ``envoy_config.Listener.response_bodies``)
   sends only the headers; Envoy ends the stream when the answer ends, and that ends the
   accounting.

No endpoint → an immediate 503; shedding → 429 (``Retry-After``); a malformed body → 400.

Limits (``ExtProcLimits``): a request body over ``max_body_bytes`` is answered 413 as soon as
its ``content-length`` or its running size says so, without buffering more of it; the bodies of
all streams together hold at most ``max_buffered_bytes`` (``kvflow.request_body.BodyBudget``: a
body that does not fit is a 503 with ``Retry-After`` before it is buffered); over
``max_streams`` concurrent requests, newcomers get a 503 with ``Retry-After`` (all as HTTP
answers, so a fail-open listener does not fall through). Routing headers a client sent are
removed before scheduling (``kvflow.routing_headers``; Envoy's bootstrap removes them too) and
the routing answer removes the ones it does not set, so nothing a client sends chooses a pod.
The body is parsed and checked by the gateway's own ``kvflow.request_body.client_body`` (depth
limit, ``kv_transfer_params`` refused with a 400 however its key is spelled).

Envoy tells the server its body modes in the first message (``protocol_config``). Besides full
duplex, the buffered request mode works too: the headers are answered at once, and the routing
header mutation rides on the body response instead (Envoy holds the headers until then). That
mode is what a fail-open listener uses, since Envoy does not fail open in full-duplex mode.
"""

from __future__ import annotations

import json
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvflow.errors import KvflowError, NoCapacityError, PayloadTooLargeError, from_exception
from kvflow.request_body import DEFAULT_BUFFERED_BODIES, DEFAULT_MAX_DEPTH, BodyBudget, client_body
from kvflow.router.flight import Flight
from kvflow.router.grpc_h2 import GrpcServer, Method
from kvflow.router.model import SchedulingResult
from kvflow.router.request import Incoming
from kvflow.router.router import Router
from kvflow.routing_headers import (
    DESTINATION, NEVER_FROM_CLIENTS, PICKED, PREFILLER, header_priority, strip_client_routing,
)

log = logging.getLogger(__name__)

DESTINATION_HEADER = DESTINATION
PREFILLER_HEADER = PREFILLER
PICKED_RESPONSE_HEADER = PICKED
LB_METADATA_NAMESPACE = "envoy.lb"
CHUNK = 62_000  # under Envoy's 64 KiB default per streamed message
FULL_DUPLEX = 4  # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
NO_BODY = 0  # ProcessingMode.BodySendMode.NONE


@dataclass(frozen=True, slots=True)
class ExtProcLimits:
    max_body_bytes: int = 8 << 20
    """Largest request body buffered; larger: 413."""
    max_streams: int = 1024
    """Requests processed at once; more: 503 with Retry-After."""
    allow_client_headers: frozenset[str] = frozenset()
    """kvflow's profile/priority headers clients may send (none by default)."""
    max_buffered_bytes: int = DEFAULT_BUFFERED_BODIES
    """Request body bytes buffered across all streams at once; a body that does not fit: 503."""
    max_json_depth: int = DEFAULT_MAX_DEPTH
    """Nesting of a JSON body; deeper: 400 (the gateway's ``http.max_json_depth``)."""

    @property
    def max_message_bytes(self) -> int:
        """A buffered body arrives as one message: let it through so that the 413 is ours."""
        return self.max_body_bytes + (1 << 20)


@dataclass(slots=True)
class _Exchange:
    """One HTTP request's state across the ext_proc stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    held: int = 0
    """Bytes this request holds of the processor's ``BodyBudget``."""
    flight: Flight | None = None
    """The request's accounting, once routed (its decision in ``flight.result``)."""
    status: int = 0
    streamed: bool = False
    finished: bool = False
    duplex_request: bool = True
    duplex_response: bool = True
    response_body: bool = True
    """Envoy sends the answer's body; without it (``NONE``) the stream's end is the answer's."""
    refused: bool = False
    """Answered with an error: whatever Envoy still sends is ignored."""


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def routing_response(result: SchedulingResult, *, on_body: bool = False) -> pb.ProcessingResponse:
    """The response that sends the request to ``result.targets[0]`` (a headers response, or in
    buffered mode a body response: either may mutate headers Envoy has not yet sent)."""
    picked = result.targets[0].id
    set_headers = [_set(DESTINATION_HEADER, picked)]
    if result.prefill is not None:
        set_headers.append(_set(PREFILLER_HEADER, result.prefill.id))
    removed = sorted(NEVER_FROM_CLIENTS - {h.header.key for h in set_headers})  # whatever a client slipped in
    mutation = pb.HeaderMutation(set_headers=set_headers, remove_headers=removed)
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    metadata = struct_pb2.Struct()  # fields set directly: Struct.update walks Python values generically
    metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = ",".join(
        t.id for t in result.targets)
    if on_body:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)


def body_responses(body: bytes, *, request: bool) -> list[pb.ProcessingResponse]:
    """``body`` streamed back to Envoy unchanged, in chunks under its message limit."""
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    return [echo(chunk, i == len(chunks) - 1, request=request) for i, chunk in enumerate(chunks)]


def echo(chunk: bytes, end: bool, *, request: bool) -> pb.ProcessingResponse:
    """One body chunk streamed back unchanged. Built in place: nested constructors copy each
    submessage into its parent (three times the cost, once per streamed token)."""
    out = pb.ProcessingResponse()
    streamed = (out.request_body if request else out.response_body).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end
    return out


def error_response(error: KvflowError) -> pb.ProcessingResponse:
    headers = [_set("content-type", "application/json")]
    headers += [_set(k.lower(), v) for k, v in error.headers().items()]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(error.body()).encode(),
            details=f"kvflow_router_{error.type}",
        )
    )


def incoming(headers: dict[str, str], body: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Incoming:
    """The request as the gateway hands it to its router, for the same routing: the body parsed
    and checked by the gateway's own ``client_body`` (a client's ``kv_transfer_params``, however
    its key is spelled, is a 400)."""
    parsed, _ = client_body(body, max_depth, "reject") if body else ({}, False)
    return Incoming(parsed, headers, headers.get("x-request-id") or uuid.uuid4().hex, len(body), priority(headers))


def priority(headers: Mapping[str, str]) -> int:
    """An allowed ``x-kvflow-priority`` (``ExtProcLimits.allow_client_headers``; stripped
    otherwise), else 0; not an integer is a 400, as on the gateway."""
    return header_priority(headers)


PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ExternalProcessor:
    """The ext_proc method: one HTTP request's exchange with Envoy, message by message."""

    def __init__(self, router: Router, limits: ExtProcLimits | None = None) -> None:
        self.router = router
        self.limits = limits or ExtProcLimits()
        self.streams = 0
        self.bodies = BodyBudget(self.limits.max_buffered_bytes)
        """Body bytes buffered across all streams."""

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = _Exchange()
        over_limit = self.streams >= self.limits.max_streams
        self.streams += 1
        try:
            async for msg in request_iterator:
                if over_limit and not ex.refused:
                    ex.refused = True  # answered once; Envoy then ends the stream
                    yield error_response(NoCapacityError(
                        "the endpoint picker is at its limit of concurrent requests; retry later", retry_after=1.0))
                    continue
                if msg.HasField("response_body") and not ex.refused:  # the most frequent: each token
                    yield self._response_body(ex, msg.response_body)
                    continue
                for resp in await self._handle(ex, msg):
                    yield resp
        finally:
            self.streams -= 1
            self._release(ex)
            self._finish(ex)

    async def _handle(self, ex: _Exchange, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Every message but an answer's body chunk (``Process`` answers those itself)."""
        if ex.refused:
            return []
        kind = msg.WhichOneof("request")
        if msg.HasField("protocol_config"):
            ex.duplex_request = msg.protocol_config.request_body_mode == FULL_DUPLEX
            ex.duplex_response = msg.protocol_config.response_body_mode == FULL_DUPLEX
            ex.response_body = msg.protocol_config.response_body_mode != NO_BODY
        if kind == "request_headers":
            ex.headers = header_map(msg.request_headers)
            strip_client_routing(ex.headers, self.limits.allow_client_headers)
            if msg.request_headers.end_of_stream:
                return await self._route(ex, with_body=False)
            declared = ex.headers.get("content-length", "")
            if declared.isdigit() and not self._admit(ex, int(declared)):  # refused before a byte of it
                return [self._refusal(ex, int(declared))]
            if not ex.duplex_request:  # buffered: Envoy waits for this before sending the body
                return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
            return []
        if kind == "request_body":
            size = len(ex.body) + len(msg.request_body.body)
            if size > ex.held and not self._admit(ex, size):
                return [self._refusal(ex, size)]
            ex.body += msg.request_body.body
            if msg.request_body.end_of_stream or msg.request_body.end_of_stream_without_message:
                return await self._route(ex, with_body=True)
            if not ex.duplex_request:
                return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
            return []
        if kind == "response_headers":
            headers = header_map(msg.response_headers)
            ex.status = int(headers.get(":status", "0") or 0)
            ex.streamed = headers.get("content-type", "").startswith("text/event-stream")
            self._answered(ex)
            if not ex.response_body and not ex.streamed and ex.flight is not None and ex.status < 500:
                ex.flight.first_token(observe=False)  # a whole answer: its headers come with it
            picked = ex.flight.result.targets[0].id if ex.flight is not None else None
            set_headers = [_set(PICKED_RESPONSE_HEADER, picked)] if picked is not None else []
            common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
            if msg.response_headers.end_of_stream:
                self._finish(ex)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            self._finish(ex)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _response_body(self, ex: _Exchange, body: pb.HttpBody) -> pb.ProcessingResponse:
        end = body.end_of_stream or body.end_of_stream_without_message
        if ex.flight is not None and ex.status < 500 and (body.body or end):
            # a stream's first event comes with its first token; a whole answer, at its end
            ex.flight.first_token(observe=ex.streamed)
        if end:
            self._finish(ex)
        if not ex.duplex_response:
            return pb.ProcessingResponse(response_body=pb.BodyResponse())
        return echo(body.body, end, request=False)

    def _admit(self, ex: _Exchange, size: int) -> bool:
        """Hold ``size`` bytes of the budget for ``ex``'s body; False (and the request refused)
        when it is over the body limit or does not fit beside the other streams' bodies."""
        if size > self.limits.max_body_bytes:
            ex.refused = True
            return False
        more = size - ex.held
        if more > 0 and not self.bodies.fits(more):
            ex.refused = True
            self.bodies.refused += 1
            return False
        if more > 0:
            self.bodies.take(more)
            ex.held = size
        return True

    def _refusal(self, ex: _Exchange, size: int) -> pb.ProcessingResponse:
        self._release(ex)  # whatever Envoy still sends of it is dropped unread
        if size > self.limits.max_body_bytes:
            return error_response(PayloadTooLargeError(
                f"request body is over the {self.limits.max_body_bytes}-byte limit"))
        return error_response(NoCapacityError(
            "too many request bodies are being received at once; retry later", retry_after=1.0))

    def _release(self, ex: _Exchange) -> None:
        """Give ``ex``'s body back to the budget and drop it."""
        if ex.held:
            self.bodies.give(ex.held)
            ex.held = 0
        ex.body = bytearray()

    async def _route(self, ex: _Exchange, *, with_body: bool) -> list[pb.ProcessingResponse]:
        try:
            return await self._decide(ex, with_body=with_body)
        finally:
            self._release(ex)  # the body is in the answer now (or refused): the budget is free again

    async def _decide(self, ex: _Exchange, *, with_body: bool) -> list[pb.ProcessingResponse]:
        try:
            ex.flight = flight = await self.router.route(incoming(ex.headers, bytes(ex.body), self.limits.max_json_depth))
        except Exception as exc:  # every failure becomes an HTTP answer, never a broken stream
            ex.refused = True
            error = from_exception(exc)
            if not isinstance(exc, KvflowError):
                log.exception("scheduling failed")
            return [error_response(error)]
        flight.dispatch()  # Envoy sends it there; the decode pod's sidecar runs a prefill leg
        result = flight.result
        if with_body and not ex.duplex_request:
            return [routing_response(result, on_body=True)]
        out = [routing_response(result)]
        if with_body:
            out += body_responses(bytes(ex.body), request=True)
        return out

    def _answered(self, ex: _Exchange) -> None:
        """Response headers: Envoy reached the pick (its prefill leg, if any, is done), or did not."""
        flight = ex.flight
        if flight is None:
            return
        served = ex.status < 500 and ex.status != 404  # 404: the model was checked; the pod serves another
        flight.prefill_done(ok=served)
        if not served:  # Envoy could not reach the pod, or the pod failed it: nothing was computed there
            flight.failed(flight.result.targets[0])  # and the router counts it against the pod (passive health)

    def _finish(self, ex: _Exchange) -> None:
        if ex.flight is not None and not ex.finished:
            ex.finished = True
            if not ex.response_body and 0 < ex.status < 500:  # a stream Envoy relayed itself ended
                ex.flight.first_token(observe=False)
            ex.flight.finish()


async def serve(router: Router, host: str, port: int, limits: ExtProcLimits | None = None,
                ssl_context: ssl.SSLContext | None = None) -> GrpcServer:
    """Start the ext_proc gRPC server (with gRPC health) and return it; the caller stops it.

    ``ssl_context`` makes the port TLS (``kvflow.router.epp.server_ssl_context``); None is
    plaintext. The server is ``kvflow.router.grpc_h2``'s, not grpcio's: see there why.
    """
    from kvflow.router.epp import health_methods

    limits = limits or ExtProcLimits()
    processor = ExternalProcessor(router, limits)
    methods = {PROCESS_PATH: Method(pb.ProcessingRequest, lambda requests: processor.Process(requests)),
               **health_methods()}
    server = GrpcServer(methods, max_message=limits.max_message_bytes, max_streams=2 * limits.max_streams,
                        ssl_context=ssl_context)
    try:
        await server.start(host, port)
    except OSError as exc:
        raise OSError(f"cannot bind the ext_proc server to {host}:{port}: {exc.strerror or exc}") from None
    return server
