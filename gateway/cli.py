"""``kvflow gateway``: the OpenAI-compatible gateway, or (``--sidecar``) a decode pod's sidecar.

    kvflow gateway --host 127.0.0.1 --port 8080 --model tiny-llama \\
        --endpoint 127.0.0.2:8000 --endpoint 127.0.0.3:8000 --prefill-endpoint 127.0.0.4:8000 --profile pd
    kvflow gateway --config gateway.yaml            # many models; flags given as well override it
    kvflow gateway --sidecar --port 8000 --upstream 127.0.0.1:8001   # behind Envoy, next to vLLM
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pydantic import ValidationError

from kvflow.gateway.config import GatewayConfig, load_file
from kvflow.gateway.discovery import discover
from kvflow.cliargs import Parser


def parser() -> Parser:
    p = Parser(prog="kvflow gateway", description="The OpenAI-compatible kvflow gateway.")
    p.add_argument("--config", help="YAML/JSON gateway config (pools for many models)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--model", help="the model the --endpoint pods serve (default: ask their /v1/models)")
    p.add_argument("--discover-timeout", type=float, default=120.0,
                   help="without --model: seconds to wait for the pods to list their models")
    p.add_argument("--endpoint", action="append", default=[], metavar="HOST:PORT", help="a decode/aggregated pod")
    p.add_argument("--prefill-endpoint", action="append", default=[], metavar="HOST:PORT", help="a prefill pod")
    p.add_argument("--profile", help="the router's scheduling profile (default 'default')")
    p.add_argument("--router-config", help="the router's config file (plugins and profiles)")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder (default: built-in)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME", help="a LoRA adapter the pods serve")
    p.add_argument("--hold-when-empty", type=float, metavar="SECONDS",
                   help="every pool: while no pod can serve it, hold requests this long for one, then 503 "
                        "(default 300; 0: the 503 at once)")
    p.add_argument("--api-keys-file", help="API keys, one a line or YAML; enables authentication")
    p.add_argument("--api-keys-secret", metavar="NAMESPACE/NAME", help="a Kubernetes Secret holding API keys")
    p.add_argument("--max-inflight", type=int, help="requests per model upstream at once (default unlimited)")
    p.add_argument("--max-queue", type=int, help="requests per model waiting for a slot (default 1024)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 8 MiB)")
    p.add_argument("--connect-timeout", type=float)
    p.add_argument("--first-byte-timeout", type=float)
    p.add_argument("--idle-timeout", type=float)
    p.add_argument("--no-access-log", action="store_true", help="do not write JSON access logs")
    p.add_argument("--workers", type=int, help="gateway processes sharing the port (default 1)")
    p.add_argument("--batch-dir", help="the Batch API's database and files (default .kvflow/batches)")
    p.add_argument("--no-batch", action="store_true", help="serve no Batch API (/v1/files, /v1/batches)")
    p.add_argument("--sidecar", action="store_true", help="run as a decode pod's P/D sidecar behind Envoy")
    p.add_argument("--upstream", metavar="HOST:PORT", help="sidecar: the local vLLM server")
    p.add_argument("--allow-prefiller", action="append", default=[], metavar="ADDR|CIDR|DNS",
                   help="sidecar: a prefill pod (or network, or DNS name) it may send prompts to")
    p.add_argument("--shutdown-grace", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM, seconds to finish the requests in flight before exiting (default 25: "
                        "under Kubernetes' 30 s grace period)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    data: dict[str, Any] = load_file(args.config) if args.config else {}
    for flag, key in (("host", "host"), ("port", "port"), ("max_body_bytes", "max_body_bytes"),
                      ("workers", "workers")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if args.no_access_log:
        data["access_log"] = False
    _nested(data, "flow", max_inflight=args.max_inflight, max_queue=args.max_queue)
    _nested(data, "timeouts", connect=args.connect_timeout, first_byte=args.first_byte_timeout,
            idle=args.idle_timeout)
    _nested(data, "auth", keys_file=args.api_keys_file, secret=args.api_keys_secret)
    _nested(data, "batch", dir=args.batch_dir, enabled=False if args.no_batch else None)
    if args.allow_prefiller:
        _nested(data, "sidecar", prefillers=[*data.get("sidecar", {}).get("prefillers", []), *args.allow_prefiller])
    if args.endpoint or args.prefill_endpoint or args.model:
        if not args.endpoint:
            raise ValueError("--model needs at least one --endpoint")
        if args.model:
            found = [{"model": args.model, "endpoints": args.endpoint, "prefill_endpoints": args.prefill_endpoint,
                      "loras": args.lora}]
        else:  # serve what the pods serve, as sglang-router and vllm-router do
            found = discover(args.endpoint, args.prefill_endpoint, wait=args.discover_timeout)
        for pool in found:
            for flag, key in (("profile", "profile"), ("router_config", "router_config"), ("tokenizer", "tokenizer")):
                if getattr(args, flag):
                    pool[key] = getattr(args, flag)
            data["pools"] = [p for p in data.get("pools", []) if p.get("model") != pool["model"]] + [pool]
    if args.hold_when_empty is not None:  # every pool's, from the file or the flags
        data["pools"] = [{**pool, "hold_when_empty_seconds": args.hold_when_empty} for pool in data.get("pools", [])]
    return GatewayConfig.model_validate(data)


def _nested(data: dict[str, Any], section: str, **values: Any) -> None:
    given = {k: v for k, v in values.items() if v is not None}
    if given:
        data[section] = {**data.get(section, {}), **given}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(message)s")
    try:
        config = config_from_args(args)
        if args.sidecar and not args.upstream:
            raise ValueError("--sidecar needs --upstream HOST:PORT (the local vLLM)")
        if not args.sidecar and not config.pools:
            raise ValueError("no pools: give --model and --endpoint, or --config")
    except (ValueError, ValidationError, OSError) as exc:
        print(f"kvflow gateway: {exc}", file=sys.stderr)
        return 2
    from kvflow.gateway.server import SHUTDOWN_GRACE
    from kvflow.gateway.workers import is_worker, supervise

    grace = SHUTDOWN_GRACE if args.shutdown_grace is None else args.shutdown_grace
    if config.workers > 1 and not is_worker():
        return supervise(list(argv if argv is not None else sys.argv[2:]), config.workers, grace)
    if args.sidecar:
        from kvflow.sidecar.server import serve_sidecar

        run(lambda stopping: cancelled_when(stopping, serve_sidecar(config, args.upstream)))
    else:
        from kvflow.gateway.server import serve

        run(lambda stopping: serve(config, stopping, grace))
    return 0


async def cancelled_when(stopping: asyncio.Event, main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` until ``stopping`` is set, then cancel it (a server with no drain of its own)."""
    task = asyncio.ensure_future(main)
    waiter = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``main(stopping)`` on uvloop where it is installed. SIGTERM or SIGINT sets
    ``stopping`` (the server drains); a second SIGINT (Ctrl-C again) cancels it at once. A second
    SIGTERM changes nothing: Kubernetes sends one, then SIGKILL after the grace period."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run

    async def until_signalled() -> None:
        stopping = asyncio.Event()
        task = asyncio.ensure_future(main(stopping))

        def interrupted() -> None:
            if stopping.is_set():
                task.cancel()
            stopping.set()

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        loop.add_signal_handler(signal.SIGINT, interrupted)
        try:
            await task
        except asyncio.CancelledError:
            pass

    runner(until_signalled())


__all__ = ["config_from_args", "main", "parser"]
