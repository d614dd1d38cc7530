"""The kvflow gateway on other HTTP layers, for ``bench_gateway.py --layers``: the same ``Gateway``
(routes, router, flow control, P/D, retries) behind another server, or talking to the pods
through another client. Only the bench uses this; it is how the HTTP layer was chosen.

    python bench/gateway_layers.py --server uvicorn|granian|own --client own|aiohttp|pyreqwest \\
        --port 8080 --model M --endpoint HOST:PORT [--endpoint ...]

Servers: ``own`` (kvflow's httptools server), ``uvicorn`` (ASGI, its httptools protocol, uvloop),
``granian`` (RSGI, Rust/hyper). Clients: ``own`` (kvflow's pooled httptools client), ``aiohttp``,
``pyreqwest`` (Rust/reqwest). The gateway is the user's default (``--profile default``, scrapes as
configured, access log on) unless ``--gateway-arg`` says otherwise. The layers come with
``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvflow.gateway.app import Gateway, build_gateway
from kvflow.gateway.cli import config_from_args, parser as gateway_parser
from kvflow.gateway.http1 import ConnectError
from kvflow.gateway.httpserver import Request
from kvflow.gateway.server import load_auth
from kvflow.heap import settle_heap

ENV = "KVFLOW_LAYERS_ARGV"


# --- upstream clients: the ConnectionPool interface Upstream uses --------------------------------

class _Response:
    """What Upstream reads of a response: status, lower-cased headers, the content type."""

    def __init__(self, response: Any) -> None:
        self.status = response.status
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    async def readany(self, timeout: float | None = None) -> bytes:
        raise NotImplementedError

    async def pipe(self, write: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]],
                   idle: float | None = None) -> None:
        """``Response.pipe`` over a client that only reads: each piece awaited, then handed on."""
        while chunk := await self.readany(idle):
            if not write(chunk):
                await drain()


class _AiohttpResponse(_Response):
    def __init__(self, response: Any) -> None:
        super().__init__(response)
        self._r = response

    async def read(self, timeout: float | None = None) -> bytes:
        return bytes(await asyncio.wait_for(self._r.read(), timeout))

    async def readany(self, timeout: float | None = None) -> bytes:
        return bytes(await asyncio.wait_for(self._r.content.readany(), timeout))

    def release(self) -> None:
        self._r.release()

    def close(self) -> None:
        self._r.close()


class AiohttpPool:
    def __init__(self, connect_timeout: float) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._session: Any = None
        self._connect_timeout = connect_timeout

    async def post(self, host: str, port: int, path: str, body: bytes, headers: Iterable[tuple[str, str]],
                   timeout: float | None = None, method: str = "POST") -> _AiohttpResponse:
        if self._session is None:
            self._session = self._aiohttp.ClientSession(
                connector=self._aiohttp.TCPConnector(limit=0),
                timeout=self._aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout))
        try:
            response = await asyncio.wait_for(
                self._session.request(method, f"http://{host}:{port}{path}", data=body, headers=dict(headers)), timeout)
        except self._aiohttp.ClientConnectorError as exc:
            raise ConnectError(str(exc)) from None
        except self._aiohttp.ClientError as exc:
            raise ConnectionError(str(exc)) from None
        return _AiohttpResponse(response)

    def close(self) -> None:
        if self._session is not None:
            asyncio.ensure_future(self._session.close())


class _ReqwestResponse(_Response):
    def __init__(self, request: Any, response: Any) -> None:
        super().__init__(response)
        self._request, self._r = request, response
        self._reader = response.body_reader

    async def read(self, timeout: float | None = None) -> bytes:
        return bytes(await asyncio.wait_for(self._reader.bytes(), timeout))

    async def readany(self, timeout: float | None = None) -> bytes:
        chunk = await asyncio.wait_for(self._reader.read_chunk(), timeout)
        return b"" if chunk is None else bytes(chunk)

    def release(self) -> None:
        asyncio.ensure_future(self._request.__aexit__(None, None, None))

    close = release


class ReqwestPool:
    def __init__(self, connect_timeout: float) -> None:
        from datetime import timedelta

        from pyreqwest.client import ClientBuilder
        from pyreqwest.exceptions import ConnectError as ReqwestConnectError

        self._client = ClientBuilder().connect_timeout(timedelta(seconds=connect_timeout)).http1_only().build()
        self._connect_error = ReqwestConnectError

    async def post(self, host: str, port: int, path: str, body: bytes, headers: Iterable[tuple[str, str]],
                   timeout: float | None = None, method: str = "POST") -> _ReqwestResponse:
        request = (self._client.request(method, f"http://{host}:{port}{path}").headers(dict(headers))
                   .body_bytes(body).build_streamed())
        try:
            response = await asyncio.wait_for(request.__aenter__(), timeout)
        except self._connect_error as exc:
            raise ConnectError(str(exc)) from None
        except OSError:
            raise
        except Exception as exc:  # pyreqwest's request errors
            raise ConnectionError(str(exc)) from None
        return _ReqwestResponse(request, response)

    def close(self) -> None:
        asyncio.ensure_future(self._client.close())


CLIENTS = {"aiohttp": AiohttpPool, "pyreqwest": ReqwestPool}


# --- servers: Request/Responder over ASGI and RSGI ----------------------------------------------

class _BufferedResponder:
    """The Responder interface over a server whose send is async: whole answers and stream
    heads wait in ``pending`` until the handler awaits (or returns)."""

    def __init__(self) -> None:
        self.started = False
        self.status = 0
        self.closed = False
        self.whole: tuple[int, bytes, list[tuple[str, str]]] | None = None
        self.head: tuple[int, list[tuple[str, str]]] | None = None
        self.head_sent = False
        self.pending: list[bytes] = []

    def send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.started, self.status = True, status
        self.whole = (status, body, list(headers))

    def start(self, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.started, self.status = True, status
        self.head = (status, list(headers))

    def end(self) -> None:
        pass

    async def write(self, chunk: bytes) -> None:
        raise NotImplementedError

    def write_now(self, chunk: bytes) -> bool:
        """``Responder.write_now`` over an async send: the piece waits for ``drain``, so say False."""
        if self.closed:
            return False
        self.pending.append(chunk)
        return False

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client has gone")
        chunks, self.pending = self.pending, []
        if chunks:
            await self.write(b"".join(chunks))


class AsgiResponder(_BufferedResponder):
    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    async def write(self, chunk: bytes) -> None:
        try:
            if not self.head_sent and self.head is not None:
                self.head_sent = True
                await self._send({"type": "http.response.start", "status": self.head[0],
                                  "headers": [(k.lower().encode(), v.encode()) for k, v in self.head[1]]})
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as exc:  # uvicorn raises on a client that left
            self.closed = True
            raise ConnectionResetError(str(exc)) from None

    async def finish(self) -> None:
        if self.whole is not None:
            status, body, headers = self.whole
            await self._send({"type": "http.response.start", "status": status,
                              "headers": [(k.lower().encode(), v.encode()) for k, v in headers]})
            await self._send({"type": "http.response.body", "body": body})
        elif self.head is not None:
            if not self.head_sent:
                await self.write(b"")
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class RsgiResponder(_BufferedResponder):
    def __init__(self, protocol: Any) -> None:
        super().__init__()
        self._protocol = protocol
        self._transport: Any = None

    def send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.started, self.status = True, status
        self._protocol.response_bytes(status, list(headers), body)

    def start(self, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.started, self.status = True, status
        self._transport = self._protocol.response_stream(status, list(headers))

    async def write(self, chunk: bytes) -> None:
        try:
            await self._transport.send_bytes(chunk)
        except Exception as exc:  # granian's ProtocolClosed
            self.closed = True
            raise ConnectionResetError(str(exc)) from None


class GatewayApp:
    """The gateway as an ASGI and an RSGI application (built on the server's loop)."""

    def __init__(self, argv: list[str], client: str) -> None:
        self.config = config_from_args(gateway_parser().parse_args(argv))
        self.client = client
        self.gateway: Gateway | None = None

    async def startup(self) -> None:
        gateway, routers = build_gateway(self.config, await load_auth(self.config.auth))
        if self.client in CLIENTS:
            gateway.upstream.pool = CLIENTS[self.client](self.config.timeouts.connect)  # type: ignore[assignment]
        for router in routers.values():
            await router.start()
        self.gateway = gateway
        settle_heap()

    # ASGI (uvicorn)
    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client") or ("", 0)
        request = Request(scope["method"], scope["path"], scope["query_string"].decode("latin-1"), headers,
                          b"".join(chunks), True, client[0])
        out = AsgiResponder(send)
        assert self.gateway is not None
        await self.gateway.handle(request, out)  # type: ignore[arg-type]
        await out.finish()

    # RSGI (granian)
    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.startup())

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http":
            return
        body = await protocol()
        headers = {k.lower(): v for k, v in scope.headers.items()}
        request = Request(scope.method, scope.path, scope.query_string, headers, bytes(body), True,
                          scope.client.rsplit(":", 1)[0])
        assert self.gateway is not None
        await self.gateway.handle(request, RsgiResponder(protocol))  # type: ignore[arg-type]


