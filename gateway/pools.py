"""One pool per model: its router (the same scheduler the ext_proc server runs), its
admission gate and its metrics. The gateway talks to the router through ``PoolRouter``, the
part of ``kvflow.router.Router`` it uses, so tests can stand in a scripted router."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.gateway.config import FlowConfig, PoolConfig
from kvflow.gateway.flow import Gate
from kvflow.gateway.hold import Hold
from kvflow.gateway.metrics import GatewayMetrics, ModelMetrics
from kvflow.router.datastore import Datastore
from kvflow.router.flight import Flight
from kvflow.router.model import SchedulingRequest, SchedulingResult
from kvflow.router.observability import RouterMetrics
from kvflow.endpoints import Endpoint
from kvflow.tokenizer import Tokenizer


class PoolRouter(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def tokenize(self, body: Mapping[str, Any]) -> list[int]: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def offload_bytes(self) -> int: ...

    @property
    def max_prompt_tokens(self) -> int: ...

    async def prepare(self, request: SchedulingRequest) -> None: ...

    def schedule(self, request: SchedulingRequest) -> SchedulingResult: ...

    def flight(self, request: SchedulingRequest, result: SchedulingResult) -> Flight: ...

    def mark_failed(self, endpoint: Endpoint) -> None: ...

    @property
    def endpoints(self) -> Sequence[Endpoint]: ...

    @property
    def metrics(self) -> RouterMetrics:
        """The router's families; the gateway renders ``metrics.registry`` on its /metrics."""

    def refresh_gauges(self) -> None:
        """Set the gauges read when scraped (per-pod in flight, routable)."""


@dataclass(frozen=True, slots=True)
class Pool:
    model: str
    router: PoolRouter
    gate: Gate
    metrics: ModelMetrics
    hold: Hold | None = None
    """Where requests wait while no pod can serve the pool (None: a router with no datastore to
    watch, as in tests: the router's 503 at once)."""


def build_router(config: PoolConfig) -> PoolRouter:
    """A kvflow.router.Router for the pool's static endpoints and profile."""
    from kvflow.router import Router, load_config
    from kvflow.router.tokenizer_policy import choose_tokenizer

    source = config.router_config
    if source is None or isinstance(source, dict):  # the router's metrics name the pool by its model
        pool = {"name": config.model, "model": config.model, "loras": list(config.loras)}
        source = {**(source or {}), "pool": {**pool, **(source or {}).get("pool", {})}}
    router_config = load_config(source)
    tokenizer = choose_tokenizer(router_config, config.tokenizer, who=f"kvflow gateway: pool {config.model}")
    router = Router(router_config, config.all_endpoints(), profile=config.profile, tokenizer=tokenizer)
    if router_config.max_prompt_tokens is None and config.max_model_len:
        router.max_prompt_tokens = config.max_model_len  # vLLM's own limit, known before a pod refuses
    return router


def build_pool(model: str, router: PoolRouter, flow: FlowConfig, metrics: GatewayMetrics,
               hold_seconds: float = 0.0) -> Pool:
    gate = Gate(flow.max_inflight, flow.max_queue, flow.queue_timeout, flow.max_inflight_per_client)
    return Pool(model, router, gate, metrics.model(model), _hold(model, router, flow, hold_seconds))


def _hold(model: str, router: PoolRouter, flow: FlowConfig, seconds: float) -> Hold | None:
    """Held requests wake when the router's datastore gains a pod that can decode."""
    datastore = getattr(router, "datastore", None)  # kvflow.router.Router's; a scripted router has none
    if not isinstance(datastore, Datastore) or seconds <= 0:
        return None
    decoders = datastore.by_role  # cached by the datastore until its set or a pod's view changes
    hold = Hold(model, seconds, flow.max_queue, lambda: bool(decoders()[0]))
    datastore.subscribe(hold.endpoint_changed)
    return hold
