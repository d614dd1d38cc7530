"""The router's plain data: what a scheduling cycle reads and what it returns.

Everything here is a frozen, slotted dataclass: a scheduling cycle reads one immutable
snapshot of the pool (``EndpointView`` per pod), so the same snapshot and seed always give the
same decision, and the async collectors (scraper, KV-event subscribers) never race with it.
The one mutable part is each pod's ``LoadCounter`` (the router's own in-flight count), which
its view reads live: cycles are synchronous, so none sees a counter change mid-decision, and
starting or finishing a request does not rebuild the snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvflow.endpoints import Endpoint, EndpointId

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    request_id: str
    model: str
    token_ids: Sequence[int]
    """Prompt token ids, tokenised with the pool's tokenizer (``Router.tokenize``)."""
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    """Lower-case header names (session affinity, LoRA, priority)."""
    lora: str | None = None
    cache_salt: str | None = None
    """vLLM's ``cache_salt`` request field: it keys the first block's hash."""


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    profile: str
    targets: tuple[Endpoint, ...]
    """Ordered: ``targets[0]`` is the pick, the rest are fallbacks."""
    prefill: Endpoint | None
    """Set when the P/D decider chose to disaggregate."""
    cached_tokens: int
    """Prompt tokens cached on ``targets[0]``, as the router believes."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one vLLM ``/metrics`` scrape tells the scheduler."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int = 0
    block_size: int | None = None
    num_blocks: int | None = None
    models: frozenset[str] = frozenset()


@dataclass(slots=True)
class LoadCounter:
    """The router's own, live count of what it sent to one pod (mutable, unlike the rest)."""

    in_flight: int = 0
    """Requests the router sent there that have not finished."""
    dispatched: int = 0
    """Requests sent there since the metrics were scraped: load the metrics cannot show yet."""


@dataclass(frozen=True, slots=True, init=False)
class EndpointView:
    """One pod as a scheduling cycle sees it.

    The scraped part (endpoint, metrics, health) is frozen; ``counter`` is the datastore's live
    counter for the pod, so starting or finishing a request does not rebuild the snapshot.
    A cycle is synchronous, so nothing changes a counter while one reads it.
    """

    endpoint: Endpoint
    metrics: EngineMetrics
    healthy: bool
    counter: LoadCounter
    id: EndpointId = field(init=False)
    """``endpoint.id``, computed once: scorers read it for every endpoint of every decision."""

    def __init__(
        self,
        endpoint: Endpoint,
        metrics: EngineMetrics | None = None,
        healthy: bool = True,
        in_flight: int = 0,
        dispatched_since_scrape: int = 0,
        *,
        counter: LoadCounter | None = None,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "endpoint", endpoint)
        setattr_(self, "metrics", metrics if metrics is not None else _NO_METRICS)
        setattr_(self, "healthy", healthy)
        setattr_(self, "counter", counter if counter is not None else LoadCounter(in_flight, dispatched_since_scrape))
        setattr_(self, "id", endpoint.id)

    @property
    def in_flight(self) -> int:
        """Requests the router sent there that have not finished."""
        return self.counter.in_flight

    @property
    def dispatched_since_scrape(self) -> int:
        """Requests sent there since the metrics were scraped: load the metrics cannot show yet."""
        return self.counter.dispatched

    @property
    def queue(self) -> int:
        """Waiting requests, including what the router sent since the last scrape."""
        return self.metrics.waiting + self.counter.dispatched

    @property
    def load(self) -> int:
        return self.metrics.running + self.queue


_NO_METRICS = EngineMetrics()
