"""A small HTTP/1.1 server for the gateway's data path: ``asyncio.Protocol`` + ``httptools``.

Why not aiohttp, uvicorn or granian: measured per request, this server costs the least CPU and
adds the least latency on the gateway's path, and passes the same attack suite
(``bench/bench_gateway.py --layers``; docs/gateway.md has the figures). It parses with
httptools (llhttp, C), runs one task per connection, writes each answer with one
``transport.write`` and streams with chunked encoding. No TLS (the gateway sits behind a
Service or Envoy), no multipart, no websockets, no upgrades.

    async def handle(request: Request, out: Responder) -> None: ...
    server = await serve_http(handle, reject, "127.0.0.1", 8080, Limits(max_body=8 << 20))

Limits, each answered as production proxies answer it (``Limits`` has the defaults):

* request line (URL) over ``max_request_line`` → 414; header bytes over ``max_header_bytes`` or
  more than ``max_headers`` headers → 431; a body over ``max_body`` → 413, as soon as its
  ``Content-Length`` (or, chunked, its running size) says so: the rest is never read. The
  connection closes.
* the bodies of all connections together hold at most ``max_buffered_bodies`` bytes
  (``kvflow.request_body.BodyBudget``): a body is admitted by its ``Content-Length`` before any of
  it is read (chunked: as it arrives) and given back when its request has been answered; one that
  does not fit gets a 503 with ``Retry-After`` unread, and its connection closes. A crowd of large
  bodies, authenticated or not, costs at most the budget.
* a request whose headers are not complete ``header_timeout`` after its first byte, or whose body
  is not complete ``body_timeout`` after its headers → 408, then the connection closes (slowloris);
* a keep-alive connection idle for ``keep_alive_timeout`` (a new one silent for
  ``header_timeout``) is closed;
* a client that reads nothing of its answer for ``write_timeout`` is dropped: its handler is
  cancelled, which closes the upstream request and frees its flow-control slot;
* at ``max_connections`` open connections, the longest-idle keep-alive connection is closed to
  make room; when none is idle, the newcomer's request gets a 503 with ``Retry-After`` and its
  connection is closed. Nothing already in progress is touched.

Pipelined requests are answered in order, each after the one before it; at most
``max_pipelined`` wait, then reading pauses (TCP backpressure). An error found while an earlier
request is still being answered (a malformed or oversized pipelined request) is answered in its
turn, never in the middle of another answer. Deadlines are checked by one sweep per server every
``tick`` seconds, not by a timer per request (a timer costs more than the rest of a request's
bookkeeping). A client that disconnects cancels its request's handler.

``shutdown(grace)`` stops the server as Kubernetes stops a pod (SIGTERM, then SIGKILL after the
grace period): it stops listening, having first taken the connections the kernel had already
accepted for it (closing a listening socket resets those, requests and all); it closes the
keep-alive connections between requests (once the loop has read what had arrived on them),
answers every request it has begun reading or has yet to answer, and the first one on each
connection opened but silent so far (its client opened it to send one), each answer saying
``Connection: close`` and its connection closed after it; and it returns once no connection
is left, or at ``grace``, when it cuts the rest (a silent connection is closed at
``header_timeout``, as always).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

import httptools

from kvflow.request_body import DEFAULT_BUFFERED_BODIES, BodyBudget

Header = tuple[str, str]
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_IDLE, _HEAD, _BODY = 0, 1, 2  # where the parser is in the next request
LINGER = 2.0
"""Seconds a connection refused mid-body reads and drops the rest before it closes."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may send and how long it may take (defaults: like nginx and Envoy)."""

    max_body: int = 8 << 20
    max_request_line: int = 8192
    max_header_bytes: int = 65536
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 60.0
    write_timeout: float = 60.0
    max_connections: int = 4096
    max_pipelined: int = 16
    max_buffered_bodies: int = DEFAULT_BUFFERED_BODIES

    @property
    def tick(self) -> float:
        """How often deadlines are checked: a tenth of the shortest, at most once a second."""
        shortest = min(self.header_timeout, self.body_timeout, self.keep_alive_timeout, self.write_timeout)
        return max(0.01, min(1.0, shortest / 10))


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "peer", "held")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, peer: str = "", held: int = 0) -> None:
        self.held = held
        """Bytes of the server's body budget this request holds until it has been answered."""
        self.method, self.path, self.query = method, path, query
        self.headers = headers
        """Lower-case names."""
        self.body, self.keep_alive = body, keep_alive
        self.peer = peer
        """The client's address (host), for per-client fairness without API keys."""


