"""A small HTTP/1.1 server for the gateway's data path: ``asyncio.Protocol`` + ``httptools``.

Why not aiohttp's server: profiled under load, its request machinery (protocol, application,
middlewares, response objects) cost more than the gateway's own work (docs/gateway.md). This
server parses with httptools (C), runs one task per request, writes each
answer with one ``transport.write`` and streams with chunked encoding. What it does not do it
does not need: no TLS (the gateway sits behind a Service or Envoy), no multipart, no websockets.

    async def handle(request: Request, out: Responder) -> None: ...
    server = await serve_http(handle, reject, "127.0.0.1", 8080, max_body=8 << 20)

A client that disconnects cancels its request's task (which closes the upstream connection).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus

import httptools

Header = tuple[str, str]
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool) -> None:
        self.method, self.path, self.query = method, path, query
        self.headers = headers
        """Lower-case names."""
        self.body, self.keep_alive = body, keep_alive


class Responder:
    """Writes one answer: ``send`` a whole one, or ``start`` + ``write``... + ``end`` a stream."""

    __slots__ = ("_conn", "_keep_alive", "started", "status")

    def __init__(self, conn: _Connection, keep_alive: bool) -> None:
        self._conn, self._keep_alive = conn, keep_alive
        self.started = False
        self.status = 0

    def _head(self, status: int, headers: Iterable[Header], framing: str) -> bytes:
        self.started, self.status = True, status
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{framing}"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        if not self._keep_alive:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def send(self, status: int, body: bytes, headers: Iterable[Header] = ()) -> None:
        if self.started:
            raise RuntimeError("the answer was already started")
        self._conn.write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)

    def start(self, status: int, headers: Iterable[Header] = ()) -> None:
        self._conn.write(self._head(status, headers, "Transfer-Encoding: chunked\r\n"))

    async def write(self, chunk: bytes) -> None:
        """One chunk of a stream; ConnectionResetError once the client has gone."""
        if chunk:
            self._conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await self._conn.drain()

    def end(self) -> None:
        self._conn.write(b"0\r\n\r\n")

    @property
    def closed(self) -> bool:
        return self._conn.closed


Handler = Callable[[Request, Responder], Awaitable[None]]
Fallback = Callable[[Responder, int, str], None]


class _Connection(asyncio.Protocol):
    def __init__(self, handler: Handler, fallback: Fallback, max_body: int, loop: asyncio.AbstractEventLoop) -> None:
        self.handler, self.fallback, self.max_body = handler, fallback, max_body
        self._loop = loop  # kept: asyncio.get_running_loop() costs a getpid() system call per call
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._more: asyncio.Future[None] | None = None  # the task waits on it for the next request
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    # --- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    # --- httptools callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size, self._too_large = b"", {}, [], 0, False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self._too_large = True
        elif self._headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            self._too_large = True
        elif not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._too_large:
            self._reject(413, f"request body is over the {self.max_body}-byte limit")
            return
        path, _, query = self._url.decode("latin-1").partition("?")
        request = Request(self.parser.get_method().decode(), path, query, self._headers,
                          b"".join(self._body), self.parser.should_keep_alive())
        self._pending.append(request)  # pipelined ones are answered in order
        if self._task is None:
            self._task = self._loop.create_task(self._serve())
        elif self._more is not None:
            more, self._more = self._more, None
            more.set_result(None)

    # --- requests -------------------------------------------------------------------------
    async def _serve(self) -> None:
        """The connection's one task: its requests in order, then waits for the next one.

        One task per connection rather than per request: a keep-alive client's requests cost a
        future each, not a task (creating and registering one is a measurable share per request).
        """
        pending = self._pending
        try:
            while True:
                if not pending:
                    self._more = self._loop.create_future()
                    await self._more
                    continue
                if not await self._run(pending.popleft()):
                    return
        except asyncio.CancelledError:  # the client left
            return

    async def _run(self, request: Request) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        out = Responder(self, request.keep_alive)
        try:
            await self.handler(request, out)
        except asyncio.CancelledError:
            raise
        except Exception:  # the handler maps its own errors; this is the last guard
            if not out.started and not self.closed:
                self.fallback(out, 500, "internal error")
            elif not self.closed:
                self.abort()
        if self.closed:
            return False
        if not request.keep_alive:
            self.transport.close()  # type: ignore[union-attr]
            self.closed = True
            return False
        return True

    def _reject(self, status: int, message: str) -> None:
        """An answer the request never reaches a handler for; the connection then closes."""
        if self.closed:
            return
        out = Responder(self, keep_alive=False)
        self.fallback(out, status, message)
        self.transport.close()  # type: ignore[union-attr]
        self.closed = True

    # --- writing --------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client has gone")
        self.transport.write(data)  # type: ignore[union-attr]

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client has gone")
        if self._paused:
            self._writable = self._loop.create_future()
            await self._writable
            if self.closed:
                raise ConnectionResetError("the client has gone")

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


async def serve_http(handler: Handler, fallback: Fallback, host: str, port: int, *,
                     max_body: int, backlog: int = 4096, reuse_port: bool = False) -> asyncio.Server:
    """Listen; ``fallback(out, status, message)`` writes answers for requests that never reach
    ``handler`` (malformed HTTP, oversized bodies)."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(handler, fallback, max_body, loop), host, port,
                                      backlog=backlog, reuse_address=True, reuse_port=reuse_port)
    return server
