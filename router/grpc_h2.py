"""A gRPC server for the endpoint picker's methods: HTTP/2 on asyncio, without grpcio's machinery.

Behind Envoy the picker answers every HTTP request over an ext_proc stream of a few small
messages. grpcio's asyncio server hands each message read and written between its own poller
thread and the event loop; a profile of the picker under load put about half of its CPU there
(docs/router.md, "Envoy"). This server reads HTTP/2 frames in the event loop's own
``data_received``, hands each message to the method's handler in the same turn of the loop, and
writes the answers straight to the transport.

What it speaks: HTTP/2 (RFC 9113) over TCP, or over TLS with ALPN ``h2``; gRPC over HTTP/2
(length-prefixed protobuf messages, ``:status 200`` then ``grpc-status`` trailers), any mix of
streaming and unary methods, each a handler from an iterator of requests to an iterator of
answers. Flow control both ways: the server opens large receive windows and tops them up as it
reads; what it sends waits for the peer's windows. What it leaves out: message compression (a
compressed message fails its call ``UNIMPLEMENTED``), server push, priorities (ignored) and
``grpc-timeout`` (not enforced: an ext_proc stream lasts as long as its HTTP request).

Headers it receives are decoded with ``hpack`` (the connection's dynamic table); those it sends
are literals that never enter a table, each block opening with a table size update to 0, so the
encoder keeps no state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, cast

import hpack
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB

WINDOW = 1 << 24
"""Receive window per stream and for the connection: a whole ext_proc body fits."""
MAX_FRAME = 1 << 20
"""Largest frame the peer may send."""
MAX_HEADER_BLOCK = 64 << 10
"""Largest header block (HPACK-encoded) a request may open with."""
DEFAULT_WINDOW, DEFAULT_FRAME = 65_535, 16_384
MAX_STATUS_MESSAGE = 1_000


class Status(IntEnum):
    """gRPC status codes this server answers with."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class CallError(Exception):
    """Raised by a handler (or by reading its requests) to end the call with ``status``."""

    def __init__(self, status: Status, message: str = "") -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...  # noqa: N802 - protobuf's name


Handler = Callable[[AsyncIterator[Any]], AsyncIterator[Message]]


@dataclass(frozen=True, slots=True)
class Method:
    """A gRPC method: its request type (a protobuf class) and its handler. A unary method's
    handler reads one request and yields one answer."""

    request: Any
    handler: Handler


class _Raw:
    """The request type of a method this server does not have: any bytes."""

    @staticmethod
    def FromString(data: bytes) -> bytes:  # noqa: N802 - protobuf's name
        return data


async def _unimplemented(requests: AsyncIterator[Any]) -> AsyncIterator[Message]:
    # answered once the client's first message (or its end) is in, as grpcio's server answers:
    # a client still writing that message would see its write fail rather than this status
    async for _ in requests:
        break
    raise CallError(Status.UNIMPLEMENTED, "no such method")
    yield  # an async generator, as every handler  # pragma: no cover


_UNKNOWN = Method(_Raw, _unimplemented)


# -- HPACK: what the server sends, as literals that never enter a table ----------------------------


def _int(value: int, prefix: int, flags: int = 0) -> bytes:
    """RFC 7541 5.1: ``value`` on a ``prefix``-bit prefix."""
    top = (1 << prefix) - 1
    if value < top:
        return bytes([flags | value])
    out = bytearray([flags | top])
    value -= top
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field, literal without indexing, new name, no Huffman coding."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


_TABLE_SIZE_0 = b"\x20"  # a dynamic table size update to 0: the encoder keeps no table
_STATUS_200 = b"\x88"  # :status 200, static table entry 8
_GRPC_HEADERS = _TABLE_SIZE_0 + _STATUS_200 + _literal(b"content-type", b"application/grpc")
_OK_TRAILERS = _TABLE_SIZE_0 + _literal(b"grpc-status", b"0")


