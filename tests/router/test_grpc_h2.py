"""kvflow's HTTP/2 gRPC server, spoken to by grpcio's own client (and, below, by something that is
not HTTP/2 at all). The ext_proc and health methods over it are tested in test_extproc*.py and,
behind a real Envoy, in test_envoy_e2e.py and test_envoy_tls.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvflow.router.epp import health_methods
from kvflow.router.grpc_h2 import CallError, GrpcServer, Method, Status

Req = health_pb2.HealthCheckRequest  # a message with one string field: a payload of any size


class Echo:
    """``/t.T/Echo`` answers each request with itself; ``/t.T/Fail`` fails with NOT_FOUND; what
    the echo's handler saw at its end is kept."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.cancelled = False

    async def echo(self, requests: AsyncIterator[Req]) -> AsyncIterator[Req]:
        try:
            async for request in requests:
                yield request
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.ended.set()

    async def fail(self, requests: AsyncIterator[Req]) -> AsyncIterator[Req]:
        async for _ in requests:
            raise CallError(Status.NOT_FOUND, "no such thing: 100% gone")
        yield Req()  # pragma: no cover - never reached: makes this an async generator


@pytest.fixture
def echo() -> Echo:
    return Echo()


@pytest.fixture
async def server(echo: Echo) -> AsyncIterator[GrpcServer]:
    server = GrpcServer({"/t.T/Echo": Method(Req, echo.echo), "/t.T/Fail": Method(Req, echo.fail),
                         **health_methods()}, max_message=1 << 20)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop(None)


@pytest.fixture
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


def stream(channel: grpc.aio.Channel, path: str) -> grpc.aio.StreamStreamMultiCallable:
    return channel.stream_stream(path, request_serializer=Req.SerializeToString, response_deserializer=Req.FromString)


def payloads() -> Iterator[str]:
    yield "small"
    yield "x" * 200_000  # over HTTP/2's default 64 KiB window and 16 KiB frame, both ways
    yield "last"


async def test_a_stream_echoes_every_message_whole_and_in_order(channel: grpc.aio.Channel) -> None:
    answers = [a.service async for a in stream(channel, "/t.T/Echo")(Req(service=p) for p in payloads())]
    assert answers == list(payloads())


async def test_many_calls_share_one_connection(channel: grpc.aio.Channel) -> None:
    async def one(i: int) -> list[str]:
        return [a.service async for a in stream(channel, "/t.T/Echo")(iter([Req(service=f"{i}-{j}") for j in range(3)]))]

    answers = await asyncio.gather(*(one(i) for i in range(50)))
    assert answers == [[f"{i}-{j}" for j in range(3)] for i in range(50)]


async def test_a_handler_ends_its_call_with_a_grpc_status(channel: grpc.aio.Channel) -> None:
    call = stream(channel, "/t.T/Fail")(iter([Req(service="x")]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [a async for a in call]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such thing: 100% gone"


async def test_an_unknown_method_is_unimplemented(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [a async for a in stream(channel, "/t.T/Nope")(iter([Req()]))]
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_message_over_the_limit_is_resource_exhausted(channel: grpc.aio.Channel, echo: Echo) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [a async for a in stream(channel, "/t.T/Echo")(iter([Req(service="x" * (2 << 20))]))]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.wait_for(echo.ended.wait(), 10)


async def test_a_client_cancelling_its_call_cancels_the_handler(channel: grpc.aio.Channel, echo: Echo) -> None:
    call = stream(channel, "/t.T/Echo")()
    await call.write(Req(service="hello"))
    assert (await call.read()).service == "hello"
    call.cancel()  # the client resets the stream: the handler's cleanup runs now
    await asyncio.wait_for(echo.ended.wait(), 10)
    assert echo.cancelled


async def test_health_checks_answer_serving_or_not_found(channel: grpc.aio.Channel) -> None:
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=Req.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
    assert (await check(Req(service="inference-extension"))).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await check(Req(service="no-such-service"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_connection_that_is_not_http2_is_closed(server: GrpcServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # everything until the server closes
    writer.close()
    kinds, codes = [], []
    while len(data) >= 9:  # HTTP/2 frames: 3 bytes of length, a type, flags, a stream id
        length, kind = int.from_bytes(data[:3], "big"), data[3]
        kinds.append(kind)
        if kind == 7:  # GOAWAY: last stream id, then the error code
            codes.append(int.from_bytes(data[13:17], "big"))
        data = data[9 + length:]
    assert kinds[0] == 4 and 7 in kinds  # its SETTINGS, as every HTTP/2 server opens, then a GOAWAY
    assert codes == [1]  # PROTOCOL_ERROR


async def test_stopping_lets_a_call_in_flight_finish(server: GrpcServer, channel: grpc.aio.Channel) -> None:
    call = stream(channel, "/t.T/Echo")()
    await call.write(Req(service="before"))
    assert (await call.read()).service == "before"
    stopping = asyncio.create_task(server.stop(grace=10))
    await call.write(Req(service="during"))
    assert (await call.read()).service == "during"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    await asyncio.wait_for(stopping, 10)
