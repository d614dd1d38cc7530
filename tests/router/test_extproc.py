"""The ext_proc message exchange, message by message, as Envoy speaks it: the real gRPC server
(``kvflow.router.extproc.serve``) on 127.0.0.1 and a generated ``ExternalProcessor`` stub.

Envoy's stream is ordered, so "no answer yet" is checked by what the first answer is once the
request is complete: an early answer would have come first."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvflow.endpoints import Endpoint, Role
from kvflow.local.procs import free_port
from kvflow.router import Router, load_config
from kvflow.router.extproc import ExtProcLimits, serve
from kvflow.router.model import EngineMetrics

BODY = json.dumps({"model": "m", "prompt": " ".join(f"w{i}" for i in range(400)), "max_tokens": 1}).encode()
PODS = [Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)]


def headers_msg(end: bool = False, mode: int | None = None, **headers: str) -> pb.ProcessingRequest:
    hmap = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode())
            for k, v in {":path": "/v1/completions", **headers}.items()
        ]
    )
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap, end_of_stream=end))
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = 4 if mode == 4 else 1  # duplex, else STREAMED
    return msg


def body_msg(data: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def set_headers(resp: pb.ProcessingResponse, field: str) -> dict[str, str]:
    common = getattr(resp, field).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    (resp,) = out
    return resp.immediate_response.status.code, json.loads(resp.immediate_response.body)["error"]


def in_flight(router: Router) -> int:
    return sum(v.in_flight for v in router.datastore.snapshot())


class Stream:
    """One HTTP request's ext_proc stream, written and read one message at a time as Envoy does."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, *msgs: pb.ProcessingRequest) -> None:
        for msg in msgs:
            await self.call.write(msg)

    async def answer(self) -> pb.ProcessingResponse:
        resp = await self.call.read()
        assert resp is not grpc.aio.EOF, "the server ended the stream instead of answering"
        return resp

    async def answers(self, n: int) -> list[pb.ProcessingResponse]:
        return [await self.answer() for _ in range(n)]

    async def rest(self) -> list[pb.ProcessingResponse]:
        """End the request (Envoy half-closes) and read every answer still to come."""
        await self.call.done_writing()
        out = []
        while (resp := await self.call.read()) is not grpc.aio.EOF:
            out.append(resp)
        return out


Open = Callable[..., Awaitable[Callable[[], Stream]]]


@pytest.fixture
async def extproc() -> AsyncIterator[Open]:
    """``await extproc(router, limits)``: the server started for ``router``; returns a function
    that opens one stream to it."""
    started: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def start(router: Router, limits: ExtProcLimits | None = None) -> Callable[[], Stream]:
        port = free_port()
        server = await serve(router, "127.0.0.1", port, limits)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, channel))
        stub = pb_grpc.ExternalProcessorStub(channel)
        return lambda: Stream(stub)

    yield start
    for server, channel in started:
        await channel.close()
        await server.stop(None)


async def test_full_duplex_routes_after_the_whole_body(extproc: Open) -> None:
    router = Router(load_config(None), PODS)
    stream = (await extproc(router))()
    await stream.send(headers_msg(mode=4, x_request_id="r1"), body_msg(BODY[:100], end=False),
                      body_msg(BODY[100:], end=True))
    out = await stream.answers(2)  # nothing was answered before the last chunk: these come first
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    picked = set_headers(out[0], "request_headers")["x-gateway-destination-endpoint"]
    assert out[0].request_headers.response.clear_route_cache
    fallbacks = out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert fallbacks.string_value.split(",")[0] == picked and len(fallbacks.string_value.split(",")) == 2
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (BODY, True)
    assert in_flight(router) == 1
    # the response streams back; its last chunk ends the accounting
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    await stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)))
    assert set_headers(await stream.answer(), "response_headers") == {"x-kvflow-endpoint": picked}
    await stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=True)))
    chunk = await stream.answer()
    assert chunk.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert in_flight(router) == 0
    assert await stream.rest() == []


async def test_buffered_mode_routes_on_the_body_response(extproc: Open) -> None:
    stream = (await extproc(Router(load_config(None), PODS)))()
    await stream.send(headers_msg(mode=2))
    assert (await stream.answer()).WhichOneof("response") == "request_headers"
    await stream.send(body_msg(BODY, end=True))
    out = await stream.rest()
    assert [r.WhichOneof("response") for r in out] == ["request_body"]
    assert "x-gateway-destination-endpoint" in set_headers(out[0], "request_body")
    assert not out[0].request_body.response.HasField("body_mutation")


async def test_pd_sets_the_prefiller_header(extproc: Open) -> None:
    pods = [Endpoint("127.0.0.2", 8000, role=Role.DECODE), Endpoint("127.0.0.4", 8000, role=Role.PREFILL)]
    stream = (await extproc(Router(load_config({"pd": {"threshold": 100}}), pods)))()
    await stream.send(headers_msg(mode=4), body_msg(BODY, end=True))
    assert set_headers(await stream.answer(), "request_headers") == {
        "x-gateway-destination-endpoint": "127.0.0.2:8000",
        "x-prefiller-host-port": "127.0.0.4:8000",
    }


