"""The router's plain data: what a scheduling cycle reads and what it returns.

Everything here is a frozen, slotted dataclass: a scheduling cycle reads one immutable
snapshot of the pool (``EndpointView`` per pod), so the same snapshot and seed always give the
same decision, and the async collectors (scraper, KV-event subscribers) never race with it.
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


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One pod as a scheduling cycle sees it."""

    endpoint: Endpoint
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    healthy: bool = True
    in_flight: int = 0
    """Requests the router sent there that have not finished."""
    dispatched_since_scrape: int = 0
    """Requests sent there since the metrics were scraped: load the metrics cannot show yet."""
    id: EndpointId = field(init=False)
    """``endpoint.id``, computed once: scorers read it for every endpoint of every decision."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.endpoint.id)

    @property
    def queue(self) -> int:
        """Waiting requests, including what the router sent since the last scrape."""
        return self.metrics.waiting + self.dispatched_since_scrape

    @property
    def load(self) -> int:
        return self.metrics.running + self.queue
