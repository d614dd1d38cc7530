"""The Envoy ext_proc server: the Gateway API Inference Extension's endpoint-picker protocol.

Envoy streams each HTTP request to us (``FULL_DUPLEX_STREAMED`` for bodies, as the Inference
Extension requires). Per request:

1. request headers — remembered; answered only once the body is complete (full duplex);
2. request body chunks — buffered until ``end_of_stream``; then the JSON is tokenised and
   scheduled, and we answer with a headers response that sets
   ``x-gateway-destination-endpoint`` (the pick; Envoy's ORIGINAL_DST cluster routes on it),
   ``x-prefiller-host-port`` (P/D), dynamic metadata ``envoy.lb`` /
   ``x-gateway-destination-endpoint`` = the ordered fallback list, and clears the route
   cache; then the unchanged body as a streamed body response;
3. response headers and body chunks — passed straight back (streaming stays streaming); the
   last chunk ends the request's in-flight accounting.

No endpoint → an immediate 503; shedding → 429 (``Retry-After``); a malformed body → 400.

Envoy tells the server its body modes in the first message (``protocol_config``). Besides full
duplex, the buffered request mode works too: the headers are answered at once, and the routing
header mutation rides on the body response instead (Envoy holds the headers until then). That
mode is what a fail-open listener uses, since Envoy does not fail open in full-duplex mode.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvflow.errors import InvalidRequestError, KvflowError, from_exception
from kvflow.router.flight import Flight
from kvflow.router.model import SchedulingRequest, SchedulingResult
from kvflow.router.request import scheduling_request as build_request
from kvflow.router.request import tokens_off_loop
from kvflow.router.router import Router

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"
PICKED_RESPONSE_HEADER = "x-kvflow-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"
CHUNK = 62_000  # under Envoy's 64 KiB default per streamed message
FULL_DUPLEX = 4  # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


@dataclass(slots=True)
class _Exchange:
    """One HTTP request's state across the ext_proc stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    request: SchedulingRequest | None = None
    result: SchedulingResult | None = None
    flight: Flight | None = None
    status: int = 0
    streamed: bool = False
    finished: bool = False
    duplex_request: bool = True
    duplex_response: bool = True


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
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers), clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({LB_METADATA_NAMESPACE: {DESTINATION_HEADER: ",".join(t.id for t in result.targets)}})
    if on_body:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)


def body_responses(body: bytes, *, request: bool) -> list[pb.ProcessingResponse]:
    """``body`` streamed back to Envoy unchanged, in chunks under its message limit."""
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == len(chunks) - 1)
        )
        resp = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(pb.ProcessingResponse(request_body=resp) if request else pb.ProcessingResponse(response_body=resp))
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


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        parsed: Any = json.loads(body) if body else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return parsed


async def scheduling_request(router: Router, headers: dict[str, str], body: bytes) -> SchedulingRequest:
    """The request as the gateway would build it (``kvflow.router.request``), for the same routing."""
    parsed = parse_body(body)
    tokens = await tokens_off_loop(router.tokenize, parsed, len(body))
    return build_request(
        parsed, headers, tokens, request_id=headers.get("x-request-id") or uuid.uuid4().hex,
        names=router.names, max_prompt_tokens=router.max_prompt_tokens,
    )


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = _Exchange()
        try:
            async for msg in request_iterator:
                for resp in await self._handle(ex, msg):
                    yield resp
        finally:
            self._finish(ex)

    async def _handle(self, ex: _Exchange, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if msg.HasField("protocol_config"):
            ex.duplex_request = msg.protocol_config.request_body_mode == FULL_DUPLEX
            ex.duplex_response = msg.protocol_config.response_body_mode == FULL_DUPLEX
        if kind == "request_headers":
            ex.headers = header_map(msg.request_headers)
            if msg.request_headers.end_of_stream:
                return await self._route(ex, with_body=False)
            if not ex.duplex_request:  # buffered: Envoy waits for this before sending the body
                return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
            return []
        if kind == "request_body":
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
            set_headers = [_set(PICKED_RESPONSE_HEADER, ex.result.targets[0].id)] if ex.result else []
            common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
            if msg.response_headers.end_of_stream:
                self._finish(ex)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]
        if kind == "response_body":
            body = msg.response_body
            end = body.end_of_stream or body.end_of_stream_without_message
            if ex.flight is not None and ex.status < 500 and (body.body or end):
                # a stream's first event comes with its first token; a whole answer, at its end
                ex.flight.first_token(observe=ex.streamed)
            if end:
                self._finish(ex)
            if not ex.duplex_response:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
            mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body.body, end_of_stream=end))
            return [
                pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))
            ]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            self._finish(ex)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _route(self, ex: _Exchange, *, with_body: bool) -> list[pb.ProcessingResponse]:
        try:
            ex.request = await scheduling_request(self.router, ex.headers, bytes(ex.body))
            await self.router.prepare(ex.request)
            ex.result = self.router.schedule(ex.request)
        except Exception as exc:  # every failure becomes an HTTP answer, never a broken stream
            error = from_exception(exc)
            if not isinstance(exc, KvflowError):
                log.exception("scheduling failed")
            return [error_response(error)]
        ex.flight = flight = self.router.flight(ex.request, ex.result)
        if ex.result.prefill is not None:  # the decode pod's sidecar runs the prefill leg
            flight.send_prefill(ex.result.prefill)
        flight.send(ex.result.targets[0], remote=ex.result.prefill is not None)
        if with_body and not ex.duplex_request:
            return [routing_response(ex.result, on_body=True)]
        out = [routing_response(ex.result)]
        if with_body:
            out += body_responses(bytes(ex.body), request=True)
        return out

    def _answered(self, ex: _Exchange) -> None:
        """Response headers: Envoy reached the pick (its prefill leg, if any, is done), or did not."""
        flight = ex.flight
        if flight is None or ex.result is None:
            return
        served = ex.status < 500
        flight.prefill_done(ok=served)
        if not served:  # Envoy could not reach the pod, or the pod failed it: nothing was computed there
            flight.failed(ex.result.targets[0])

    def _finish(self, ex: _Exchange) -> None:
        if ex.flight is not None and not ex.finished:
            ex.finished = True
            ex.flight.finish()


async def serve(router: Router, host: str, port: int) -> grpc.aio.Server:
    """Start the ext_proc gRPC server (with gRPC health) and return it; the caller stops it."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router), server)
    await _add_health(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the ext_proc server to {host}:{port}")
    await server.start()
    return server


async def _add_health(server: grpc.aio.Server) -> None:
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:  # grpcio-health-checking is optional
        log.warning("grpcio-health-checking not installed: no gRPC health service")
        return
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
