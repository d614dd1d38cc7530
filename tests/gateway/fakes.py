"""Test doubles at the gateway's own seams: a scripted router (``PoolRouter``) and small
in-process model servers whose behaviour a test sets per request (answer, 5xx, die mid-stream,
hang). The real simulator and router are used by the integration tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvflow.router.model import SchedulingRequest, SchedulingResult
from kvflow.router.observability import RouterMetrics
from kvflow.router.request import Incoming, PoolNames, scheduling_request
from kvflow.endpoints import Endpoint
from kvflow.tokenizer import BuiltinTokenizer


@dataclass
class ScriptedRouter:
    """Targets in the given order (rotated per request when ``rotate``); prefill when set. The
    request is built as the real router builds it (``scheduling_request`` with ``names``), with
    the tokens ``[1, 2, 3]``."""

    targets: Sequence[Endpoint]
    prefill: Endpoint | None = None
    rotate: bool = False
    names: PoolNames | None = None
    started: list[str] = field(default_factory=list)
    finished: list[tuple[str, bool]] = field(default_factory=list)
    """(request id, answered) as each request's accounting ended."""
    flights: list[tuple[str, list[str]]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    scheduled: list[SchedulingRequest] = field(default_factory=list)
    metrics: RouterMetrics = field(default_factory=lambda: RouterMetrics("scripted"))
    _n: int = 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def tokenizer(self) -> BuiltinTokenizer:
        return BuiltinTokenizer()

    max_prompt_tokens: int = 1 << 20

    async def route(self, incoming: Incoming) -> RecordingFlight:
        request = scheduling_request(incoming.body, incoming.headers, [1, 2, 3], request_id=incoming.request_id,
                                     names=self.names, max_prompt_tokens=self.max_prompt_tokens,
                                     priority=incoming.priority)
        self.scheduled.append(request)
        targets = tuple(self.targets)
        if self.rotate:
            k = self._n % len(targets)
            targets, self._n = targets[k:] + targets[:k], self._n + 1
        self.started.append(request.request_id)
        return RecordingFlight(self, request, SchedulingResult("default", targets, self.prefill, 0))

    def mark_failed(self, endpoint: Endpoint) -> None:
        self.failed.append(endpoint.id)

    @property
    def endpoints(self) -> Sequence[Endpoint]:
        return self.targets

    def refresh_gauges(self) -> None:
        self.metrics.in_flight.labels(self.metrics.pool, "scripted").set(len(self.started) - len(self.finished))


@dataclass
class RecordingFlight:
    """Records what the gateway told the router about one request (kvflow.router.flight.Flight)."""

    router: ScriptedRouter
    request: SchedulingRequest
    result: SchedulingResult
    events: list[str] = field(default_factory=list)
    served: bool = False

    def send_prefill(self, endpoint: Endpoint) -> None:
        self.events.append(f"prefill {endpoint.id}")

    def prefill_done(self, *, ok: bool) -> None:
        self.events.append(f"prefill_done {ok}")

    def send(self, endpoint: Endpoint, *, remote: bool = False) -> None:
        self.events.append(f"send {endpoint.id}")

    def failed(self, endpoint: Endpoint) -> None:
        self.events.append(f"failed {endpoint.id}")

    def first_token(self, *, observe: bool = True) -> None:
        self.served = True
        self.events.append("first_token" if observe else "answered")

    def finish(self) -> None:
        self.events.append("finish")
        self.router.finished.append((self.request.request_id, self.served))
        self.router.flights.append((self.request.request_id, self.events))

    def __enter__(self) -> RecordingFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


@dataclass
class FakePod:
    """A model server answering like vLLM; ``behaviour``: ok, 400, 500, stall (never answers),
    die (drops the connection after the first chunk), hang (silent after the first chunk),
    flood (streams 64 KiB chunks until the gateway goes away), leak (answers with its own
    ``kv_transfer_params``: engine id, host and port)."""

    name: str
    behaviour: str = "ok"
    chunks: int = 3
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    was_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a stream it was sending is cancelled (the gateway went away)."""
    endpoint: Endpoint | None = None
    runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.behaviour == "stall":
            await asyncio.Event().wait()  # never set: silent until the gateway goes away
        if self.behaviour == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.behaviour == "400":
            return web.json_response({"error": {"message": "bad prompt", "type": "BadRequestError"}}, status=400)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            await asyncio.sleep(0.005)  # a prefill takes a moment: concurrent ones overlap
            return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": request.headers.get("X-Request-Id"),
                "remote_block_ids": [0, 1], "remote_host": "127.0.0.1", "remote_port": 5600}})
        if self.behaviour == "leak":
            return web.json_response({"id": "c", "object": "text_completion", "model": body["model"], "choices": [],
                                      "kv_transfer_params": {"remote_engine_id": "engine-secret",
                                                             "remote_host": "10.1.2.3", "remote_port": 5600}})
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "text_completion", "model": body.get("model", "tiny"),
                                      "choices": [{"index": 0, "text": f"from {self.name}", "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            while self.behaviour == "flood":
                await out.write(b"data: " + b"x" * 65536 + b"\n\n")
            for i in range(self.chunks):
                if self.behaviour == "die" and i == 1:
                    request.transport.close()  # type: ignore[union-attr]
                    return out
                if self.behaviour == "hang" and i == 1:
                    await asyncio.Event().wait()  # never set: silent until the gateway goes away
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f"{self.name}-{i} ", "finish_reason": None}]}
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            self.was_cancelled.set()
            raise
        return out

    async def start(self, host: str) -> Endpoint:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, 0)
        await site.start()
        port = self.runner.addresses[0][1]  # the port the OS chose
        self.endpoint = Endpoint(host, port)
        return self.endpoint

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
