"""``kvflow router``: the ext_proc endpoint picker, with /metrics and a decision debug endpoint.

    kvflow router --endpoint 127.0.0.2:8000 --endpoint 127.0.0.3:8000 --profile default \\
        --port 9002 --metrics-port 9090
    kvflow router --config router.yaml --tokenizer /models/tokenizer

It takes the Gateway API Inference Extension EPP's ports and flags (``--grpc-port``,
``--grpc-health-port``, ``--pool-name``, ``--pool-namespace``, ``--secure-serving``,
``--cert-path``, ``--config-file``), so a gateway or chart built for GIE's EPP can run it.

On the HTTP port, ``/debug/*`` (other requests' ids and ``cache_salt``) and ``/tokenize`` (a
CPU cost anyone could impose) are for readers only: with ``--reader-token-file`` they need
``Authorization: Bearer <that token>`` (the metrics reader's credential, a mounted Secret);
without it they answer loopback clients only (``kubectl port-forward``, a local stack).
``/metrics`` and ``/healthz`` stay open to whoever the network lets in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvflow import openai_api
from kvflow.errors import AuthenticationError, KvflowError
from kvflow.router import status_api
from kvflow.router.config import load_config, read_source
from kvflow.router.dashboard import HEADERS, page_file
from kvflow.router.epp import TlsOptions, serve_health, server_ssl_context
from kvflow.router.extproc import ExtProcLimits, serve
from kvflow.router.request import tokens_off_loop
from kvflow.routing_headers import check_allowable
from kvflow.router.router import Router
from kvflow.router.tokenizer_policy import choose_tokenizer
from kvflow.endpoints import Endpoint, Role, parse_host_port
from kvflow.cliargs import Parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = Parser(prog="kvflow router", description="Envoy ext_proc endpoint picker for vLLM pools")
    p.add_argument("--config", "--config-file", dest="config", help="router config (YAML or JSON)")
    p.add_argument("--endpoint", action="append", default=[], metavar="HOST:PORT", help="a pod serving both roles")
    p.add_argument("--prefill-endpoint", action="append", default=[], metavar="HOST:PORT", help="a prefill pod")
    p.add_argument("--decode-endpoint", action="append", default=[], metavar="HOST:PORT", help="a decode pod")
    p.add_argument("--model", action="append", default=[], help="model names the pods serve (default: any)")
    p.add_argument("--profile", default=None, help="scheduling profile (default: the config's defaultProfile)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--grpc-port", dest="port", type=int, default=9002, help="ext_proc gRPC port")
    p.add_argument("--grpc-health-port", type=int, default=9003,
                   help="plaintext gRPC health (service 'inference-extension', for kubelet probes; 0: off)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="/metrics, /debug/decisions, /v1/kvflow/status and /dashboard (0: off)")
    p.add_argument("--reader-token-file", type=Path, default=None,
                   help="a bearer token that /debug/* and /tokenize ask for (default: loopback clients only)")
    p.add_argument("--secure-serving", action=argparse.BooleanOptionalAction, default=True,
                   help="TLS on the ext_proc port (default; --no-secure-serving is plaintext)")
    p.add_argument("--cert-path", type=Path, default=None,
                   help="folder with tls.crt and tls.key (default: a self-signed certificate)")
    p.add_argument("--client-ca", type=Path, default=None,
                   help="require client certificates signed by this CA bundle (mutual TLS)")
    p.add_argument("--pool-name", default=None, help="the InferencePool to follow (overrides the config)")
    p.add_argument("--pool-namespace", default=None, help="its namespace (default: the config's, or NAMESPACE)")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's Hugging Face tokenizer folder, or 'builtin' (kvflow sim engines); "
                        "required for precise prefix routing on a Kubernetes pool")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-events-port", type=int, default=None, help="pods publish KV events on this port")
    p.add_argument("--no-kv-events", action="store_true", help="do not subscribe to KV events")
    p.add_argument("--max-body-bytes", type=int, default=ExtProcLimits().max_body_bytes,
                   help="largest request body ext_proc buffers (larger: 413)")
    p.add_argument("--max-streams", type=int, default=ExtProcLimits().max_streams,
                   help="requests ext_proc handles at once (more: 503 with Retry-After)")
    p.add_argument("--max-buffered-bytes", type=int, default=ExtProcLimits().max_buffered_bytes,
                   help="request body bytes ext_proc buffers across all requests (a body that does not fit: 503)")
    p.add_argument("--allow-client-header", action="append", default=[], metavar="NAME",
                   help="x-kvflow-profile / x-kvflow-priority: let clients choose (off by default)")
    p.add_argument("--shutdown-grace", type=float, default=25.0, metavar="SECONDS",
                   help="on SIGTERM, seconds the ext_proc streams in flight get to finish (default 25: under "
                        "Kubernetes' 30 s grace period; Envoy streams each answer through them)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(list(argv))


def config_from_args(args: argparse.Namespace) -> tuple[dict[str, object], list[Endpoint]]:
    raw: dict[str, object] = {}
    if args.config:
        raw = dict(read_source(args.config))
    if args.block_size is not None:
        raw["blockSize"] = args.block_size
    kv = dict(raw.get("kvEvents") or {})  # type: ignore[call-overload]
    if args.kv_events_port is not None:
        kv["port"] = args.kv_events_port
    if args.no_kv_events:
        kv["enabled"] = False
    if kv:
        raw["kvEvents"] = kv
    if args.pool_name:
        pool = dict(raw.get("pool") or {})  # type: ignore[call-overload]
        kubernetes = dict(pool.get("kubernetes") or {})
        kubernetes["inferencePool"] = args.pool_name
        namespace = args.pool_namespace or os.environ.get("NAMESPACE")
        if namespace:
            kubernetes["namespace"] = namespace
        raw["pool"] = {**pool, "name": pool.get("name", args.pool_name), "kubernetes": kubernetes}
    models = frozenset(args.model)
    endpoints = [
        Endpoint(*parse_host_port(text), role=role, models=models)
        for role, texts in (
            (Role.BOTH, args.endpoint),
            (Role.PREFILL, args.prefill_endpoint),
            (Role.DECODE, args.decode_endpoint),
        )
        for text in texts
    ]
    return raw, endpoints


READER_PATHS = ("/debug/", "/tokenize")
"""What only readers may ask for (the module docstring says who a reader is)."""


def reader_refusal(path: str, remote: str | None, authorization: str | None, token: str | None) -> KvflowError | None:
    """Why a request for ``path`` is refused (401, 403), or None when it may be answered."""
    if not path.startswith(READER_PATHS):
        return None
    if token is not None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return None
        return AuthenticationError(f"{path} needs the reader's token: send 'Authorization: Bearer <token>'")
    try:
        local = remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        local = False
    return None if local else ReaderOnly(f"{path} answers loopback clients only (or start the router with"
                                         " --reader-token-file)")


class ReaderOnly(KvflowError):
    status = 403
    type = "PermissionDeniedError"


def metrics_app(router: Router, reader_token: str | None = None) -> web.Application:
    @web.middleware
    async def readers_only(request: web.Request, handler: Any) -> web.StreamResponse:
        refused = reader_refusal(request.path, request.remote, request.headers.get("Authorization"), reader_token)
        if refused is not None:
            return web.json_response(refused.body(), status=refused.status)
        response: web.StreamResponse = await handler(request)
        return response

    async def metrics(_: web.Request) -> web.Response:
        router.refresh_gauges()
        return web.Response(
            body=router.metrics.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def decisions(request: web.Request) -> web.Response:
        n = int(request.query.get("n", "10"))
        return web.json_response(router.explain(n))

    async def endpoints(_: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "endpoint": v.id,
                    "role": str(v.endpoint.role),
                    "healthy": v.healthy,
                    "in_flight": v.in_flight,
                    "running": v.metrics.running,
                    "waiting": v.metrics.waiting,
                    "kv_usage": v.metrics.kv_usage,
                }
                for v in router.datastore.snapshot()
            ]
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def status(_: web.Request) -> web.Response:  # the metrics port is the cluster's, not clients'
        pool = status_api.pool_status(router.config.model or router.config.pool_name, router, loras=router.config.loras)
        return web.json_response(status_api.status_document("router", [pool]))

    async def dashboard(request: web.Request) -> web.Response:
        found = page_file(request.path)
        if found is None:
            raise web.HTTPNotFound()
        return web.Response(body=found[0], headers={"Content-Type": found[1], **dict(HEADERS)})

    async def tokenize(request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` with the router's own tokenizer, the one it fingerprints prompts
        with: what it sees of a prompt, to set beside a pod's answer (and a benchmark warms it)."""
        try:
            body = openai_api.decode_json(await request.read())
            req = openai_api.tokenize_request(body)
            tokens = await tokens_off_loop(router.tokenizer, body, request.content_length or 0)
        except KvflowError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(openai_api.tokenize_answer(router.tokenizer, tokens, router.max_prompt_tokens, req))

    app = web.Application(middlewares=[readers_only])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/decisions", decisions)
    app.router.add_get("/debug/endpoints", endpoints)
    app.router.add_get("/healthz", healthz)
    app.router.add_get(status_api.STATUS_PATH, status)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/static/{name}", dashboard)
    app.router.add_post("/tokenize", tokenize)
    return app


