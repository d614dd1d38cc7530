"""The gateway's own HTTP/1.1 server and client, checked against independent implementations
(raw sockets, aiohttp) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvflow.gateway.http1 import ConnectError, ConnectionPool
from kvflow.gateway.httpserver import HttpServer, Request, Responder, serve_http
from kvflow.gateway.server import reject
from tests.waiting import eventually


async def hang() -> None:
    """A handler that never answers: it waits until it is cancelled."""
    await asyncio.Event().wait()


async def echo(request: Request, out: Responder) -> None:
    if request.path == "/stream":
        out.start(200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            await out.write(f"data: {i}\n\n".encode())
        out.end()
        return
    if request.path == "/late-stream":  # its first piece comes after a while, an empty stream at once
        out.start(200, [("Content-Type", "text/event-stream")])
        if request.query != "empty":
            await asyncio.sleep(0.05)  # a pod slow to its first token: the head must wait for it
            await out.write(b"data: 0\n\n")
        out.end()
        return
    if request.path == "/hang":
        await hang()
    data = {"method": request.method, "path": request.path, "query": request.query,
            "body": request.body.decode(), "x": request.headers.get("x-thing")}
    out.send(200, json.dumps(data).encode(), [("Content-Type", "application/json")])


@pytest.fixture
async def server() -> AsyncIterator[str]:
    srv = await serve_http(echo, reject, "127.0.0.1", 0, max_body=100)
    yield f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    srv.close()


async def raw(address: str, data: bytes, read_until_close: bool = True) -> bytes:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(-1) if read_until_close else reader.read(65536), 5)
    writer.close()
    return out


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(server: str) -> None:
    one = b"POST /a?q=1 HTTP/1.1\r\nHost: x\r\nX-Thing: t\r\nContent-Length: 3\r\n\r\nabc"
    two = b"GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    text = (await raw(server, one + two)).decode()
    bodies = [json.loads(part.split("\r\n\r\n", 1)[1].split("HTTP/1.1")[0]) for part in text.split("HTTP/1.1 200")[1:]]
    assert bodies == [{"method": "POST", "path": "/a", "query": "q=1", "body": "abc", "x": "t"},
                      {"method": "GET", "path": "/b", "query": "", "body": "", "x": None}]
    assert "Connection: close" in text.rsplit("HTTP/1.1 200", 1)[1]


@pytest.mark.parametrize(("request_bytes", "status", "type_"), [
    (b"NONSENSE\r\n\r\n", 400, "BadRequestError"),
    (b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n" + b"x" * 101, 413, "BadRequestError"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n" + b"x" * 101 + b"\r\n0\r\n\r\n", 413,
     "BadRequestError"),
], ids=["malformed", "content-length-over-limit", "chunked-over-limit"])
async def test_requests_that_never_reach_the_handler_get_openai_errors(server, request_bytes, status, type_) -> None:  # type: ignore[no-untyped-def]
    head, _, body = (await raw(server, request_bytes)).partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode())
    assert json.loads(body)["error"]["type"] == type_


async def test_chunked_request_bodies_and_expect_continue(server: str) -> None:
    text = (await raw(server, b"POST /c HTTP/1.1\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n"
                              b"Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")).decode()
    assert text.startswith("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert json.loads(text.split("\r\n\r\n")[2])["body"] == "abcde"


async def test_aiohttp_reads_streams_and_whole_answers(server: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{server}/stream") as r:
            assert (r.status, await r.text()) == (200, "data: 0\n\ndata: 1\n\ndata: 2\n\n")
        async with session.post(f"http://{server}/p", data=b"hi") as r:
            assert (await r.json())["body"] == "hi"


async def test_a_streams_head_goes_out_with_its_first_piece(server: str) -> None:
    # one write: the client's first read has both (and wakes once for the first token)
    host, port = server.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /late-stream HTTP/1.1\r\nHost: x\r\n\r\n")
    first = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n\r\n9\r\ndata: 0\n\n\r\n" in first


async def test_a_stream_with_no_piece_still_sends_its_head(server: str) -> None:
    got = await raw(server, b"GET /late-stream?empty HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n") and got.endswith(b"\r\n\r\n0\r\n\r\n")


async def test_a_client_that_leaves_cancels_the_handler() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: Request, out: Responder) -> None:
        started.set()
        try:
            await hang()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await serve_http(slow, reject, "127.0.0.1", 0, max_body=100)
    _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(started.wait(), 5)
    writer.close()
    await asyncio.wait_for(cancelled.wait(), 5)
    srv.close()


@pytest.fixture
async def aio_server() -> AsyncIterator[tuple[str, int, list[str]]]:
    """An aiohttp server: /json, /sse (chunked), /close (answers then closes the connection)."""
    peers: list[str] = []

    async def json_(request: web.Request) -> web.Response:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        return web.json_response({"got": (await request.read()).decode(), "h": request.headers.get("X-A")})

    async def sse(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)  # a pod's tokens come apart: each piece is read on its own
        return out

    app = web.Application()
    app.router.add_post("/json", json_)
    app.router.add_post("/sse", sse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield "127.0.0.1", runner.addresses[0][1], peers
    await runner.cleanup()


async def test_pool_reuses_keep_alive_connections(aio_server) -> None:  # type: ignore[no-untyped-def]
    host, port, peers = aio_server
    pool = ConnectionPool()
    for i in range(3):
        r = await pool.post(host, port, "/json", f"b{i}".encode(), [("X-A", "1")], timeout=5)
        assert (r.status, json.loads(await r.read(5))) == (200, {"got": f"b{i}", "h": "1"})
        r.release()
    assert len(set(peers)) == 1
    pool.close()


async def test_pool_streams_chunked_answers_piece_by_piece(aio_server) -> None:  # type: ignore[no-untyped-def]
    host, port, _ = aio_server
    pool = ConnectionPool()
    r = await pool.post(host, port, "/sse", b"", [], timeout=5)
    pieces = []
    while chunk := await r.readany(5):
        pieces.append(chunk)
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(pieces) == 3
    assert r.content_type == "text/event-stream"
    r.release()
    pool.close()


async def test_pool_errors() -> None:
    pool = ConnectionPool(connect_timeout=1)
    with pytest.raises(ConnectError):
        await pool.post("127.0.0.1", 1, "/", b"", [], timeout=1)
    srv = await serve_http(echo, reject, "127.0.0.1", 0, max_body=100)
    port = srv.sockets[0].getsockname()[1]
    with pytest.raises(TimeoutError):
        await pool.post("127.0.0.1", port, "/hang", b"", [], timeout=0.1)
    srv.close()
    pool.close()


async def test_pool_replaces_a_connection_the_pod_closed_while_idle() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", ok)
    runner = web.AppRunner(app, keepalive_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    pool = ConnectionPool()
    try:
        for _ in range(2):
            r = await pool.post("127.0.0.1", port, "/", b"", [], timeout=5)
            assert await r.read(5) == b"ok"
            r.release()
            await eventually(lambda: pool.open_connections == 0, what="the pod to close the idle connection")
        assert pool.idle_connections == {}
    finally:
        pool.close()
        await runner.cleanup()


@pytest.fixture
async def slow_echo() -> AsyncIterator[tuple[str, int]]:
    """A pod that answers each POST with its body after a short delay, so exchanges overlap."""
    async def handle(request: Request, out: Responder) -> None:
        await asyncio.sleep(0.02)  # the pod's delay
        out.send(200, request.body, [("Content-Type", "text/plain")])

    srv = await serve_http(handle, reject, "127.0.0.1", 0, max_body=100)
    yield "127.0.0.1", srv.sockets[0].getsockname()[1]
    srv.close()


async def _ask(pool: ConnectionPool, address: tuple[str, int], body: bytes) -> bytes:
    r = await pool.post(*address, "/", body, [], timeout=2)
    data = await r.read(2)
    r.release()
    return data


async def test_a_response_released_twice_gives_its_connection_back_once(slow_echo) -> None:  # type: ignore[no-untyped-def]
    # The P/D prefill step once released its response twice: the connection sat twice in the
    # idle list, two concurrent requests were sent on it, and one of them hung or read the
    # other's answer (another prompt's kv_transfer_params).
    pool = ConnectionPool()
    try:
        r = await pool.post(*slow_echo, "/", b"first", [], timeout=2)
        assert await r.read(2) == b"first"
        r.release()
        r.release()
        assert (pool.idle_connections, pool.open_connections) == ({slow_echo: 1}, 1)
        for wave in range(3):
            bodies = [f"w{wave}-{i}".encode() for i in range(8)]
            answers = await asyncio.wait_for(asyncio.gather(*(_ask(pool, slow_echo, b) for b in bodies)), 5)
            assert answers == bodies
        # eight in the idle list and eight open: none of them is in the list twice
        assert (pool.idle_connections, pool.open_connections) == ({slow_echo: 8}, 8)
    finally:
        pool.close()


async def test_a_late_close_of_a_finished_response_leaves_the_next_exchange_alone(slow_echo) -> None:  # type: ignore[no-untyped-def]
    # e.g. the client leaves just after its answer was read and released: the stale handle's
    # close() must not abort the connection, which by now serves another request.
    pool = ConnectionPool()
    try:
        first = await pool.post(*slow_echo, "/", b"one", [], timeout=2)
        assert await first.read(2) == b"one"
        first.release()
        second = await pool.post(*slow_echo, "/", b"two", [], timeout=2)
        assert pool.open_connections == 1  # the same connection
        first.close()
        assert await second.read(2) == b"two"
        second.release()
        assert pool.idle_connections == {slow_echo: 1}
    finally:
        pool.close()


async def test_an_answer_nobody_asked_for_retires_the_connection() -> None:
    # A pod that answers one request twice: the second answer must not be read by the next
    # request sent on that connection; the connection is dropped and the next one gets a fresh one.
    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")

    srv = await asyncio.start_server(twice, "127.0.0.1", 0)
    address = ("127.0.0.1", srv.sockets[0].getsockname()[1])
    pool = ConnectionPool()
    try:
        assert [await _ask(pool, address, b"") for _ in range(2)] == [b"one", b"one"]
        assert pool.idle_connections == {}
    finally:
        pool.close()
        srv.close()


@pytest.fixture
async def ticker_pod() -> AsyncIterator[HttpServer]:
    """A pod that answers at once, then streams ``n`` pieces ``every`` seconds apart (the first
    after ``every``) and ends, hangs or drops the connection (``then``), as the query string
    says: ``/?n=3&every=0.01&then=end``."""
    async def handle(request: Request, out: Responder) -> None:
        q = dict(part.split("=") for part in request.query.split("&"))
        out.start(200, [("Content-Type", "text/event-stream")])
        await out.drain()  # the head at once (else it goes with the first piece)
        for i in range(int(q["n"])):
            await asyncio.sleep(float(q["every"]))  # a pod's tokens, one a step
            await out.write(f"data: {i}\n\n".encode())
        if q["then"] == "hang":
            await hang()
        if q["then"] == "close":  # a handler failing mid-stream: the server cuts the connection
            raise ConnectionAbortedError("the pod drops the connection")
        out.end()

    srv = await serve_http(handle, reject, "127.0.0.1", 0, max_body=100)
    yield srv
    srv.close()


@pytest.fixture
def ticker(ticker_pod: HttpServer) -> tuple[str, int]:
    return "127.0.0.1", ticker_pod.port


def _ticks(n: int) -> bytes:
    return b"".join(f"data: {i}\n\n".encode() for i in range(n))


async def _no_wait() -> None:
    pass


@pytest.fixture
async def pool() -> AsyncIterator[ConnectionPool]:
    p = ConnectionPool()
    yield p
    p.close()


async def test_pipe_hands_on_every_piece_in_order_what_was_buffered_first(ticker, pool) -> None:  # type: ignore[no-untyped-def]
    r = await pool.post(*ticker, "/?n=6&every=0.02&then=end", b"", [], timeout=2)
    first = await r.readany(2)  # as the gateway reads the first token before it relays the rest
    await eventually(lambda: r.buffered, timeout=2, what="more pieces in the buffer when the pipe starts")
    piped: list[bytes] = []
    await asyncio.wait_for(r.pipe(lambda c: piped.append(c) is None, _no_wait, idle=1), 5)
    assert first + b"".join(piped) == _ticks(6) and len(piped) >= 3
    r.release()
    assert pool.idle_connections == {ticker: 1}  # read to its end: the connection is kept


async def test_pipe_pauses_the_pod_while_the_reader_is_full(ticker, pool) -> None:  # type: ignore[no-untyped-def]
    r = await pool.post(*ticker, "/?n=5&every=0.01&then=end", b"", [], timeout=2)
    piped: list[bytes] = []
    paused_while_draining: list[bool] = []

    def sink(chunk: bytes) -> bool:
        piped.append(chunk)
        return len(piped) != 2  # the reader is full after the second piece

    async def drain() -> None:
        paused_while_draining.append(r.paused)
        await asyncio.sleep(0.1)  # a client slow to make room

    await asyncio.wait_for(r.pipe(sink, drain, idle=1), 5)
    assert b"".join(piped) == _ticks(5)
    assert paused_while_draining == [True] and not r.paused  # read again once drained
    r.release()


async def test_pipe_fails_a_stream_the_pod_leaves_silent_for_idle_seconds(ticker, pool) -> None:  # type: ignore[no-untyped-def]
    # steady pieces for twice the idle time: the one timer is pushed on, never fires
    r = await pool.post(*ticker, "/?n=8&every=0.05&then=end", b"", [], timeout=2)
    piped: list[bytes] = []
    await asyncio.wait_for(r.pipe(lambda c: piped.append(c) is None, _no_wait, idle=0.2), 5)
    assert b"".join(piped) == _ticks(8)
    r.release()
    r = await pool.post(*ticker, "/?n=1&every=0&then=hang", b"", [], timeout=2)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r.pipe(lambda c: True, _no_wait, idle=0.2), 5)
    assert 0.15 < asyncio.get_running_loop().time() - started < 1.0
    assert pool.open_connections == 0  # its connection (the first stream's, reused) was dropped


async def test_pipe_raises_when_the_pod_drops_the_connection_mid_stream(ticker, pool) -> None:  # type: ignore[no-untyped-def]
    r = await pool.post(*ticker, "/?n=2&every=0.01&then=close", b"", [], timeout=2)
    piped: list[bytes] = []
    with pytest.raises(ConnectionError, match="closed by the pod"):
        await asyncio.wait_for(r.pipe(lambda c: piped.append(c) is None, _no_wait, idle=1), 5)
    assert b"".join(piped) == _ticks(2)


async def test_a_relay_that_ends_while_its_reader_is_full_leaves_the_connection_reading(ticker_pod, ticker, pool) -> None:  # type: ignore[no-untyped-def]
    r = await pool.post(*ticker, "/?n=4&every=0.05&then=end", b"", [], timeout=2)
    piped: list[bytes] = []

    def full(chunk: bytes) -> bool:
        piped.append(chunk)
        return False

    async def slow_drain() -> None:  # meanwhile the pod sends the rest and the end: read at once after
        await eventually(lambda: ticker_pod.idle_connections == 1, timeout=2, what="the pod to end its answer")

    await asyncio.wait_for(r.pipe(full, slow_drain, idle=1), 5)
    assert b"".join(piped) == _ticks(4) and r.paused  # the end came in while the reader was full
    r.release()
    assert pool.idle_connections == {ticker: 1}
    again = await pool.post(*ticker, "/?n=2&every=0&then=end", b"", [], timeout=2)
    assert pool.open_connections == 1  # the one that was paused, not a new one
    assert await again.read(2) == _ticks(2)  # given back reading: else it would hang
    again.release()