async def test_errors_become_immediate_responses(extproc: Open) -> None:
    router = Router(load_config(None), PODS[:1])
    open_stream = await extproc(router, ExtProcLimits(allow_client_headers=frozenset({"x-kvflow-priority"})))

    async def answer_to(body: bytes, **headers: str) -> pb.ProcessingResponse:
        stream = open_stream()
        await stream.send(headers_msg(mode=4, **headers), body_msg(body, end=True))
        return (await stream.rest())[0]

    out = await answer_to(b"{oops")
    assert out.immediate_response.status.code == 400
    assert json.loads(out.immediate_response.body)["error"]["type"] == "BadRequestError"
    assert (await answer_to(BODY, x_kvflow_priority="high")).immediate_response.status.code == 400
    router.datastore.record_scrape(PODS[0].id, EngineMetrics(waiting=10_000), now=1.0)
    # saturated: a request of the default priority still goes to the pod, a sheddable one is refused
    assert "x-gateway-destination-endpoint" in set_headers(await answer_to(BODY), "request_headers")
    out = await answer_to(BODY, x_kvflow_priority="-1")
    assert out.immediate_response.status.code == 429
    assert {h.header.key: h.header.raw_value for h in out.immediate_response.headers.set_headers}["retry-after"] == b"1"
    router.mark_failed(PODS[0])
    assert (await answer_to(BODY)).immediate_response.status.code == 503


async def test_client_routing_headers_never_reach_the_scheduler_and_are_removed_from_the_request(
    extproc: Open,
) -> None:
    stream = (await extproc(Router(load_config(None), PODS)))()
    await stream.send(headers_msg(mode=4, x_gateway_destination_endpoint="10.9.9.9:80",
                                  x_prefiller_host_port="10.9.9.9:80", x_kvflow_profile="no-such-profile"),
                      body_msg(BODY, end=True))
    out = await stream.rest()
    # routed, not a 400: the unknown profile never reached the scheduler (see the next test)
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    mutation = out[0].request_headers.response.header_mutation
    routed = set_headers(out[0], "request_headers")
    assert set(routed) == {"x-gateway-destination-endpoint"}
    assert routed["x-gateway-destination-endpoint"] in {p.id for p in PODS}
    assert {"x-prefiller-host-port", "x-prefiller-url"} <= set(mutation.remove_headers)


async def test_allowed_client_headers_reach_the_scheduler(extproc: Open) -> None:
    limits = ExtProcLimits(allow_client_headers=frozenset({"x-kvflow-profile"}))
    stream = (await extproc(Router(load_config(None), PODS), limits))()
    await stream.send(headers_msg(mode=4, x_kvflow_profile="no-such-profile"), body_msg(BODY, end=True))
    assert immediate(await stream.rest())[0] == 400  # honoured: an unknown profile


@pytest.mark.parametrize(("body", "status", "param"), [
    (json.dumps({"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "10.9.9.9"}}).encode(), 400,
     "kv_transfer_params"),
    (b'{"model":"m","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (b"x" * 5000, 413, None),
], ids=["client-kv-transfer-params", "nested-100000-deep", "over-the-body-cap"])
async def test_bodies_the_router_refuses(extproc: Open, body: bytes, status: int, param: str | None) -> None:
    router = Router(load_config(None), PODS)
    stream = (await extproc(router, ExtProcLimits(max_body_bytes=4096 if status == 413 else 1 << 20)))()
    await stream.send(headers_msg(mode=4), body_msg(body[:3000], end=False), body_msg(body[3000:], end=True))
    await stream.send(body_msg(b"more", end=True))
    got, error = immediate(await stream.rest())  # one answer: what came after it is ignored
    assert (got, error["code"], error["param"]) == (status, status, param)
    assert in_flight(router) == 0


async def test_over_the_stream_cap_newcomers_get_503_with_retry_after(extproc: Open) -> None:
    open_stream = await extproc(Router(load_config(None), PODS), ExtProcLimits(max_streams=1))
    ended = open_stream()
    await ended.send(headers_msg(mode=4))
    assert await ended.rest() == []  # one stream open ... and finished: the cap frees again
    held = open_stream()
    await held.send(headers_msg(mode=2))
    assert (await held.answer()).WhichOneof("response") == "request_headers"  # admitted, and in progress
    newcomer = open_stream()
    await newcomer.send(headers_msg(mode=4))
    out = await newcomer.rest()
    got, error = immediate(out)
    assert (got, error["type"]) == (503, "ServiceUnavailableError")
    assert {h.header.key for h in out[0].immediate_response.headers.set_headers} >= {"retry-after"}
    await held.send(body_msg(BODY, end=True))  # the stream in progress is still served
    assert [r.WhichOneof("response") for r in await held.rest()] == ["request_body"]
