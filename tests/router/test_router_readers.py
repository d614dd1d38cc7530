"""The router's HTTP port: ``/debug/*`` and ``/tokenize`` answer readers only (a bearer token, or
loopback clients when none is set); ``/metrics`` and ``/healthz`` stay open."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvflow.endpoints import Endpoint
from kvflow.router import Router, load_config
from kvflow.router.cli import metrics_app, reader_refusal

TOKEN = "reader-secret"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[str | None], object]]:
    servers: list[TestServer] = []

    async def start(token: str | None) -> str:
        router = Router(load_config(None), [Endpoint("127.0.0.2", 8000)])
        server = TestServer(metrics_app(router, token), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url(""))

    yield start  # type: ignore[misc]
    for server in servers:
        await server.close()


async def status(method: str, url: str, token: str | None = None) -> tuple[int, dict | str]:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.request(
            method, url, headers=headers, json={"prompt": "hi"} if method == "POST" else None) as resp:
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, body


async def test_with_a_token_debug_and_tokenize_need_it_and_metrics_stay_open(serve) -> None:  # type: ignore[no-untyped-def]
    base = await serve(TOKEN)
    for method, path in (("GET", "/debug/decisions"), ("GET", "/debug/endpoints"), ("POST", "/tokenize")):
        code, body = await status(method, base + path)
        assert code == 401 and body["error"]["type"] == "AuthenticationError", (path, body)  # type: ignore[index]
        assert (await status(method, base + path, "wrong"))[0] == 401
        assert (await status(method, base + path, TOKEN))[0] == 200
    assert (await status("GET", base + "/metrics"))[0] == 200
    assert (await status("GET", base + "/healthz"))[0] == 200


async def test_without_a_token_loopback_clients_are_readers(serve) -> None:  # type: ignore[no-untyped-def]
    base = await serve(None)
    assert (await status("GET", base + "/debug/decisions"))[0] == 200
    assert (await status("POST", base + "/tokenize"))[0] == 200


@pytest.mark.parametrize(("remote", "refused"), [
    ("127.0.0.1", None), ("127.0.0.9", None), ("::1", None), ("10.1.2.3", 403), ("192.168.0.7", 403),
    ("fe80::1%eth0", 403), (None, 403), ("not-an-ip", 403),
], ids=["v4-loopback", "other-loopback", "v6-loopback", "pod-ip", "lan", "link-local", "unknown", "garbage"])
def test_without_a_token_only_loopback_peers_read(remote: str | None, refused: int | None) -> None:
    found = reader_refusal("/debug/decisions", remote, None, None)
    assert (found.status if found else None) == refused
    assert reader_refusal("/metrics", remote, None, None) is None
