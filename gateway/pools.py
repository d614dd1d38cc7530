"""One pool per model: its router (the same scheduler the ext_proc server runs), its
admission gate and its metrics. The gateway talks to the router through ``PoolRouter``, the
part of ``kvflow.router.Router`` it uses (one ``route`` call per request), so tests can stand
in a scripted router."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvflow.gateway.config import FlowConfig, PoolConfig
from kvflow.gateway.flow import Gate
from kvflow.gateway.hold import Hold
from kvflow.gateway.metrics import GatewayMetrics, ModelMetrics
from kvflow.router.datastore import Datastore
from kvflow.router.flight import Flight
from kvflow.router.observability import RouterMetrics
from kvflow.router.request import Incoming
from kvflow.endpoints import Endpoint
from kvflow.tokenizer import Tokenizer


class PoolRouter(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def route(self, incoming: Incoming) -> Flight:
        """The request's decision (``flight.result``) and the flight that accounts for it."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The one the router fingerprints prompts with (the gateway's ``/tokenize`` answers with it)."""

    @property
    def max_prompt_tokens(self) -> int: ...

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
    from kvflow.router.config import read_source
    from kvflow.router.tokenizer_policy import choose_tokenizer

    raw = read_source(config.router_config)
    pool = raw.get("pool") or {}
    if isinstance(pool, Mapping):  # (anything else: load_config says what is wrong with it)
        # The router resolves a request's model and adapter (Router.names): the ones the gateway
        # sends this pool, and its metrics name the pool by its model unless told otherwise.
        loras = [*config.loras, *(name for name in pool.get("loras", []) if name not in config.loras)]
        raw = {**raw, "pool": {"name": config.model, **pool, "model": config.model, "loras": loras}}
    router_config = load_config(raw)
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