class Responder:
    """Writes one answer: ``send`` a whole one, or ``start`` + ``write``... + ``end`` a stream."""

    __slots__ = ("_conn", "_keep_alive", "started", "status", "_head_unsent")

    def __init__(self, conn: _Connection, keep_alive: bool) -> None:
        self._conn, self._keep_alive = conn, keep_alive
        self.started = False
        self.status = 0
        self._head_unsent = b""
        """A stream's head, until its first chunk goes with it."""

    def _head(self, status: int, headers: Iterable[Header], framing: str) -> bytes:
        self.started, self.status = True, status
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{framing}"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        if not self._keep_alive or self._conn.last_answer:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def send(self, status: int, body: bytes, headers: Iterable[Header] = ()) -> None:
        if self.started:
            raise RuntimeError("the answer was already started")
        self._conn.write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)

    def start(self, status: int, headers: Iterable[Header] = ()) -> None:
        """Begin a stream. Its head is written with the first ``write`` (or ``drain``, ``end``):
        the client gets the head and the first token in one segment, and its reader wakes once."""
        self._head_unsent = self._head(status, headers, "Transfer-Encoding: chunked\r\n")

    def _framed(self, chunk: bytes) -> bytes:
        """``chunk`` as a chunk of the stream, after the head if it is still to go."""
        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
        if self._head_unsent:
            data, self._head_unsent = self._head_unsent + data, b""
        return data

    async def write(self, chunk: bytes) -> None:
        """One chunk of a stream; ConnectionResetError once the client has gone (or stopped reading)."""
        data = self._framed(chunk)
        if data:
            self._conn.write(data)
            await self._conn.drain()

    def write_now(self, chunk: bytes) -> bool:
        """``write`` without waiting (a relay's callback): False once the client has gone or its
        buffer is full, and then ``drain`` says which."""
        return self._conn.write_now(self._framed(chunk))

    async def drain(self) -> None:
        """Until the client has room again; ConnectionResetError once it has gone."""
        if self._head_unsent:
            self._conn.write(self._framed(b""))
        await self._conn.drain()

    def end(self) -> None:
        self._conn.write(self._framed(b"") + b"0\r\n\r\n")

    @property
    def closed(self) -> bool:
        return self._conn.closed


Handler = Callable[[Request, Responder], Awaitable[None]]
Fallback = Callable[[Responder, int, str], None]


class _Refused(Exception):
    """Raised inside a parser callback: stop parsing, answer ``status``, close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Rejection:
    """An answer queued in a request's place (in order with pipelined answers), then close."""

    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


class _Server:
    """What a listening server shares with its connections: limits, open connections, the sweep."""

    def __init__(self, handler: Handler, fallback: Fallback, limits: Limits, loop: asyncio.AbstractEventLoop) -> None:
        self.handler, self.fallback, self.limits, self.loop = handler, fallback, limits, loop
        self.conns: set[_Connection] = set()
        self.idle: dict[_Connection, None] = {}
        """Connections between requests, longest idle first: the ones closed to make room."""
        self.counts: dict[str, int] = {}
        """Connections closed or requests refused by the limits, by reason (metrics)."""
        self.bodies = BodyBudget(limits.max_buffered_bodies)
        """Request body bytes held by all connections."""
        self.sweeper: asyncio.TimerHandle | None = None
        self.draining = False
        """Shutting down: each connection closes after its last answer, none is kept alive."""
        self.drained: asyncio.Future[None] | None = None
        """Set once draining and no connection is left."""

    def count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def opened(self, conn: _Connection) -> None:
        if len(self.conns) >= self.limits.max_connections:
            if self.idle:
                victim = next(iter(self.idle))
                victim.close_quietly()
                self.forget(victim)
                self.count("evicted_idle")
            else:
                conn.overloaded = True
                self.count("over_connection_limit")
        self.conns.add(conn)
        self.idle[conn] = None

    def forget(self, conn: _Connection) -> None:
        self.conns.discard(conn)
        self.idle.pop(conn, None)
        if self.draining and not self.conns and self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.conns):
            if conn.write_deadline and now > conn.write_deadline:
                self.count("write_timeout")
                conn.abort()
            elif not conn.busy and now > conn.deadline:
                conn.expire()
        self.sweeper = self.loop.call_later(self.limits.tick, self.sweep)