def _trailers(status: Status, message: str, *, headers: bool) -> bytes:
    """The trailers block (``headers``: a trailers-only answer, ``:status`` and content type first)."""
    block = _GRPC_HEADERS if headers else _TABLE_SIZE_0
    block += _literal(b"grpc-status", str(int(status)).encode())
    if message:  # percent-encoded as gRPC wants, and short: it must fit one frame
        block += _literal(b"grpc-message", urllib.parse.quote(message[:MAX_STATUS_MESSAGE], safe=" ").encode())
    return block


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def _goaway(last_stream: int, code: int, why: bytes = b"") -> bytes:
    return _frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + why)


def _settings(values: Mapping[int, int]) -> bytes:
    return _frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items()))


class _ConnectionError(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


# -- one call ----------------------------------------------------------------------------------------


class _Stream:
    """One call: the requests read and not yet handed to its handler, and what waits to be sent."""

    __slots__ = ("id", "method", "inbox", "waiter", "ended", "error", "buffer", "received", "send_window",
                 "pending", "trailers", "headers_sent", "done", "task")

    def __init__(self, stream_id: int, method: Method, send_window: int) -> None:
        self.id, self.method = stream_id, method
        self.inbox: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        """The peer sent its last request."""
        self.error: CallError | None = None
        """Its requests could not be read: the call ends with this."""
        self.buffer = bytearray()
        self.received = 0
        """Bytes received since its window was last topped up."""
        self.send_window = send_window
        self.pending = bytearray()
        self.trailers: bytes | None = None
        """Sent once ``pending`` is."""
        self.headers_sent = False
        self.done = False
        """The server ended it (trailers or a reset): nothing more is sent."""
        self.task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Requests:
    """A call's requests, as its handler reads them."""

    __slots__ = ("stream", "loop")

    def __init__(self, stream: _Stream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        s = self.stream
        while not s.inbox:
            if s.error is not None:
                raise s.error
            if s.ended:
                raise StopAsyncIteration
            s.waiter = self.loop.create_future()
            try:
                await s.waiter
            finally:
                s.waiter = None
        return s.inbox.popleft()


# -- one connection ----------------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_BLOCK
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.block: bytearray | None = None
        """A header block still waiting for its CONTINUATION frames, and its stream and flags."""
        self.block_stream, self.block_flags = 0, 0
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW
        """The initial window the peer gives each stream (its SETTINGS)."""
        self.peer_frame = DEFAULT_FRAME
        self.received = 0
        self.going_away = False
        self.out = bytearray()
        """Frames written this turn of the event loop, sent at its end."""
        self.loop = asyncio.get_running_loop()
        """Kept: looking it up costs a ``getpid()``, and a call needs it several times."""
        self.closed = self.loop.create_future()

    # the transport's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections.add(self)
        transport.write(_settings({S_ENABLE_PUSH: 0, S_INITIAL_WINDOW_SIZE: WINDOW, S_MAX_FRAME_SIZE: MAX_FRAME,
                                   S_MAX_CONCURRENT_STREAMS: self.server.max_streams,
                                   S_MAX_HEADER_LIST_SIZE: MAX_HEADER_BLOCK})
                        + _frame(WINDOW_UPDATE, 0, 0, (WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self.preface = True
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if length > MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"a {length}-byte frame")
                if len(buf) < 9 + length:
                    return
                kind, flags = buf[3], buf[4]
                stream_id = int.from_bytes(buf[5:9], "big") & 0x7FFF_FFFF
                payload = bytes(buf[9 : 9 + length])
                del buf[: 9 + length]
                self._on_frame(kind, flags, stream_id, payload)
        except _ConnectionError as exc:
            self._go_away(exc.code, str(exc))

    # frames

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.block is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was not continued")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if self.block is None or stream_id != self.block_stream:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block")
            self._add_block(payload, flags)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a PING is 8 bytes")
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._cancel(stream)
        elif kind == GOAWAY:
            self.going_away = True
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client cannot push")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 says

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) % 6:
            raise _ConnectionError(PROTOCOL_ERROR, "a malformed SETTINGS frame")
        if flags & ACK:
            return
        for i in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > 0x7FFF_FFFF:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                for stream in self.streams.values():
                    stream.send_window += value - self.peer_window
                self.peer_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 0xFF_FFFF:
                    raise _ConnectionError(PROTOCOL_ERROR, "a MAX_FRAME_SIZE out of range")
                self.peer_frame = value
        self._write(_frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE is 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFF_FFFF
        if stream_id == 0:
            self.send_window += increment
            self._flush_all()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self._flush(stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise _ConnectionError(PROTOCOL_ERROR, "a padded frame without its pad length")
            start, end = 1, len(payload) - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
        self.block, self.block_stream, self.block_flags = bytearray(), stream_id, flags
        self._add_block(payload[start:end], flags)

    def _add_block(self, fragment: bytes, flags: int) -> None:
        assert self.block is not None
        self.block += fragment
        if len(self.block) > MAX_HEADER_BLOCK:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "a header block over 64 KiB")
        if not flags & END_HEADERS:
            return
        block, stream_id, opened = bytes(self.block), self.block_stream, self.block_flags
        self.block = None
        try:
            headers = cast(dict[str, str], dict(self.decoder.decode(block)))  # str: not raw
        except (hpack.HPACKError, UnicodeDecodeError) as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"a header block HPACK cannot decode: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # the request's trailers
            if not opened & END_STREAM:
                raise _ConnectionError(PROTOCOL_ERROR, "trailers without END_STREAM")
            self._end(stream)
            return
        if stream_id <= self.last_stream or stream_id % 2 == 0:
            if stream_id <= self.last_stream:
                return  # a stream this server already ended (it may still send its trailers)
            raise _ConnectionError(PROTOCOL_ERROR, f"stream {stream_id} cannot be opened by a client")
        self.last_stream = stream_id
        self._open(stream_id, headers, ended=bool(opened & END_STREAM))

    def _open(self, stream_id: int, headers: dict[str, str], *, ended: bool) -> None:
        if self.going_away or len(self.streams) >= self.server.max_streams:
            self._write(_frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            self._write(_frame(HEADERS, END_HEADERS | END_STREAM, stream_id,
                               _TABLE_SIZE_0 + _literal(b":status", b"415")))
            return
        method = self.server.methods.get(headers.get(":path", ""), _UNKNOWN)
        stream = _Stream(stream_id, method, self.peer_window)
        stream.ended = ended
        self.streams[stream_id] = stream
        stream.task = self.loop.create_task(self._call(stream))

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        self.received += len(payload)
        if self.received > WINDOW:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "more data than the connection's window")
        if self.received >= WINDOW // 2:
            self._write(_frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))
            self.received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended:
            return  # a stream this server ended or reset: its data only counts against the connection
        stream.received += len(payload)
        if stream.received > WINDOW:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "more data than the stream's window")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "a malformed padded DATA frame")
            start, end = 1, len(payload) - payload[0]
        buffer = stream.buffer
        if stream.error is None:  # a call that failed reads nothing more
            buffer += payload[start:end]
        limit = self.server.max_message
        while len(buffer) >= 5 and stream.error is None:
            size = int.from_bytes(buffer[1:5], "big")
            if buffer[0]:
                stream.error = CallError(Status.UNIMPLEMENTED, "compressed messages are not supported")
            elif size > limit:
                stream.error = CallError(Status.RESOURCE_EXHAUSTED, f"a {size}-byte message (limit {limit})")
            elif len(buffer) < 5 + size:
                break
            else:
                try:
                    stream.inbox.append(stream.method.request.FromString(bytes(buffer[5 : 5 + size])))
                except DecodeError:
                    stream.error = CallError(Status.INTERNAL, "a request that does not parse")
                del buffer[: 5 + size]
        if flags & END_STREAM:
            if buffer and stream.error is None:
                stream.error = CallError(Status.INTERNAL, "the last request was cut short")
            self._end(stream)
        elif stream.received >= WINDOW // 2 and stream.error is None:
            self._write(_frame(WINDOW_UPDATE, 0, stream_id, stream.received.to_bytes(4, "big")))
            stream.received = 0
        stream.wake()

    def _end(self, stream: _Stream) -> None:
        stream.ended = True
        stream.wake()
        if stream.done:
            self._forget(stream)

    # the calls

    async def _call(self, stream: _Stream) -> None:
        status, message = Status.OK, ""
        answers = stream.method.handler(_Requests(stream, self.loop))
        try:
            try:
                async for answer in answers:
                    if stream.done:
                        break
                    self._send(stream, answer.SerializeToString())
            finally:
                aclose = getattr(answers, "aclose", None)
                if aclose is not None:
                    await aclose()  # its own cleanup now, not when the collector finds it
        except asyncio.CancelledError:
            return  # reset by the peer, or its connection lost: no one to answer
        except CallError as exc:
            status, message = exc.status, exc.message
        except Exception:
            log.exception("gRPC handler %s failed", stream.method.handler)
            status, message = Status.INTERNAL, "the server failed"
        if not stream.done:
            self._finish(stream, status, message)

    def _send(self, stream: _Stream, message: bytes) -> None:
        if not stream.headers_sent:
            stream.headers_sent = True
            self._write(_frame(HEADERS, END_HEADERS, stream.id, _GRPC_HEADERS))
        stream.pending += b"\x00" + len(message).to_bytes(4, "big") + message
        self._flush(stream)

    def _finish(self, stream: _Stream, status: Status, message: str) -> None:
        if not stream.headers_sent:  # trailers-only
            stream.headers_sent = True
            self._write(_frame(HEADERS, END_HEADERS | END_STREAM, stream.id,
                               _trailers(status, message, headers=True)))
            self._ended_here(stream)
            return
        stream.trailers = _OK_TRAILERS if status == Status.OK and not message else _trailers(
            status, message, headers=False)
        self._flush(stream)

    def _flush(self, stream: _Stream) -> None:
        pending = stream.pending
        while pending and self.send_window > 0 and stream.send_window > 0:
            n = min(len(pending), self.send_window, stream.send_window, self.peer_frame)
            self._write(_frame(DATA, 0, stream.id, bytes(pending[:n])))
            del pending[:n]
            self.send_window -= n
            stream.send_window -= n
        if not pending and stream.trailers is not None and not stream.done:
            self._write(_frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            self._ended_here(stream)

    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending or stream.trailers is not None:
                self._flush(stream)

    def _ended_here(self, stream: _Stream) -> None:
        """The server sent its END_STREAM: a peer still sending is told to stop (gRPC does the same)."""
        stream.done = True
        if not stream.ended:
            self._write(_frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
            stream.ended = True
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        self.streams.pop(stream.id, None)
        self._close_if_idle()

    def _cancel(self, stream: _Stream) -> None:
        stream.done = stream.ended = True
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        stream.wake()

    # the connection

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for the transport: what one turn of the event loop writes (every
        frame of every call it advanced) goes out in one write at the turn's end, where a write
        each would be a system call each (a fifth of the picker's CPU, measured)."""
        if not self.out:
            self.loop.call_soon(self._send_out)
        self.out += data

    def _send_out(self) -> None:
        data, self.out = self.out, bytearray()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def go_away(self) -> None:
        """No new calls; the connection closes when the ones in flight have ended."""
        if not self.going_away:
            self.going_away = True
            self._write(_goaway(self.last_stream, NO_ERROR))
        self._close_if_idle()

    def _go_away(self, code: int, why: str) -> None:
        log.warning("gRPC connection closed: %s", why)
        self._write(_goaway(self.last_stream, code, why.encode()[:200]))
        self._send_out()
        if self.transport is not None:
            self.transport.close()

    def _close_if_idle(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self._send_out()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class GrpcServer:
    """``methods``: each by its path (``/package.Service/Method``)."""

    def __init__(self, methods: Mapping[str, Method], *, max_message: int = 4 << 20, max_streams: int = 4096,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.methods = dict(methods)
        self.max_message = max_message
        self.max_streams = max_streams
        self.ssl_context = ssl_context
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host``:``port`` (OSError if it cannot)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, ssl=self.ssl_context,
                                                reuse_address=True)

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, let the calls in flight end (for up to ``grace`` seconds; None: none),
        then close every connection."""
        if self._server is not None:
            self._server.close()
        connections = list(self.connections)
        for connection in connections:
            connection.go_away()
        if grace and connections:
            await asyncio.wait([c.closed for c in connections], timeout=grace)
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
