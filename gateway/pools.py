"""One pool per model: its router (the same scheduler the ext_proc server runs), its
admission gate and its metrics. The gateway talks to the router through ``PoolRouter``, the
part of ``kvflow.router.Router`` it uses, so tests can stand in a scripted router."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.gateway.config import FlowConfig, PoolConfig
from kvflow.gateway.flow import Gate
from kvflow.gateway.metrics import GatewayMetrics, ModelMetrics
from kvflow.router.model import SchedulingRequest, SchedulingResult
from kvflow.endpoints import Endpoint


class PoolRouter(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def tokenize(self, body: Mapping[str, Any]) -> list[int]: ...

    def schedule(self, request: SchedulingRequest) -> SchedulingResult: ...

    def request_started(self, request: SchedulingRequest, result: SchedulingResult) -> None: ...

    def request_finished(self, request: SchedulingRequest, result: SchedulingResult, *, ok: bool) -> None: ...

    def mark_failed(self, endpoint: Endpoint) -> None: ...

    @property
    def endpoints(self) -> Sequence[Endpoint]: ...


@dataclass(frozen=True, slots=True)
class Pool:
    model: str
    router: PoolRouter
    gate: Gate
    metrics: ModelMetrics


def build_router(config: PoolConfig) -> PoolRouter:
    """A kvflow.router.Router for the pool's static endpoints and profile."""
    from kvflow.router import Router, load_config
    from kvflow.router.tokenizer_policy import choose_tokenizer

    source = config.router_config
    if source is None or isinstance(source, dict):  # the router's metrics name the pool by its model
        source = {**(source or {}), "pool": {"name": config.model, **(source or {}).get("pool", {})}}
    router_config = load_config(source)
    tokenizer = choose_tokenizer(router_config, config.tokenizer, who=f"kvflow gateway: pool {config.model}")
    router: PoolRouter = Router(router_config, config.all_endpoints(), profile=config.profile, tokenizer=tokenizer)
    return router


def build_pool(model: str, router: PoolRouter, flow: FlowConfig, metrics: GatewayMetrics) -> Pool:
    gate = Gate(flow.max_inflight, flow.max_queue, flow.queue_timeout)
    return Pool(model, router, gate, metrics.model(model))
