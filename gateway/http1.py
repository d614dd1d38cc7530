"""A small HTTP/1.1 client for the gateway's one job: POST a body to a pod over a pooled
keep-alive connection and hand back the answer as it arrives.

Why not aiohttp's client: profiled under load it was one of the two largest costs of the gateway
per request, after the system calls (docs/gateway.md). This client is an ``asyncio.Protocol`` with the
``httptools`` parser (C), one keep-alive pool per pod, and no per-request tasks or queues:
a response is a buffer of chunks plus one waiter future.

    pool = ConnectionPool(connect_timeout=5)
    response = await pool.post(host, port, "/v1/completions", body, headers, timeout=300)
    data = await response.read()       # or: while chunk := await response.readany(): ...
    response.release()                 # back to the pool (or response.close() to abort)

A stream relayed to a client goes through ``pipe`` instead of ``readany``: every piece is handed
on from the connection's own callback, so no task wakes and no timer is armed per token.

A connection carries one exchange at a time. ``release`` and ``close`` detach the response from
its connection, so a second call, or a late ``close`` of an answer already released, is a no-op:
it must never put the connection in the pool twice or abort the exchange that now uses it (two
requests sharing one connection would each read the other's answer, or hang).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import httptools

_PAUSE_AT = 1 << 20  # buffered bytes of a response before we stop reading from the pod


class ResponseError(ConnectionError):
    """The pod closed the connection or sent something unparseable."""


class ConnectError(ConnectionError):
    """No connection to the pod could be opened (refused, unreachable, or too slow)."""


class Response:
    __slots__ = ("status", "headers", "_conn", "_loop", "_chunks", "_buffered", "_done", "_error", "_waiter",
                 "_keep_alive", "_sink", "_blocked", "_last", "_idle_timer")

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn  # None once released or closed
        self._loop = conn.loop
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._sink: Callable[[bytes], bool] | None = None
        self._blocked = False
        self._last = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    @property
    def buffered(self) -> int:
        """Bytes of the body that have arrived and wait to be read (or piped)."""
        return self._buffered

    @property
    def paused(self) -> bool:
        """Whether reading from the pod is paused: the buffer, or the reader the body is piped
        to, is full. False once the response is released or closed."""
        return self._conn is not None and self._conn.paused

    async def readany(self, timeout: float | None = None) -> bytes:
        """The next piece of the body as it arrived; b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait(timeout)
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered < _PAUSE_AT and self._conn is not None:
            self._conn.resume()
        return chunk

    async def read(self, timeout: float | None = None) -> bytes:
        """The whole body; ``timeout`` bounds each silence, not the whole answer.

        What has arrived is taken off the buffer before each wait, so a reading paused at
        ``_PAUSE_AT`` resumes and an answer of any size comes in (no cliff at the pause mark)."""
        parts: list[bytes] = []
        while True:
            if self._chunks:
                parts.extend(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._conn is not None:
                    self._conn.resume()
            if self._error is not None:
                raise self._error
            if self._done:
                return b"".join(parts)
            await self._wait(timeout)

    async def pipe(self, write: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]],
                   idle: float | None = None) -> None:
        """Hand every piece of the body to ``write`` as it arrives, until the end.

        ``write`` is called from the connection's data callback (what is already buffered first),
        so relaying a token costs no task wake-up and no timer. It returns False when its reader
        is not keeping up: reading from the pod then pauses until ``drain()`` returns. It must not
        raise. Raises like ``readany`` when the pod fails, or sends nothing for ``idle`` seconds.
        """
        loop = self._loop
        while self._chunks:
            chunk = self._chunks.popleft()
            self._buffered -= len(chunk)
            if not write(chunk):
                await drain()
        self._buffered = 0
        if self._conn is not None:
            self._conn.resume()
        self._sink, self._last = write, loop.time()
        if idle:
            self._idle_timer = loop.call_later(idle, self._check_idle, idle)
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if self._done:
                    return
                if self._blocked:  # the reader is full: the pod waits until it has room
                    await drain()
                    self._blocked, self._last = False, loop.time()
                    if self._conn is not None:
                        self._conn.resume()
                    continue
                await self._wait(None)
        finally:
            self._sink = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

    def _check_idle(self, idle: float) -> None:
        """``pipe``'s one timer: fails the stream once the pod has been silent ``idle`` seconds."""
        self._idle_timer = None
        if self._done or self._error is not None:
            return
        due, now = self._last + idle, self._loop.time()
        if self._blocked or due > now:  # heard from since (or waiting for the client)
            self._idle_timer = self._loop.call_at(max(due, now + idle / 10), self._check_idle, idle)
            return
        self._timed_out()

    def _deliver(self, body: bytes, conn: _Connection) -> None:
        """A piece of a piped body: on to the sink; pause the pod if the reader is full."""
        self._last = self._loop.time()
        if not self._sink(body) and not self._blocked:  # type: ignore[misc]
            self._blocked = True
            conn.pause()
            self._wake()

    async def _wait(self, timeout: float | None) -> None:
        loop = self._loop
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, self._timed_out) if timeout else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self) -> None:
        self._fail(TimeoutError("the pod sent nothing in time"))
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def release(self) -> None:
        """Give the connection back for the next request, if the answer was read to its end.

        Only the first ``release`` or ``close`` of a response acts; later ones are no-ops."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._error is None and self._keep_alive:
            conn.give_back(self)
        else:
            conn.abort()

    def close(self) -> None:
        """Drop the connection: the pod sees the client go and aborts the request."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.key, self.loop = pool, key, loop  # the loop kept: get_running_loop() costs a getpid()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.paused = False
        self.used = False
        self._header_name = b""

    # --- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes on an idle connection: no request of ours asked for them
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(ResponseError(f"bad HTTP from the pod: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(ResponseError(f"connection closed by the pod{f': {exc}' if exc else ''}"))

    def _lost(self, exc: Exception) -> None:
        self.closed = True
        if self.headers_waiter is not None and not self.headers_waiter.done():
            self.headers_waiter.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)
        self.pool._forget(self)

    # --- httptools callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.response is None or self.response._done:  # a second answer to one request
            raise ResponseError("the pod sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        response._keep_alive = self.parser.should_keep_alive()
        waiter = self.headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        if response._sink is not None:
            response._deliver(body, self)
            return
        response._chunks.append(body)
        response._buffered += len(body)
        if response._buffered >= _PAUSE_AT:
            self.pause()
        response._wake()

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response._done = True
        response._wake()

    # --- used by Response and the pool ----------------------------------------------------
    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
        self.pool._forget(self)

    def give_back(self, response: Response) -> None:
        if self.closed or self.response is not response:
            return
        self.resume()  # a relay that ended while its client was full paused the reading
        self.response = None  # the parser, at a message boundary, reads the next answer as it is
        self.pool._idle.setdefault(self.key, []).append(self)

    def send(self, head: bytes, body: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        if self.response is not None:  # the pool handed out a busy connection: a bug, never send on it
            raise RuntimeError("HTTP/1.1 connection already carries an exchange")
        self.used = True
        self.response = Response(self)
        self.headers_waiter = self.loop.create_future()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return self.headers_waiter


class ConnectionPool:
    """Keep-alive connections per (host, port), most recently used first."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()

    @property
    def open_connections(self) -> int:
        """Connections open to all pods together, idle or carrying an exchange."""
        return len(self._all)

    @property
    def idle_connections(self) -> dict[tuple[str, int], int]:
        """Per pod (host, port) with any, the connections waiting in the pool for its next request."""
        return {key: len(idle) for key, idle in self._idle.items() if idle}

    async def post(self, host: str, port: int, path: str, body: bytes, headers: Iterable[tuple[str, str]],
                   timeout: float | None = None, method: str = "POST") -> Response:
        """Send; the response once its headers are in (a ConnectionError or TimeoutError otherwise)."""
        head = _head(method, host, port, path, len(body), headers)
        conn = self._reuse((host, port))
        if conn is not None:
            try:
                return await self._exchange(conn, head, body, timeout)
            except ResponseError:
                if conn.response is not None and conn.response.status:
                    raise
                # a kept-alive connection the pod had already closed: once more on a fresh one
        conn = await self._connect((host, port))
        return await self._exchange(conn, head, body, timeout)

    def _reuse(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key, loop), *key), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc or type(exc).__name__}") from None
        self._all.add(conn)
        return conn

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes, timeout: float | None) -> Response:
        loop = conn.loop
        waiter = conn.send(head, body)
        timer = loop.call_later(timeout, _expire, waiter, conn) if timeout else None
        try:
            return await waiter
        except asyncio.CancelledError:
            conn.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:  # closed while idle (the pod's keep-alive timeout): rare, O(n) is fine
            idle.remove(conn)

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()


def _expire(waiter: asyncio.Future[Response], conn: _Connection) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("the pod did not answer in time"))
        conn.abort()


def _head(method: str, host: str, port: int, path: str, length: int, headers: Iterable[tuple[str, str]]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {length}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers]
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
