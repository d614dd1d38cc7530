"""The router's plain data: what a scheduling cycle reads and what it returns.

Everything here is a frozen, slotted dataclass: a scheduling cycle reads one immutable
snapshot of the pool (``EndpointView`` per pod), so the same snapshot and seed always give the
same decision, and the async collectors (scraper, KV-event subscribers) never race with it.
The one mutable part is each pod's ``LoadCounter`` (the router's own in-flight count,
``kvflow.router.load``), which its view reads live: cycles are synchronous, so none sees a
counter change mid-decision, and starting or finishing a request does not rebuild the snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.protocol.vllm_metrics import EngineMetrics as EngineMetrics  # the router's API names it
from kvflow.router.load import DEFAULT_PREFILL_RATE as DEFAULT_PREFILL_RATE, LoadCounter as LoadCounter

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    request_id: str
    model: str
    token_ids: Sequence[int]
    """Prompt token ids, tokenised with the pool's tokenizer (``kvflow.router.request.tokens_off_loop``)."""
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    """Lower-case header names (session affinity, LoRA, priority)."""
    lora: str | None = None
    cache_salt: str | None = None
    """vLLM's ``cache_salt`` request field: it keys the first block's hash."""
    mm_hashes: tuple[str, ...] = ()
    """Digests of the request's images/audio/video (``kvflow.router.request.multimodal_hashes``)."""
    profile: str | None = None
    """The scheduling profile the request asked for (an allowed ``x-kvflow-profile``), else the router's."""
    priority: int = 0
    """The Inference Extension's priority: higher first, 0 by default; below 0 the request is
    sheddable (a 429 when every pod is saturated, where others are sent on and queue there)."""


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    profile: str
    targets: tuple[Endpoint, ...]
    """Ordered: ``targets[0]`` is the pick, the rest are fallbacks."""
    prefill: Endpoint | None
    """Set when the P/D decider chose to disaggregate."""
    cached_tokens: int
    """Prompt tokens cached on ``targets[0]``, as the router believes."""


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
    adapters: frozenset[str] | None
    """The LoRA adapters the pod has loaded, as its ``/v1/models`` last listed them; None
    while unknown (LoRA off, or not fetched yet)."""
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
        adapters: frozenset[str] | None = None,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "endpoint", endpoint)
        setattr_(self, "metrics", metrics if metrics is not None else _NO_METRICS)
        setattr_(self, "healthy", healthy)
        if counter is None:  # a stand-alone view (tests): its metrics are all it knows
            # requests sent since the scrape have no first token yet: they queue
            counter = LoadCounter(max(in_flight, dispatched_since_scrape), prefilling=dispatched_since_scrape,
                                  dispatched=dispatched_since_scrape)
            counter.observe(metrics if metrics is not None else _NO_METRICS)
        setattr_(self, "counter", counter)
        setattr_(self, "adapters", adapters)
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
    def foreign_waiting(self) -> int:
        """Waiting requests that are not this router's (other replicas', or sent around it)."""
        return self.counter.foreign_waiting

    @property
    def foreign_running(self) -> int:
        return self.counter.foreign_running

    @property
    def queue(self) -> int:
        """Requests not yet past their prefill: this router's, live, plus other routers' as last scraped."""
        return self.counter.prefilling + self.counter.foreign_waiting

    @property
    def load(self) -> int:
        """Requests on the pod: this router's, live, plus other routers' as last scraped."""
        c = self.counter
        return c.in_flight + c.foreign_waiting + c.foreign_running

    @property
    def decoding(self) -> int:
        """Requests past their first token (each adds to every step's time)."""
        c = self.counter
        return c.in_flight - c.prefilling + c.foreign_running

    @property
    def kv_usage(self) -> float:
        """KV-cache use as scraped, moved by the KV this router sent or finished since."""
        return self.counter.kv_usage


_NO_METRICS = EngineMetrics()