class _Connection(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self.server, self.limits = server, server.limits
        self.handler, self.fallback = server.handler, server.fallback
        self._loop = server.loop  # kept: asyncio.get_running_loop() costs a getpid() system call per call
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.peer = ""
        self.phase = _IDLE
        self.busy = False
        """A request is queued or being answered: read deadlines wait until it is done."""
        self.deadline = self._loop.time() + self.limits.header_timeout
        self.write_deadline = 0.0
        self.overloaded = False
        self.lingering = False
        """Answered and half-closed: what the client still sends is read and dropped."""
        self._dead = False  # the parser failed or a limit was hit: nothing more is read
        self._reading = True
        self._head_bytes = 0
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._size = 0
        self._admitted = 0  # budget bytes taken for the body being read
        self._held = 0  # budget bytes this connection holds in all (that body, and requests not yet answered)
        self._pending: deque[Request | _Rejection] = deque()
        self._task: asyncio.Task[None] | None = None
        self._more: asyncio.Future[None] | None = None  # the task waits on it for the next request
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    # --- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.server.opened(self)

    def data_received(self, data: bytes) -> None:
        if self._dead:
            return
        if self.phase != _BODY:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.status, cause.message)
            else:
                self._refuse(400, "malformed HTTP request")
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
        else:
            # httptools buffers a header line until it ends: bound what it may hold
            if self.phase != _BODY and self._head_bytes > self.limits.max_request_line + self.limits.max_header_bytes:
                if self._header_count == 0:
                    self._refuse(414, f"request line over the {self.limits.max_request_line}-byte limit")
                else:
                    self._refuse(431, f"request headers over the {self.limits.max_header_bytes}-byte limit")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.forget(self)
        self._give(self._held)
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True
        self.write_deadline = self._loop.time() + self.limits.write_timeout

    def resume_writing(self) -> None:
        self._paused = False
        self.write_deadline = 0.0
        self._wake_writer()

    # --- httptools callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0
        self._admitted = 0
        self._header_count = self._header_bytes = 0
        self.phase = _HEAD
        self.server.idle.pop(self, None)
        if not self.busy:
            self.deadline = self._loop.time() + self.limits.header_timeout

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_request_line:
            raise _Refused(414, f"request line over the {self.limits.max_request_line}-byte limit")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4
        if self._header_count > self.limits.max_headers:
            raise _Refused(431, f"more than {self.limits.max_headers} request headers")
        if self._header_bytes > self.limits.max_header_bytes:
            raise _Refused(431, f"request headers over the {self.limits.max_header_bytes}-byte limit")
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.phase = _BODY
        self._head_bytes = 0
        if not self.busy:
            self.deadline = self._loop.time() + self.limits.body_timeout
        if self.overloaded:
            return  # answered 503 once complete; its body is not kept
        length = self._headers.get("content-length")
        if length is not None and length.isdigit():
            self._admit(int(length))  # refused here, before a byte of the body is read
        if (self._headers.get("expect", "").lower() == "100-continue" and not self.busy
                and not self._dead):  # never in the middle of an earlier request's answer
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self.overloaded:
            return
        if self._size > self._admitted:  # chunked, or longer than declared (the parser stops that)
            self._admit(self._size)
        self._body.append(body)

    def _admit(self, size: int) -> None:
        """Hold ``size`` bytes of the server's budget for the body being read, or refuse it."""
        if size > self.limits.max_body:
            raise _Refused(413, f"request body is over the {self.limits.max_body}-byte limit")
        more = size - self._admitted
        if more <= 0:
            return
        budget = self.server.bodies
        if not budget.fits(more):
            budget.refused += 1
            self.server.count("over_body_budget")
            raise _Refused(503, "the gateway is receiving too many request bodies at once; retry later")
        budget.take(more)
        self._admitted = size
        self._held += more

    def _give(self, n: int) -> None:
        if n > 0:
            self._held -= n
            self.server.bodies.give(n)

    def on_message_complete(self) -> None:
        self.phase = _IDLE
        self._head_bytes = 0
        if self.overloaded:
            self._enqueue(_Rejection(503, "the gateway has too many open connections; retry later"))
        else:
            path, _, query = self._url.decode("latin-1").partition("?")
            body, self._body = b"".join(self._body), []
            self._enqueue(Request(self.parser.get_method().decode(), path, query, self._headers,
                                  body, self.parser.should_keep_alive(), self.peer, self._admitted))
            self._admitted = 0

    # --- requests -------------------------------------------------------------------------
    def _enqueue(self, item: Request | _Rejection) -> None:
        pending = self._pending
        pending.append(item)  # pipelined ones are answered in order
        self.busy = True
        if isinstance(item, _Rejection):
            self._stop_reading()
        elif len(pending) >= self.limits.max_pipelined and self._reading and self.transport is not None:
            self._reading = False
            self.transport.pause_reading()
        if self._task is None:
            self._task = self._loop.create_task(self._serve())
        elif self._more is not None:
            more, self._more = self._more, None
            more.set_result(None)

    async def _serve(self) -> None:
        """The connection's one task: its requests in order, then waits for the next one.

        One task per connection rather than per request: a keep-alive client's requests cost a
        future each, not a task (creating and registering one is a measurable share per request).
        """
        pending = self._pending
        try:
            while True:
                if not pending:
                    self._rest()
                    self._more = self._loop.create_future()
                    await self._more
                    continue
                item = pending.popleft()
                if not self._reading and not self._dead and len(pending) < self.limits.max_pipelined:
                    self._reading = True
                    self.transport.resume_reading()  # type: ignore[union-attr]
                if isinstance(item, _Rejection):
                    self._answer_and_close(item.status, item.message)
                    return
                if not await self._run(item):
                    return
        except asyncio.CancelledError:  # the client left
            return

    def _rest(self) -> None:
        """Nothing left to answer: the read deadline of whatever comes next starts now."""
        self.busy = False
        now = self._loop.time()
        if self.phase == _HEAD:
            self.deadline = now + self.limits.header_timeout
        elif self.phase == _BODY:
            self.deadline = now + self.limits.body_timeout
        elif self.server.draining:
            self.close_quietly()
        else:
            self.deadline = now + self.limits.keep_alive_timeout
            if not self.closed:
                self.server.idle[self] = None

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
        finally:
            if not self.closed:  # a closed connection gave back all it held
                self._give(request.held)
            request.held = 0
        if self.closed:
            return False
        if not request.keep_alive or (self.server.draining and not self._pending):
            self.close_quietly()
            return False
        return True

    @property
    def answered(self) -> bool:
        """It has carried a request (one is only idle between requests; a new one, before its first)."""
        return self._task is not None

    @property
    def last_answer(self) -> bool:
        """The answer being written is this connection's last: the server is shutting down and
        no pipelined request waits behind it."""
        return self.server.draining and not self._pending

    def _refuse(self, status: int, message: str) -> None:
        """A limit or a parse error: read nothing more; answer in turn, then close."""
        self.server.count(f"status_{status}")
        self._dead = True
        self._enqueue(_Rejection(status, message))

    def _answer_and_close(self, status: int, message: str) -> None:
        if self.closed:
            return
        self.fallback(Responder(self, keep_alive=False), status, message)
        if self.phase == _BODY and self.transport is not None and self.transport.can_write_eof():
            self._linger()
        else:
            self.close_quietly()

    def _linger(self) -> None:
        """Refused mid-body: closing now, with the client's bytes unread, would send a reset
        that can destroy the answer before the client reads it. So, as nginx's lingering close:
        end our side, then read and drop what the client still sends, until it closes or
        ``LINGER`` seconds pass (nothing of it is kept)."""
        assert self.transport is not None
        self.transport.write_eof()
        self.lingering, self.busy = True, False
        self.deadline = self._loop.time() + min(LINGER, self.limits.body_timeout)
        if not self._reading:
            self._reading = True
            self.transport.resume_reading()

    def _stop_reading(self) -> None:
        self._dead = True
        if self._reading and self.transport is not None and not self.closed:
            self._reading = False
            self.transport.pause_reading()

    def expire(self) -> None:
        """A read deadline passed with nothing to answer: 408 mid-request, else just close."""
        if self.lingering:
            self.close_quietly()
        elif self.phase == _IDLE:
            self.server.count("keep_alive_timeout")
            self.close_quietly()
        else:
            self.server.count("header_timeout" if self.phase == _HEAD else "body_timeout")
            self._dead = True
            what = "headers" if self.phase == _HEAD else "body"
            self._answer_and_close(408, f"the request's {what} did not arrive in time")
        self.server.forget(self)

    # --- writing --------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client has gone")
        self.transport.write(data)  # type: ignore[union-attr]

    def write_now(self, data: bytes) -> bool:
        if self.closed:
            return False
        if data:
            self.transport.write(data)  # type: ignore[union-attr]
        return not self._paused

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

    def close_quietly(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class HttpServer:
    """A listening server: ``sockets``, ``counts`` (what the limits refused), ``close()``."""

    def __init__(self, server: asyncio.Server, state: _Server) -> None:
        self._server, self._state = server, state

    @property
    def sockets(self) -> tuple[object, ...]:
        return tuple(self._server.sockets)

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def counts(self) -> dict[str, int]:
        return self._state.counts

    @property
    def open_connections(self) -> int:
        return len(self._state.conns)

    @property
    def idle_connections(self) -> int:
        """Open connections between requests: those the connection cap may close to make room."""
        return len(self._state.idle)

    def close(self) -> None:
        """Stop listening and close idle keep-alive connections; answers in progress go on."""
        self._server.close()
        if self._state.sweeper is not None:
            self._state.sweeper.cancel()
            self._state.sweeper = None
        for conn in list(self._state.idle):
            conn.close_quietly()

    async def shutdown(self, grace: float) -> int:
        """Stop taking connections, finish every request begun, then close (the module's
        docstring); how many connections were still open after ``grace`` seconds and were cut."""
        state, loop = self._state, self._state.loop
        state.draining = True
        state.drained = loop.create_future()
        queued = self._accept_queued()
        self._server.close()  # at once after taking the queue: a connection arriving between is reset
        for sock in queued:
            await loop.connect_accepted_socket(lambda: _Connection(state), sock)
        for _ in range(2):  # the loop reads what has already arrived: a request begun is not idle
            await asyncio.sleep(0)
        for conn in list(state.idle):
            if conn.answered:  # a new one was opened to send a request: it gets its answer
                conn.close_quietly()
                state.forget(conn)
        if state.conns:
            try:
                await asyncio.wait_for(asyncio.shield(state.drained), grace)
            except TimeoutError:
                pass
        cut = len(state.conns)
        for conn in list(state.conns):
            conn.abort()
        if state.sweeper is not None:
            state.sweeper.cancel()
            state.sweeper = None
        return cut

    def _accept_queued(self) -> list[socket.socket]:
        """The connections the kernel accepted on the listening sockets and the loop has not
        taken yet."""
        taken = []
        for listening in self._server.sockets:
            with socket.socket(fileno=os.dup(listening.fileno())) as sock:
                sock.setblocking(False)
                while True:
                    try:
                        conn, _ = sock.accept()
                    except OSError:  # BlockingIOError: none left
                        break
                    conn.setblocking(False)
                    taken.append(conn)
        return taken


async def serve_http(handler: Handler, fallback: Fallback, host: str, port: int, limits: Limits | None = None, *,
                     max_body: int | None = None, backlog: int = 4096, reuse_port: bool = False) -> HttpServer:
    """Listen; ``fallback(out, status, message)`` writes answers for requests that never reach
    ``handler`` (malformed HTTP, limits, timeouts, overload)."""
    limits = limits or Limits()
    if max_body is not None:
        limits = dataclasses.replace(limits, max_body=max_body)
    loop = asyncio.get_running_loop()
    state = _Server(handler, fallback, limits, loop)
    server = await loop.create_server(lambda: _Connection(state), host, port,
                                      backlog=backlog, reuse_address=True, reuse_port=reuse_port)
    state.sweeper = loop.call_later(limits.tick, state.sweep)
    return HttpServer(server, state)