async def run(args: argparse.Namespace) -> int:
    token = args.reader_token_file.read_text().strip() if args.reader_token_file else None
    if token == "":
        raise SystemExit(f"kvflow router: --reader-token-file {args.reader_token_file} is empty")
    raw, endpoints = config_from_args(args)
    config = load_config(raw)
    if not endpoints and not config.endpoints and config.kubernetes is None:
        raise SystemExit("kvflow router: no endpoints (use --endpoint or a config with pool.endpoints)")
    try:
        tokenizer = choose_tokenizer(config, args.tokenizer, who="kvflow router")
    except (ValueError, OSError) as exc:
        raise SystemExit(str(exc) if str(exc).startswith("kvflow router") else f"kvflow router: {exc}") from None
    router = Router(config, endpoints, profile=args.profile or config.default_profile, tokenizer=tokenizer)
    try:
        tls = server_ssl_context(TlsOptions(args.secure_serving, args.cert_path, args.client_ca))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"kvflow router: TLS: {exc}") from None
    await router.start()  # also watches the pool's pods when the config names a Kubernetes pool
    limits = ExtProcLimits(args.max_body_bytes, args.max_streams,
                           frozenset(check_allowable(args.allow_client_header)), args.max_buffered_bytes)
    server = await serve(router, args.host, args.port, limits, tls)
    health = await serve_health(args.host, args.grpc_health_port) if args.grpc_health_port else None
    runner = None
    if args.metrics_port:
        runner = web.AppRunner(metrics_app(router, token), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.metrics_port).start()
    logging.getLogger("kvflow.router").info(
        "router: ext_proc on %s:%d (%s), profile %s, %d endpoints",
        args.host,
        args.port,
        ("mutual TLS" if args.client_ca else "TLS") if tls else "plaintext",
        router.profile,
        len(router.endpoints),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if health is not None:  # first: the readiness probe fails while the streams in flight finish
        await health.stop(grace=None)
    await server.stop(grace=args.shutdown_grace)
    if runner is not None:
        await runner.cleanup()
    await router.stop()
    return 0


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run(args))
    return 130
