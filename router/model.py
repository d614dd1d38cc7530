"""The router's plain data: what a scheduling cycle reads and what it returns.

Everything here is a frozen, slotted dataclass: a scheduling cycle reads one immutable
snapshot of the pool (``EndpointView`` per pod), so the same snapshot and seed always give the
same decision, and the async collectors (scraper, KV-event subscribers) never race with it.
The one mutable part is each pod's ``LoadCounter`` (the router's own in-flight count), which
its view reads live: cycles are synchronous, so none sees a counter change mid-decision, and
starting or finishing a request does not rebuild the snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.protocol.vllm_metrics import EngineMetrics as EngineMetrics  # the router's API names it
from kvflow.router.working_set import WorkingSet

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
    mm_hashes: tuple[str, ...] = ()
    """Digests of the request's images/audio/video (``kvflow.router.request.multimodal_hashes``)."""
    profile: str | None = None
    """The scheduling profile the request asked for (an allowed ``x-kvflow-profile``), else the router's."""


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    profile: str
    targets: tuple[Endpoint, ...]
    """Ordered: ``targets[0]`` is the pick, the rest are fallbacks."""
    prefill: Endpoint | None
    """Set when the P/D decider chose to disaggregate."""
    cached_tokens: int
    """Prompt tokens cached on ``targets[0]``, as the router believes."""


DEFAULT_PREFILL_RATE = 20_000.0
"""Prompt tokens per second a pod prefills until its own first tokens tell the router better."""


@dataclass(slots=True)
class LoadCounter:
    """The router's own, live accounting of what it sent to one pod (mutable, unlike the rest).

    Exact for this router's requests and current to the request, where scraped metrics are a
    snapshot of every router's requests up to a few hundred milliseconds old. The ``*_at_scrape``
    fields remember this router's share when the metrics were taken, so a view can tell its own
    load from other replicas' (``EndpointView.foreign_*``) and add what changed since.

    The pod's prefill queue is modelled as first-in first-out work (uncached prompt tokens) that
    drains at the pod's prefill rate, and is cut short by what is known to be done: a request
    that produced its first token (or finished) proves everything sent before it was prefilled.
    """

    in_flight: int = 0
    """Requests the router sent there that have not finished."""
    prefilling: int = 0
    """Of those, requests not yet known to have produced a first token."""
    tokens: int = 0
    """KV the requests in flight added there (prompt tokens not already cached), as far as the router knows."""
    dispatched: int = 0
    """Requests sent there since the metrics were scraped: load the metrics cannot show yet."""
    in_flight_at_scrape: int = 0
    prefilling_at_scrape: int = 0
    tokens_at_scrape: int = 0
    backlog: float = 0.0
    """Prefill work (tokens) queued at time ``backlog_at``, before draining."""
    backlog_at: float = 0.0
    sent_work: int = 0
    """Cumulative uncached prompt tokens sent: each request's position in the pod's queue."""
    done_work: int = 0
    """The queue position up to which prefill is known to be done."""
    sent_requests: int = 0
    seconds_per_token: float = 0.0
    """Observed seconds per token of prefill work (EWMA over first tokens); 0: not yet seen."""
    default_rate: float = DEFAULT_PREFILL_RATE
    foreign_waiting: int = 0
    """Waiting requests that are not this router's (other replicas'), as of the last scrape."""
    foreign_running: int = 0
    """Running requests that are not this router's, as of the last scrape."""
    kv_base: float = 0.0
    """``kv_usage`` is ``kv_base + tokens * kv_per_token``: the scraped usage, moved by the KV sent since."""
    kv_per_token: float = 0.0
    kv_capacity: int = 0
    """Tokens the pod's KV cache holds, as it reports (``num_gpu_blocks`` x block size); 0: unknown."""
    working_set: WorkingSet = field(default_factory=WorkingSet)
    """The distinct prompt tokens the requests sent here touched lately: the cache in use."""
    room: float = math.inf
    """KV tokens the pod can store without evicting any in use: its capacity less its working
    set (inf while it has not reported its capacity)."""

    @property
    def rate(self) -> float:
        """Prefill work the pod gets through per second."""
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else self.default_rate

    def queued(self, now: float) -> float:
        """Prefill work still ahead of a request sent at ``now``."""
        drained = self.backlog - (now - self.backlog_at) * self.rate
        known = self.sent_work - self.done_work
        return max(0.0, min(drained, known))

    def enqueue(self, work: int, now: float) -> tuple[float, int]:
        """A request with ``work`` tokens to prefill joins the queue: (work ahead of it, its position)."""
        ahead = self.queued(now)
        self.backlog, self.backlog_at = ahead + work, now
        self.sent_work += work
        self.sent_requests += 1
        return ahead, self.sent_work

    def dequeue(self, work: int, now: float) -> None:
        """A request sent with ``work`` failed before computing anything: take its work back out."""
        self.backlog, self.backlog_at = max(0.0, self.queued(now) - work), now

    def prefilled(self, position: int) -> None:
        """The request at ``position`` has its first token: everything up to it is done."""
        if position > self.done_work:
            self.done_work = position

    @property
    def mean_work(self) -> float:
        """Mean prefill work of the requests sent here (0 before the first)."""
        return self.sent_work / self.sent_requests if self.sent_requests else 0.0

    @property
    def kv_usage(self) -> float:
        usage = self.kv_base + self.tokens * self.kv_per_token
        return 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage

    def scraped(self, metrics: EngineMetrics, now: float) -> None:
        """The metrics now include everything sent so far: tell this router's load from others',
        and age the working set (blocks not touched for its window no longer count as in use)."""
        self.working_set.expire(now)
        self.dispatched = 0
        self.in_flight_at_scrape = self.in_flight
        self.prefilling_at_scrape = self.prefilling
        self.tokens_at_scrape = self.tokens
        self.observe(metrics)

    def observe(self, metrics: EngineMetrics) -> None:
        """What the scraped ``metrics`` say beyond this router's own requests, and its KV baseline."""
        self.foreign_waiting = max(0, metrics.waiting - self.prefilling_at_scrape)
        self.foreign_running = max(
            0, metrics.running + metrics.waiting - self.in_flight_at_scrape - self.foreign_waiting
        )
        capacity = (metrics.num_blocks or 0) * (metrics.block_size or 0)
        self.kv_capacity = capacity
        self.kv_per_token = 1.0 / capacity if capacity > 0 else 0.0
        self.kv_base = metrics.kv_usage - self.tokens_at_scrape * self.kv_per_token
        self._room()

    def touched(self, fingerprints: np.ndarray, now: float) -> None:
        """A request sent here at ``now`` reads or stores these prompt blocks."""
        self.working_set.touch(fingerprints, now)
        self._room()

    def _room(self) -> None:
        self.room = self.kv_capacity - self.working_set.tokens if self.kv_capacity > 0 else math.inf


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
        if counter is None:  # a stand-alone view (tests): its metrics are all it knows
            # requests sent since the scrape have no first token yet: they queue
            counter = LoadCounter(max(in_flight, dispatched_since_scrape), prefilling=dispatched_since_scrape,
                                  dispatched=dispatched_since_scrape)
            counter.observe(metrics if metrics is not None else _NO_METRICS)
        setattr_(self, "counter", counter)
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
