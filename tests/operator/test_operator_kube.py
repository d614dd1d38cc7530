"""The operator's Kubernetes client: kubernetes_asyncio configured from kopf's credentials.

A real HTTPS server that demands a client certificate stands in for the API server, so the
client's TLS set-up (CA and client key given as *data*, as in a kubeconfig) is exercised for
real, as are pagination and error mapping. Nothing may reach the disk: no temporary files, no
file in the temp folder holding the key, no memory file left open after a re-login.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from aiohttp import web

from kvflow import certs
from kvflow.operator.kube import ApiError, KubeClient

PODS = [{"metadata": {"name": f"p{i}", "labels": {"app": "x"}}} for i in range(5)]


@pytest.fixture
async def api_server(tmp_path: Path) -> AsyncIterator[tuple[str, certs.KeyPair, certs.KeyPair]]:
    ca = certs.authority()
    server = certs.issue(ca, ["127.0.0.1"])
    client = certs.issue(ca, ["kvflow-operator"], client=True)
    (tmp_path / "server.crt").write_bytes(server.cert_pem)
    (tmp_path / "server.key").write_bytes(server.key_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca.cert_pem.decode())
    context.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED  # no client certificate, no connection

    async def pods(request: web.Request) -> web.Response:
        assert request.transport is not None and request.transport.get_extra_info("peercert")
        start = int(request.query.get("continue") or 0)
        limit = int(request.query["limit"])
        page = PODS[start:start + 2]  # a server that pages harder than asked
        assert limit >= 2
        token = str(start + 2) if start + 2 < len(PODS) else ""
        return web.json_response({"items": page, "metadata": {"continue": token}})

    async def missing(_: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "message": "pods \"nope\" not found", "reason": "NotFound"},
                                 status=404)

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/default/pods", pods)
    app.router.add_get("/api/v1/namespaces/default/pods/nope", missing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS chose
    try:
        yield f"https://127.0.0.1:{port}", ca, client
    finally:
        await runner.cleanup()


def connection(url: str, ca: certs.KeyPair, client: certs.KeyPair) -> kopf.ConnectionInfo:
    """As a kubeconfig gives them: base64 data fields, no files."""
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    return kopf.ConnectionInfo(server=url, ca_data=b64(ca.cert_pem), certificate_data=b64(client.cert_pem),
                               private_key_data=b64(client.key_pem))


def memfds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "kvflow-credential" in target:
            out.add(target)
    return out


async def test_client_certificates_from_memory_never_touch_the_disk(
        api_server: tuple[str, certs.KeyPair, certs.KeyPair], monkeypatch: pytest.MonkeyPatch) -> None:
    url, ca, client_pair = api_server

    def no_temp_files(*_: Any, **__: Any) -> Any:
        raise AssertionError("the client wrote a temporary file")

    for name in ("mkstemp", "NamedTemporaryFile", "TemporaryFile", "mkdtemp"):
        monkeypatch.setattr(tempfile, name, no_temp_files)
    temp_before = set(os.listdir(tempfile.gettempdir()))
    for _ in range(2):  # a login, then a re-login (kopf logs in again when credentials expire)
        client = KubeClient(connection(url, ca, client_pair))
        try:
            pods = await client.list("v1", "Pod", "default", {"app": "x"})
            assert [p["metadata"]["name"] for p in pods] == ["p0", "p1", "p2", "p3", "p4"]  # every page
            assert all(p["kind"] == "Pod" and p["apiVersion"] == "v1" for p in pods)
            assert await client.get("v1", "Pod", "default", "nope") is None
        finally:
            await client.close()
    assert not memfds(), "in-memory credential files must be closed once the SSL context is built"
    new = set(os.listdir(tempfile.gettempdir())) - temp_before
    key_line = client_pair.key_pem.splitlines()[1]
    for name in new:
        path = Path(tempfile.gettempdir()) / name
        assert not (path.is_file() and key_line in path.read_bytes()), f"{path} holds the client key"


async def test_without_the_client_certificate_the_server_refuses(
        api_server: tuple[str, certs.KeyPair, certs.KeyPair]) -> None:
    url, ca, _ = api_server
    client = KubeClient(kopf.ConnectionInfo(server=url, ca_data=ca.cert_pem.decode()))  # PEM works too
    try:
        with pytest.raises(ApiError) as exc:
            await client.list("v1", "Pod", "default")
        assert exc.value.status == 503
    finally:
        await client.close()
