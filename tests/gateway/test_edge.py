"""The gateway's HTTP edge as an attacker meets it, byte by byte on raw sockets: framing that
could smuggle a request, oversized and slow requests, pipelining, odd bytes, deep JSON, routing
headers and P/D fields a client must not set, a client that stops reading, too many connections,
and what reaches logs, metrics and pods. Every refusal is an OpenAI error JSON; nothing is a 5xx."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvflow.gateway.body import scrub_answer
from tests.gateway.test_app import COMPLETION, Stack, make_stack
from tests.waiting import eventually

FAST = {"http": {"header_timeout": 0.3, "body_timeout": 0.3, "keep_alive_timeout": 0.3, "write_timeout": 0.3}}
BODY = json.dumps(COMPLETION).encode()


@pytest.fixture
async def edge() -> AsyncIterator[Any]:
    made: list[Stack] = []

    async def start(behaviours: list[str] | None = None, **config: Any) -> Stack:
        stack = await make_stack(behaviours or ["ok"], **config)
        made.append(stack)
        return stack

    yield start
    for stack in made:
        await stack.session.close()
        await stack.gateway.close()
        for pod in stack.pods:
            await pod.stop()


def post(body: bytes = BODY, headers: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + headers +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def exchange(stack: Stack, data: bytes, *, wait: float = 3.0) -> bytes:
    """Send ``data``; everything the gateway answers until it closes (or ``wait`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(stack.url.rsplit(":", 1)[1]))
    writer.write(data)
    await writer.drain()
    received = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 20), wait):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    writer.close()
    return received


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 answers in ``raw``, in order (Content-Length framed)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return out


def openai_error(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


SMUGGLING = {
    "content-length-and-chunked": post(headers=b"Transfer-Encoding: chunked\r\n"),
    "two-different-content-lengths": post(headers=b"Content-Length: 5\r\n"),
    "negative-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: -1\r\n\r\n",
    "bad-chunk-size": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "chunked-not-last": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
    "space-before-colon": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length : 3\r\n\r\nabc",
    "bare-lf-header-folding": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nX-A: 1\r\n continued\r\n\r\n",
}


@pytest.mark.parametrize("raw", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_ambiguous_framing_is_refused_and_never_reaches_a_pod(edge, raw: bytes) -> None:  # type: ignore[no-untyped-def]
    stack = await edge()
    [(status, headers, body)] = answers(await exchange(stack, raw + post()))  # a smuggled 2nd request: no answer
    assert (status, headers["connection"], openai_error(body)["code"]) == (400, "close", 400)
    assert stack.pods[0].received == []


@pytest.mark.parametrize(("raw", "status"), [
    (post(path=b"/v1/completions?" + b"a" * 9000), 414),
    (post(headers=b"X-Big: " + b"a" * (1 << 20) + b"\r\n"), 431),
    (post(headers=b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))), 431),
    (post(headers=b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(80))), 431),
    (post(body=b"x" * 5000), 413),
], ids=["long-url", "one-megabyte-header", "ten-thousand-headers", "80-kilobytes-of-headers", "body"])
async def test_oversized_requests_get_their_status_and_the_connection_closes(edge, raw: bytes, status: int) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(max_body_bytes=4096)
    [(got, headers, body)] = answers(await exchange(stack, raw))
    assert (got, headers["connection"], openai_error(body)["code"]) == (status, "close", status)
    assert stack.pods[0].received == []


async def test_slow_headers_get_408_and_the_connection_closes(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(**FAST)
    [(status, headers, body)] = answers(await exchange(stack, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"))
    assert (status, headers["connection"], openai_error(body)["type"]) == (408, "close", "RequestTimeoutError")


async def test_a_slow_body_gets_408_and_the_connection_closes(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(**FAST)
    [(status, _, body)] = answers(await exchange(stack, post()[:-10]))
    assert (status, openai_error(body)["code"]) == (408, 408)
    assert stack.pods[0].received == []


async def test_an_idle_keep_alive_connection_is_closed(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(**FAST)
    started = asyncio.get_running_loop().time()
    [(status, _, _)] = answers(await exchange(stack, post(), wait=5))
    assert status == 200 and asyncio.get_running_loop().time() - started < 3  # closed by the gateway, not by us


async def test_pipelined_requests_are_answered_in_order(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge()
    raw = (post(headers=b"X-Request-Id: one\r\n") + b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Request-Id: two\r\n\r\n"
           + post(headers=b"X-Request-Id: three\r\n") + b"GET /nowhere HTTP/1.1\r\nX-Request-Id: four\r\n\r\n"
           + post(headers=b"X-Request-Id: five\r\nConnection: close\r\n"))
    got = answers(await exchange(stack, raw))
    assert [(status, h["x-request-id"]) for status, h, _ in got] == [
        (200, "one"), (200, "two"), (200, "three"), (404, "four"), (200, "five")]


async def test_a_bad_request_behind_good_ones_is_answered_in_its_turn(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge()
    got = answers(await exchange(stack, post(headers=b"X-Request-Id: a\r\n") * 2 + b"BAD\r\n\r\n"))
    assert [status for status, _, _ in got] == [200, 200, 400]


@pytest.mark.parametrize(("raw", "status"), [
    (post(body=b'{"model": "tiny", "prompt": "\xff\xfe"}'), 400),
    (post(path=b"/v1/\xc3\x28\xff"), 400),
    (post(headers=b"X-Odd: \xff\xfe\x80\r\n"), 200),
    (post(body=b'{"model":"tiny","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400),
    (post(body=b'{"model":"tiny","prompt":"x","user":' + b'{"a":' * 70 + b"1" + b"}" * 70 + b"}"), 400),
    (post(body=b'{"model":"tiny","prompt":[' + b"99999999999999999999999999," * 3 + b'1]}'), 200),
    (post(body=b"\x00" * 100), 400),
], ids=["non-utf8-body", "non-utf8-path", "non-utf8-header", "nested-100000-deep", "nested-over-the-limit",
        "huge-token-ids-are-for-the-pod-to-judge", "nul-bytes"])
async def test_odd_bytes_and_deep_json_get_4xx_never_5xx(edge, raw: bytes, status: int) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(max_body_bytes=1 << 20)
    [(got, _, body)] = answers(await exchange(stack, raw + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"))[:1]
    assert got == status
    if status >= 400:
        assert openai_error(body)["code"] == status


ROUTING = {"x-gateway-destination-endpoint": "10.9.9.9:80", "x-prefiller-host-port": "10.9.9.9:80",
           "x-prefiller-url": "http://10.9.9.9", "x-kvflow-profile": "secret-profile", "x-kvflow-priority": "99",
           "x-kvflow-endpoint": "10.9.9.9:80"}


async def test_clients_never_choose_their_destination_profile_or_priority(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge()
    status, _, _ = await stack.post("/v1/completions", COMPLETION, headers=ROUTING)
    assert status == 200
    assert not set(ROUTING) & set(stack.router.scheduled[-1].headers)
    assert not set(ROUTING) & set(stack.pods[0].headers[-1])


async def test_an_api_key_may_be_allowed_to_choose_its_profile(edge, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-ops, name: ops, allow_headers: [x-kvflow-profile]}\n"
                    "  - {key: sk-user, name: user}\n")
    stack = await edge(auth={"keys_file": str(keys)})
    for key in ("sk-ops", "sk-user"):
        headers = {**ROUTING, "Authorization": f"Bearer {key}"}
        assert (await stack.post("/v1/completions", COMPLETION, headers=headers))[0] == 200
    ops, user = (set(r.headers) & set(ROUTING) for r in stack.router.scheduled)
    assert (ops, user) == ({"x-kvflow-profile"}, set())


async def test_priority_by_header_only_where_allowed(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(flow={"max_inflight": 1}, allow_client_headers=["x-kvflow-priority"])
    status, body, _ = await stack.post("/v1/completions", COMPLETION, headers={"x-kvflow-priority": "high"})
    assert (status, body["error"]["param"]) == (400, "priority")  # read, so checked
    closed = await edge(flow={"max_inflight": 1})
    assert (await closed.post("/v1/completions", COMPLETION, headers={"x-kvflow-priority": "high"}))[0] == 200


async def test_client_kv_transfer_params_are_refused(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(prefill="ok")
    params = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 80, "remote_engine_id": "x"}
    status, body, _ = await stack.post("/v1/completions", {**COMPLETION, "kv_transfer_params": params})
    assert (status, body["error"]["param"]) == (400, "kv_transfer_params")
    assert all(pod.received == [] for pod in stack.pods)


async def test_client_kv_transfer_params_are_stripped_when_configured(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(client_kv_transfer_params="strip")
    status, _, _ = await stack.post("/v1/completions", {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and stack.pods[0].received == [COMPLETION]


async def test_pod_internals_never_reach_clients(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(["leak"])
    status, body, _ = await stack.post("/v1/completions", COMPLETION)
    assert (status, body["kv_transfer_params"]) == (200, None)
    failing = await edge(["500", "down"])
    await failing.pods[1].stop()
    status, body, _ = await failing.post("/v1/completions", COMPLETION)
    assert status == 502 and "127.0.0." not in body["error"]["message"]
    assert scrub_answer(b'{"a": 1, "kv_transfer_params": {"remote_host": "h"}}') == b'{"a":1,"kv_transfer_params":null}'


async def test_a_client_that_stops_reading_loses_its_stream_and_frees_its_slot(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(["flood"], flow={"max_inflight": 1, "max_queue": 0}, **FAST)
    port = int(stack.url.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(post(json.dumps({**COMPLETION, "stream": True}).encode()))  # and never reads
    try:
        # the gateway gives up on the silent reader and, with it, on the pod's stream
        await asyncio.wait_for(stack.pods[0].was_cancelled.wait(), 10)
        stack.pods[0].behaviour = "ok"
        status, _, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200  # the slot the silent reader held is free again
        assert stack.gateway.server.counts["write_timeout"] == 1
        metrics = (await (await stack.session.get(stack.url + "/metrics")).read()).decode()
        assert 'kvflow_gateway_http_refusals_total{reason="write_timeout"} 1.0' in metrics
    finally:
        sock.close()


async def test_at_the_connection_cap_idle_connections_make_room_then_newcomers_get_503(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(http={"max_connections": 2})
    port = int(stack.url.rsplit(":", 1)[1])
    idle = []
    for _ in range(2):  # served once, then idle on keep-alive
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post())
        await reader.readuntil(b"from pod0")
        idle.append(writer)
    assert answers(await exchange(stack, post(headers=b"Connection: close\r\n")))[0][0] == 200  # an idle one closed
    slow = []
    for _ in range(2):  # mid-request: never closed to make room
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\n")
        slow.append(writer)
    server = stack.gateway.server
    await eventually(lambda: (server.open_connections, server.idle_connections) == (2, 0),
                     what="both slow requests begun, no idle connection left")
    [(status, headers, body)] = answers(await exchange(stack, post()))
    assert (status, headers["retry-after"], openai_error(body)["type"]) == (503, "1", "ServiceUnavailableError")
    for writer in idle + slow:
        writer.close()


async def test_api_keys_never_reach_logs_metrics_or_pods(edge, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-live-abcdef123456\n")
    stack = await edge(["ok", "500"], auth={"keys_file": str(keys)}, rotate=True)
    with caplog.at_level(logging.DEBUG):
        for key in ("sk-live-abcdef123456", "sk-wrong-654321fedcba"):
            for body in (COMPLETION, {**COMPLETION, "max_tokens": "bad"}, {**COMPLETION, "stream": True}):
                await stack.post("/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
        metrics = (await (await stack.session.get(stack.url + "/metrics")).read()).decode()
        stack.gateway.gateway.close()  # flush the access log
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "key-0" in logged  # the key's name is what the access log shows
    for secret in ("abcdef123456", "654321fedcba"):
        assert secret not in logged and secret not in metrics
    assert all("authorization" not in h for pod in stack.pods for h in pod.headers)


@pytest.fixture
async def sidecar_for() -> AsyncIterator[Any]:
    """A sidecar in front of a fake local pod, with a fake prefill pod at 127.0.0.9."""
    from kvflow.gateway.config import GatewayConfig
    from kvflow.gateway.server import limits_of, listen
    from kvflow.sidecar.server import Sidecar
    from tests.gateway.fakes import FakePod

    started: list[Any] = []

    async def start(**config: Any) -> tuple[str, FakePod, FakePod]:
        local, prefiller = FakePod("local"), FakePod("prefill")
        await local.start("127.0.0.2")
        await prefiller.start("127.0.0.9")
        cfg = GatewayConfig.model_validate(config)
        sidecar = Sidecar(cfg, local.endpoint)  # type: ignore[arg-type]
        server, port = await listen(sidecar.handle, "127.0.0.1", 0, limits_of(cfg))
        started.append((server, sidecar, local, prefiller))
        return f"127.0.0.1:{port}", local, prefiller

    yield start
    for server, sidecar, local, prefiller in started:
        server.close()
        await sidecar.upstream.stop()
        await local.stop()
        await prefiller.stop()


async def sidecar_exchange(address: str, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    received = await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    return answers(received)


@pytest.mark.parametrize(("allowed", "header", "prefilled"), [
    ([], "127.0.0.9:{port}", False),
    (["127.0.0.8"], "127.0.0.9:{port}", False),
    (["127.0.0.9"], "127.0.0.9:{port}", True),
    (["127.0.0.0/24"], "127.0.0.9:{port}", True),
    (["localhost"], "127.0.0.9:{port}", False),
    (["127.0.0.9"], "localhost:{port}", False),
], ids=["nothing-allowed", "another-address", "this-address", "its-network", "a-name-for-another", "a-client-name"])
async def test_the_sidecar_prefills_only_on_allowed_pods(sidecar_for, allowed, header, prefilled) -> None:  # type: ignore[no-untyped-def]
    address, local, prefiller = await sidecar_for(sidecar={"prefillers": allowed})
    value = header.format(port=prefiller.endpoint.port).encode()
    [(status, _, body)] = await sidecar_exchange(address, post(headers=b"x-prefiller-host-port: " + value +
                                                                 b"\r\nConnection: close\r\n"))
    assert (status, bool(prefiller.received)) == ((200, True) if prefilled else (400, False))
    if not prefilled:
        assert openai_error(body)["message"] in ("x-prefiller-host-port does not name an allowed prefill pod",)
        assert local.received == []


@pytest.mark.parametrize(("method", "path", "status"), [
    (b"GET", b"/_sim/faults", 404), (b"POST", b"/_sim/faults", 404), (b"POST", b"/reset_prefix_cache", 404),
    (b"POST", b"/v1/load_lora_adapter", 404), (b"GET", b"/v1/models", 404),  # the fake pod has no /v1/models
])
async def test_the_sidecar_passes_only_allowed_paths(sidecar_for, method, path, status) -> None:  # type: ignore[no-untyped-def]
    address, local, _ = await sidecar_for()
    [(got, _, body)] = await sidecar_exchange(address, method + b" " + path + b" HTTP/1.1\r\nConnection: close\r\n"
                                                        b"Content-Length: 2\r\n\r\n{}")
    assert got == status and local.received == []
    if path != b"/v1/models":
        assert openai_error(body)["type"] == "NotFoundError"


async def test_the_sidecar_refuses_client_kv_transfer_params_and_strips_routing_headers(sidecar_for) -> None:  # type: ignore[no-untyped-def]
    address, local, _ = await sidecar_for()
    kv = json.dumps({**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"}})
    [(status, _, body)] = await sidecar_exchange(address, post(kv.encode(), b"Connection: close\r\n"))
    assert (status, openai_error(body)["param"]) == (400, "kv_transfer_params")
    [(status, _, _)] = await sidecar_exchange(address, post(headers=b"x-kvflow-profile: p\r\nx-gateway-destination-"
                                                                   b"endpoint: 10.9.9.9:80\r\nConnection: close\r\n"))
    assert status == 200 and not {"x-kvflow-profile", "x-gateway-destination-endpoint"} & set(local.headers[-1])
    assert local.received == [COMPLETION]


async def test_prefiller_allow_list_entries() -> None:
    from kvflow.gateway.allowlist import PrefillerAllowList

    allow = PrefillerAllowList(["10.0.0.5", "10.0.1.5:8000", "10.2.0.0/16", "localhost:9000"])
    await allow.resolve()
    checks = [("10.0.0.5", 1), ("10.0.1.5", 8000), ("10.0.1.5", 8001), ("10.2.3.4", 80), ("10.3.0.1", 80),
              ("127.0.0.1", 9000), ("127.0.0.1", 9001), ("localhost", 9000)]
    assert [allow.allows(h, p) for h, p in checks] == [True, True, False, True, False, True, False, False]
    with pytest.raises(ValueError):
        PrefillerAllowList(["http://evil"])
