"""The ext_proc server as an attacker behind Envoy meets it: a real gRPC server on 127.0.0.1 and
a gRPC client speaking Envoy's messages. A client's ``kv_transfer_params`` is refused however
JSON spells its key; bodies over the limit are refused from their declared length; all streams'
bodies together stay inside one budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvflow.endpoints import Endpoint
from kvflow.local.procs import free_port
from kvflow.router import Router, load_config
from kvflow.router.extproc import ExtProcLimits, serve

PODS = [Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)]
ESCAPED_KEY = {
    "plain": b'"kv_transfer_params"',
    "unicode-escape": b'"kv_transfer_p\\u0061rams"',
    "all-escaped": b'"' + b"".join(b"\\u%04x" % c for c in b"kv_transfer_params") + b'"',
}


class Client:
    """One Envoy-like ext_proc client on a real channel to the server."""

    def __init__(self, router: Router, channel: grpc.aio.Channel) -> None:
        self.router, self.stub = router, pb_grpc.ExternalProcessorStub(channel)

    async def exchange(self, *msgs: pb.ProcessingRequest, stop_after: int | None = None) -> list[pb.ProcessingResponse]:
        """Send ``msgs`` (full duplex, as Envoy does); the answers, up to ``stop_after`` of them."""
        call = self.stub.Process(_iterate(msgs))
        out = []
        async for resp in call:
            out.append(resp)
            if stop_after is not None and len(out) >= stop_after:
                call.cancel()
                break
        return out


async def _iterate(msgs: tuple[pb.ProcessingRequest, ...]) -> AsyncIterator[pb.ProcessingRequest]:
    for msg in msgs:
        yield msg


@pytest.fixture
async def extproc() -> AsyncIterator[Any]:
    servers: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def start(limits: ExtProcLimits | None = None) -> Client:
        router = Router(load_config(None), PODS)
        port = free_port()
        server = await serve(router, "127.0.0.1", port, limits)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append((server, channel))
        return Client(router, channel)

    yield start
    for server, channel in servers:
        await channel.close()
        await server.stop(None)


def headers(content_length: int | None = None) -> pb.ProcessingRequest:
    values = {":path": "/v1/completions", ":method": "POST", "content-type": "application/json"}
    if content_length is not None:
        values["content-length"] = str(content_length)
    hmap = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap))
    msg.protocol_config.request_body_mode = msg.protocol_config.response_body_mode = 4  # FULL_DUPLEX_STREAMED
    return msg


def body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def refusal(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any], dict[str, str]]:
    (resp,) = out
    answer = resp.immediate_response
    set_headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    return answer.status.code, json.loads(answer.body)["error"], set_headers


@pytest.mark.parametrize("key", ESCAPED_KEY.values(), ids=ESCAPED_KEY.keys())
async def test_client_kv_transfer_params_are_refused_however_the_key_is_spelled(extproc, key: bytes) -> None:  # type: ignore[no-untyped-def]
    client = await extproc()
    raw = (b'{"model":"m","prompt":"hi",' + key +
           b':{"do_remote_prefill":true,"remote_host":"10.9.9.9","remote_port":5600}}')
    assert json.loads(raw)["kv_transfer_params"]["remote_host"] == "10.9.9.9"  # what a pod would read
    status, error, _ = refusal(await client.exchange(headers(len(raw)), body(raw)))
    assert (status, error["param"], error["type"]) == (400, "kv_transfer_params", "BadRequestError")
    assert sum(v.in_flight for v in client.router.datastore.snapshot()) == 0  # never routed


async def test_a_body_nested_over_the_gateways_depth_limit_is_refused(extproc) -> None:  # type: ignore[no-untyped-def]
    client = await extproc(ExtProcLimits(max_json_depth=8))
    raw = b'{"model":"m","prompt":"hi","user":' + b"[" * 8 + b"]" * 8 + b"}"
    status, error, _ = refusal(await client.exchange(headers(len(raw)), body(raw)))
    assert (status, error["message"]) == (400, "request body is nested deeper than 8 levels")


async def test_a_body_declared_over_the_limit_is_refused_before_any_of_it_arrives(extproc) -> None:  # type: ignore[no-untyped-def]
    client = await extproc(ExtProcLimits(max_body_bytes=4096))
    status, error, _ = refusal(await client.exchange(headers(content_length=1 << 30)))  # headers only, no body
    assert (status, error["code"]) == (413, 413)


async def test_bodies_beyond_the_shared_budget_get_503_and_the_budget_frees_when_they_end(extproc) -> None:  # type: ignore[no-untyped-def]
    client = await extproc(ExtProcLimits(max_body_bytes=1 << 20, max_buffered_bytes=1 << 20))
    stub = client.stub
    gate: asyncio.Event = asyncio.Event()

    async def holding() -> AsyncIterator[pb.ProcessingRequest]:
        buffered = headers(content_length=600_000)
        buffered.protocol_config.request_body_mode = 2  # BUFFERED: Envoy waits for an answer to the headers
        yield buffered
        await gate.wait()  # the first body is announced and never comes

    first = stub.Process(holding())
    assert (await first.read()).WhichOneof("response") == "request_headers"  # admitted: 600 KB held
    second = await client.exchange(headers(content_length=600_000), body(b'{"model":"m"}'))
    status, error, retry = refusal(second)
    assert (status, error["type"], retry.get("retry-after")) == (503, "ServiceUnavailableError", "1")
    gate.set()  # the first request's stream ends: the server has given its bytes back once the call is over
    assert await first.read() is grpc.aio.EOF
    raw = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    out = await client.exchange(headers(len(raw)), body(raw))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]


def response_headers(status: int) -> pb.ProcessingRequest:
    hmap = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hmap, end_of_stream=True))


async def test_a_pod_answering_404_for_the_pools_model_is_ejected_after_three(extproc) -> None:  # type: ignore[no-untyped-def]
    """Behind Envoy the 404 has reached the client; the router still stops sending there."""
    client = await extproc()
    raw = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    picked: list[str] = []
    for _ in range(6):
        out = await client.exchange(headers(len(raw)), body(raw), response_headers(404), stop_after=3)
        routed = {h.header.key: h.header.raw_value.decode() for h in out[0].request_headers.response.header_mutation.set_headers}
        picked.append(routed["x-gateway-destination-endpoint"])
    ejected = [v.id for v in client.router.datastore.snapshot() if not v.healthy]
    assert len(ejected) == 1 and picked.count(ejected[0]) >= 3  # one of two pods may go, never both
    assert client.router.outliers.pods[ejected[0]].ejections == 1