def granian_app() -> GatewayApp:
    """Granian's factory: it imports this module in its worker and calls this."""
    spec = json.loads(os.environ[ENV])
    return GatewayApp(spec["argv"], spec["client"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=["own", "uvicorn", "granian"], default="own")
    p.add_argument("--client", choices=["own", *CLIENTS], default="own")
    args, gateway_argv = p.parse_known_args(argv)
    if args.server == "own":
        if args.client == "own":
            from kvflow.gateway.cli import main as gateway_main

            return gateway_main(gateway_argv)
        return _own_server_with(gateway_argv, args.client)
    config = config_from_args(gateway_parser().parse_args(gateway_argv))
    if args.server == "uvicorn":
        import uvicorn

        app = GatewayApp(gateway_argv, args.client)
        uvicorn.run(app, host=config.host, port=config.port, loop="uvloop", http="httptools", lifespan="on",
                    access_log=False, log_level="warning")
        return 0
    from granian import Granian
    from granian.constants import Interfaces, Loops

    os.environ[ENV] = json.dumps({"argv": gateway_argv, "client": args.client})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    Granian("gateway_layers:granian_app", address=config.host, port=config.port, interface=Interfaces.RSGI,
            loop=Loops.uvloop, factory=True, workers=1, log_level="warning").serve()  # type: ignore[arg-type]
    return 0


def _own_server_with(gateway_argv: list[str], client: str) -> int:
    from kvflow.gateway.cli import run
    from kvflow.gateway.server import limits_of, listen

    async def serve() -> None:
        app = GatewayApp(gateway_argv, client)
        await app.startup()
        assert app.gateway is not None
        server, _ = await listen(app.gateway.handle, app.config.host, app.config.port, limits_of(app.config))
        try:
            await asyncio.Event().wait()
        finally:
            server.close()

    run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
