"""A server that shuts down (SIGTERM, as Kubernetes stops a pod) loses no request it took.

``HttpServer.shutdown(grace)``: it stops listening, answers every request it has begun
reading or has yet to answer, and the first on a connection opened but silent so far (each
answer says ``Connection: close``, and its connection closes after it), closes the keep-alive
connections between requests, and returns once none is left; at the grace period it cuts what
is still open. Raw sockets on 127.0.0.1, so the test sees the bytes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop

from kvflow.gateway.httpserver import HttpServer, Request, Responder, serve_http
from kvflow.gateway.server import reject
from tests.waiting import eventually

QUICK = b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n"


class Handler:
    """``/stream`` sends a piece, then waits for ``release`` to end; ``/hang`` never answers."""

    def __init__(self) -> None:
        self.streaming = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: Request, out: Responder) -> None:
        if request.path == "/stream":
            out.start(200, [("Content-Type", "text/event-stream")])
            await out.write(b"data: first\n\n")
            self.streaming.set()
            await self.release.wait()
            await out.write(b"data: last\n\n")
            out.end()
        elif request.path == "/hang":
            self.streaming.set()
            await asyncio.Event().wait()
        else:
            out.send(200, b"ok", [("Content-Type", "text/plain")])


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def refused(port: int) -> bool:
    try:
        _, writer = await connect(port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One whole answer of a known length (the quick one's)."""
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(2)


async def test_a_stopping_server_finishes_what_it_took_and_takes_nothing_new() -> None:
    handler = Handler()
    server = await serve_http(handler, reject, "127.0.0.1", 0)
    port = server.port
    stream_r, stream_w = await connect(port)
    stream_w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    await handler.streaming.wait()
    idle_r, idle_w = await connect(port)  # a keep-alive connection between requests
    idle_w.write(QUICK)
    assert (await answer(idle_r)).startswith(b"HTTP/1.1 200")
    half_r, half_w = await connect(port)  # a request half sent when the stop comes
    half_w.write(QUICK[:20])
    await eventually(lambda: server.open_connections == 3 and server.idle_connections == 1,
                     what="the stream, the idle and the half-sent connection")

    stopping = asyncio.ensure_future(server.shutdown(grace=30))

    await eventually(lambda: refused(port), what="new connections refused")
    assert await idle_r.read() == b""  # closed between requests
    half_w.write(QUICK[20:])
    finished = await half_r.read()  # answered in full, then closed
    assert finished.startswith(b"HTTP/1.1 200") and b"Connection: close\r\n" in finished and finished.endswith(b"ok")
    assert not stopping.done()  # the stream is still being answered
    handler.release.set()
    streamed = await stream_r.read()
    assert b"data: first" in streamed and streamed.endswith(b"data: last\n\n\r\n0\r\n\r\n")
    assert await stopping == 0  # nothing was cut
    for writer in (stream_w, idle_w, half_w):
        writer.close()


async def test_a_connection_opened_before_the_stop_gets_the_answer_to_its_first_request() -> None:
    """A client opens a connection to send a request: the stop must not close it before the
    request arrives (only a keep-alive connection between requests is idle)."""
    server = await serve_http(Handler(), reject, "127.0.0.1", 0)
    port = server.port
    reader, writer = await connect(port)
    await eventually(lambda: server.open_connections == 1, what="the server to take the connection")

    stopping = asyncio.ensure_future(server.shutdown(grace=30))
    await eventually(lambda: refused(port), what="new connections refused")
    writer.write(QUICK)

    got = await reader.read()
    assert got.startswith(b"HTTP/1.1 200") and b"Connection: close\r\n" in got and got.endswith(b"ok")
    assert await stopping == 0
    writer.close()


async def test_at_the_grace_period_what_is_still_open_is_cut() -> None:
    handler = Handler()
    server = await serve_http(handler, reject, "127.0.0.1", 0)
    reader, writer = await connect(server.port)
    writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    await handler.streaming.wait()

    assert await server.shutdown(grace=0.1) == 1
    assert await reader.read() == b""
    writer.close()


async def _answers_a_connection_the_kernel_accepted_before_the_stop() -> bytes:
    server: HttpServer = await serve_http(Handler(), reject, "127.0.0.1", 0)
    # Connected and sent while this task holds the loop: the kernel has accepted the
    # connection, the loop has not taken it yet. Closing a listening socket resets those.
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(QUICK)
    assert await server.shutdown(grace=5) == 0
    client.settimeout(5)
    got = b""
    while chunk := client.recv(65536):
        got += chunk
    client.close()
    return got


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_connection_the_kernel_accepted_before_the_stop_is_answered(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    loop = new_loop()
    try:
        got = loop.run_until_complete(_answers_a_connection_the_kernel_accepted_before_the_stop())
    finally:
        loop.close()
    assert got.startswith(b"HTTP/1.1 200") and b"Connection: close\r\n" in got and got.endswith(b"ok")
