"""The ext_proc message exchange, message by message (no Envoy, no network)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvflow.router import Router, load_config
from kvflow.router.extproc import ExternalProcessor, ExtProcLimits, _Exchange
from kvflow.router.model import EngineMetrics
from kvflow.endpoints import Endpoint, Role

BODY = json.dumps({"model": "m", "prompt": " ".join(f"w{i}" for i in range(400)), "max_tokens": 1}).encode()


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


PODS = [Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)]


async def test_full_duplex_routes_after_the_whole_body() -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS))
    ex = _Exchange()
    assert await proc._handle(ex, headers_msg(mode=4, x_request_id="r1")) == []
    assert await proc._handle(ex, body_msg(BODY[:100], end=False)) == []
    out = await proc._handle(ex, body_msg(BODY[100:], end=True))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    picked = set_headers(out[0], "request_headers")["x-gateway-destination-endpoint"]
    assert out[0].request_headers.response.clear_route_cache
    fallbacks = out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert fallbacks.string_value.split(",")[0] == picked and len(fallbacks.string_value.split(",")) == 2
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (BODY, True)
    assert sum(v.in_flight for v in proc.router.datastore.snapshot()) == 1
    # the response streams back; its last chunk ends the accounting
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    resp = await proc._handle(ex, pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)))
    assert set_headers(resp[0], "response_headers") == {"x-kvflow-endpoint": picked}
    chunk = await proc._handle(ex, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=True)))
    assert chunk[0].response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert sum(v.in_flight for v in proc.router.datastore.snapshot()) == 0


async def test_buffered_mode_routes_on_the_body_response() -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS))
    ex = _Exchange()
    first = await proc._handle(ex, headers_msg(mode=2))
    assert [r.WhichOneof("response") for r in first] == ["request_headers"]
    out = await proc._handle(ex, body_msg(BODY, end=True))
    assert [r.WhichOneof("response") for r in out] == ["request_body"]
    assert "x-gateway-destination-endpoint" in set_headers(out[0], "request_body")
    assert not out[0].request_body.response.HasField("body_mutation")


async def test_pd_sets_the_prefiller_header() -> None:
    pods = [Endpoint("127.0.0.2", 8000, role=Role.DECODE), Endpoint("127.0.0.4", 8000, role=Role.PREFILL)]
    proc = ExternalProcessor(Router(load_config({"pd": {"threshold": 100}}), pods))
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4))
    out = await proc._handle(ex, body_msg(BODY, end=True))
    assert set_headers(out[0], "request_headers") == {
        "x-gateway-destination-endpoint": "127.0.0.2:8000",
        "x-prefiller-host-port": "127.0.0.4:8000",
    }


async def test_errors_become_immediate_responses() -> None:
    router = Router(load_config(None), PODS[:1])
    proc = ExternalProcessor(router)
    cases = [(b"{oops", 400, "BadRequestError")]
    for body, status, kind in cases:
        ex = _Exchange()
        await proc._handle(ex, headers_msg(mode=4))
        (out,) = await proc._handle(ex, body_msg(body, end=True))
        assert out.immediate_response.status.code == status
        assert json.loads(out.immediate_response.body)["error"]["type"] == kind
    router.datastore.record_scrape(PODS[0].id, EngineMetrics(waiting=10_000), now=1.0)
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4))
    (out,) = await proc._handle(ex, body_msg(BODY, end=True))
    assert out.immediate_response.status.code == 429
    assert {h.header.key: h.header.raw_value for h in out.immediate_response.headers.set_headers}["retry-after"] == b"1"
    router.mark_failed(PODS[0])
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4))
    (out,) = await proc._handle(ex, body_msg(BODY, end=True))
    assert out.immediate_response.status.code == 503


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    (resp,) = out
    return resp.immediate_response.status.code, json.loads(resp.immediate_response.body)["error"]


async def test_client_routing_headers_never_reach_the_scheduler_and_are_removed_from_the_request() -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS))
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4, x_gateway_destination_endpoint="10.9.9.9:80",
                                 x_prefiller_host_port="10.9.9.9:80", x_kvflow_profile="no-such-profile"))
    out = await proc._handle(ex, body_msg(BODY, end=True))
    assert ex.request is not None and not {"x-kvflow-profile", "x-prefiller-host-port"} & set(ex.request.headers)
    mutation = out[0].request_headers.response.header_mutation
    assert set(set_headers(out[0], "request_headers")) == {"x-gateway-destination-endpoint"}
    assert {"x-prefiller-host-port", "x-prefiller-url"} <= set(mutation.remove_headers)


async def test_allowed_client_headers_reach_the_scheduler() -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS), ExtProcLimits(allow_client_headers=frozenset(
        {"x-kvflow-profile"})))
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4, x_kvflow_profile="no-such-profile"))
    assert immediate(await proc._handle(ex, body_msg(BODY, end=True)))[0] == 400  # honoured: an unknown profile


@pytest.mark.parametrize(("body", "status", "param"), [
    (json.dumps({"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "10.9.9.9"}}).encode(), 400,
     "kv_transfer_params"),
    (b'{"model":"m","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (b"x" * 5000, 413, None),
], ids=["client-kv-transfer-params", "nested-100000-deep", "over-the-body-cap"])
async def test_bodies_the_router_refuses(body: bytes, status: int, param: str | None) -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS), ExtProcLimits(max_body_bytes=4096 if status == 413
                                                                            else 1 << 20))
    ex = _Exchange()
    await proc._handle(ex, headers_msg(mode=4))
    out = await proc._handle(ex, body_msg(body[:3000], end=False))
    out = out or await proc._handle(ex, body_msg(body[3000:], end=True))
    got, error = immediate(out)
    assert (got, error["code"], error["param"]) == (status, status, param)
    assert await proc._handle(ex, body_msg(b"more", end=True)) == []  # answered: the rest is ignored
    assert sum(v.in_flight for v in proc.router.datastore.snapshot()) == 0


async def test_over_the_stream_cap_newcomers_get_503_with_retry_after() -> None:
    proc = ExternalProcessor(Router(load_config(None), PODS), ExtProcLimits(max_streams=1))

    async def messages(*msgs: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
        for msg in msgs:
            yield msg

    first = proc.Process(messages(headers_msg(mode=4)), None)  # type: ignore[arg-type]
    assert [r async for r in first] == [] and proc.streams == 0
    held = proc.Process(messages(headers_msg(mode=4), body_msg(BODY[:10], end=False)), None)  # type: ignore[arg-type]
    assert await anext(held, None) is None  # one stream open ... and finished: the cap frees again
    proc.streams = 1  # one stream in progress
    out = [r async for r in proc.Process(messages(headers_msg(mode=4)), None)]  # type: ignore[arg-type]
    got, error = immediate(out)
    assert (got, error["type"]) == (503, "ServiceUnavailableError")
    assert {h.header.key for h in out[0].immediate_response.headers.set_headers} >= {"retry-after"}
    assert proc.streams == 1
