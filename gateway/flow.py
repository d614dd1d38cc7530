"""Flow control: a bounded priority queue per model and token-bucket rate limits per API key.

The decisions are pure and clocked from outside (``AdmissionQueue``, ``TokenBucket``), so tests
drive them with a fake clock; ``Gate`` is the thin asyncio layer that parks a request on a
future until the queue lets it through.

Order in the queue: higher priority first, then first come first served. When the queue is
full a newcomer displaces the most recent of the lowest-priority waiters if it outranks them,
and is shed otherwise; a displaced or timed-out waiter gets a 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from kvflow.errors import RateLimitError

W = TypeVar("W", bound=Hashable)
Clock = Callable[[], float]


class Decision(Enum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    SHED = "shed"


@dataclass(frozen=True, slots=True)
class Admission(Generic[W]):
    decision: Decision
    displaced: W | None = None
    """A waiter pushed out of a full queue by this newcomer; the caller sheds it."""


@dataclass
class AdmissionQueue(Generic[W]):
    """At most ``max_inflight`` admitted requests and ``max_queue`` waiting ones (None: unlimited).

    Fair between clients: among waiters of one priority, the one whose client had fewer requests
    in flight or waiting when it arrived goes first (then first come, first served), so one client
    with a deep backlog cannot starve the others. ``max_per_client`` caps the slots one client
    holds at once. Without a ``client`` every waiter is its own: plain priority + FIFO.
    """

    max_inflight: int | None
    max_queue: int
    max_per_client: int | None = None
    inflight: int = 0
    _heap: list[tuple[int, int, int, W, Hashable]] = field(default_factory=list)
    _gone: set[W] = field(default_factory=set)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _active: dict[Hashable, int] = field(default_factory=dict)
    """Per client: requests in flight or waiting."""
    _running: dict[Hashable, int] = field(default_factory=dict)
    """Per client: requests in flight."""

    @property
    def waiting(self) -> int:
        return len(self._heap) - len(self._gone)

    def admit(self, priority: int, waiter: W, client: Hashable = None) -> Admission[W]:
        # Invariant: while a slot is free, every live waiter's client is at its own cap.
        if not self._capped(client) and (self.max_inflight is None or self.inflight < self.max_inflight):
            self.inflight += 1
            self._add(self._running, client, 1)
            self._add(self._active, client, 1)
            return Admission(Decision.ADMITTED)
        displaced = None
        if self.waiting >= self.max_queue:
            displaced = self._lowest_below(priority)
            if displaced is None:
                return Admission(Decision.SHED)
            self.cancel(displaced)
        tag = self._active.get(client, 0) if client is not None else 0
        heapq.heappush(self._heap, (-priority, tag, next(self._seq), waiter, client))
        self._add(self._active, client, 1)
        return Admission(Decision.QUEUED, displaced)

    def release(self, client: Hashable = None) -> W | None:
        """A request finished: the waiter that now takes its slot, if any (already counted in)."""
        self.inflight -= 1
        self._add(self._running, client, -1)
        self._add(self._active, client, -1)
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            return None
        skipped = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            waiter, owner = entry[3], entry[4]
            if waiter in self._gone:
                self._gone.discard(waiter)
                continue
            if self._capped(owner):
                skipped.append(entry)
                continue
            self.inflight += 1
            self._add(self._running, owner, 1)
            chosen = waiter
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return chosen

    def cancel(self, waiter: W) -> None:
        """Forget a waiter that left (timeout, disconnect, displaced); removed lazily."""
        if waiter in self._gone:
            return
        for entry in self._heap:
            if entry[3] == waiter:
                self._gone.add(waiter)
                self._add(self._active, entry[4], -1)
                return

    def _capped(self, client: Hashable) -> bool:
        return (client is not None and self.max_per_client is not None
                and self._running.get(client, 0) >= self.max_per_client)

    @staticmethod
    def _add(counts: dict[Hashable, int], client: Hashable, delta: int) -> None:
        if client is None:
            return
        n = counts.get(client, 0) + delta
        if n > 0:
            counts[client] = n
        else:
            counts.pop(client, None)

    def _lowest_below(self, priority: int) -> W | None:
        live = [entry for entry in self._heap if entry[3] not in self._gone]
        if not live:
            return None
        neg_priority, _, _, waiter, _ = max(live, key=lambda e: (e[0], e[1], e[2]))
        return waiter if -neg_priority < priority else None


class TokenBucket:
    """``rate`` tokens a second, up to ``burst`` saved; a request takes one."""

    __slots__ = ("rate", "burst", "_tokens", "_last")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens, self._last = float(burst), now

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate


@dataclass(frozen=True, slots=True)
class Rate:
    rate: float
    burst: int = 1


class RateLimiter:
    """One bucket per API key name, made on first use from the key's own rate or the default."""

    def __init__(self, rates: Mapping[str, Rate], default: Rate | None, clock: Clock = time.monotonic) -> None:
        self._rates, self._default, self._clock = dict(rates), default, clock
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, key_name: str) -> None:
        bucket = self._buckets.get(key_name)
        if bucket is None:
            rate = self._rates.get(key_name, self._default)
            if rate is None:
                return
            bucket = self._buckets[key_name] = TokenBucket(rate.rate, rate.burst, self._clock())
        wait = bucket.take(self._clock())
        if wait:
            raise RateLimitError(f"rate limit exceeded for key {key_name!r}", retry_after=wait)


class Gate:
    """The asyncio side of one model's AdmissionQueue."""

    def __init__(self, max_inflight: int | None, max_queue: int, queue_timeout: float,
                 max_per_client: int | None = None) -> None:
        self.queue: AdmissionQueue[asyncio.Future[None]] = AdmissionQueue(max_inflight, max_queue, max_per_client)
        self.queue_timeout = queue_timeout
        self.unlimited = max_inflight is None and max_per_client is None
        self._owners: dict[asyncio.Future[None], Hashable] = {}
        """The client of each waiting future."""

    async def acquire(self, priority: int, client: Hashable = None) -> None:
        """A slot for ``client`` (an API key's name or an address), or RateLimitError."""
        if self.unlimited:  # the common case costs one increment
            self.queue.inflight += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        admission = self.queue.admit(priority, future, client)
        if admission.displaced is not None:
            admission.displaced.set_exception(_shed("displaced by a higher-priority request"))
        if admission.decision is Decision.ADMITTED:
            return
        if admission.decision is Decision.SHED:
            raise _shed("the queue for this model is full")
        self._owners[future] = client
        try:
            await self._wait(future, client)
        finally:
            self._owners.pop(future, None)

    async def _wait(self, future: asyncio.Future[None], client: Hashable) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(future), self.queue_timeout)
        except TimeoutError:
            self._leave(future, client)
            raise _shed(f"waited {self.queue_timeout:g}s in the queue") from None
        except asyncio.CancelledError:
            self._leave(future, client)
            raise

    def _leave(self, future: asyncio.Future[None], client: Hashable) -> None:
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(client)  # admitted just as we gave up: hand the slot on
        else:
            self.queue.cancel(future)
            future.cancel()

    def release(self, client: Hashable = None) -> None:
        if self.unlimited:
            self.queue.inflight -= 1
            return
        while (waiter := self.queue.release(client)) is not None:
            if not waiter.done():
                waiter.set_result(None)
                return
            # a waiter that already left holds no slot: pass it on to the next one. Its client's
            # in-flight count was raised when it was chosen: lower it again.
            client = self._owners.pop(waiter, None)


def _shed(why: str) -> RateLimitError:
    return RateLimitError(f"too many requests: {why}; retry later", retry_after=1.0)


# --- the batch band: capacity that interactive traffic leaves ------------------------------
#
# Batch lines (the Batch API) do not queue in ``Gate``: they are sent only while ``batch_room``
# says the pool has room for them, which it decides from what the gateway and the router
# already know: the gate's interactive in-flight and waiting counts, and per pod the router's
# health view and the engine's scraped queue and KV-cache use (docs/batch.md).


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One pod as the batch band sees it: its last scrape, the router's live in-flight count, and
    the batch cap learnt from its scrapes (``next_cap``)."""

    waiting: int
    """Requests queued in the engine (scraped ``vllm:num_requests_waiting``)."""
    kv_usage: float
    """Fraction of the engine's KV cache in use (scraped)."""
    in_flight: int = 0
    """Requests this gateway has sent there and not yet seen finish (live)."""
    cap: int = 0
    """How many requests the pod is given while no interactive request is around."""
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class BandLimits:
    per_pod: int = 128
    """Most requests in flight per pod while no interactive request is around."""
    first_cap: int = 32
    """A pod's cap before its scrapes have said how much it runs."""
    idle_waiting: int = 4
    """While no interactive request is around, the queue a pod is given on top of what its engine
    runs: a line is ready whenever a sequence finishes."""
    busy_per_pod: int = 2
    """Batch lines in flight per pod while interactive requests are around."""
    max_waiting: int = 0
    """While interactive traffic is around, a pod with more requests queued in its engine is full."""
    max_kv_usage: float = 0.85
    """A pod whose KV cache is fuller than this is full (new lines would cause preemptions)."""
    quiet_s: float = 1.0
    """Interactive traffic counts as around for this long after it was last seen."""


def next_cap(cap: int, running: int, waiting: int, limits: BandLimits) -> int:
    """A pod's cap after a new scrape of its engine (pure).

    An engine that queues more than ``idle_waiting`` is full: its cap becomes what it runs plus
    that short queue. One that runs at least half its cap and queues nothing can take more: the
    cap doubles (slow start), up to ``per_pod``. Scrapes come every few hundred milliseconds, so
    the cap follows the engine's capacity while the live in-flight count does the fine control.
    """
    if waiting > limits.idle_waiting:
        return max(1, min(limits.per_pod, running + limits.idle_waiting))
    if waiting == 0 and running * 2 >= cap:
        return min(limits.per_pod, cap * 2)
    return cap


def batch_room(pods: Sequence[PodLoad], batch_inflight: int, limits: BandLimits, *, interactive: bool,
               interactive_waiting: int) -> int:
    """How many more batch lines may start now on a pool (pure).

    ``batch_inflight``: the pool's batch lines already sent; ``interactive``: interactive traffic
    is around; ``interactive_waiting``: interactive requests queued in the gateway's gate.
    No interactive traffic: each pod is filled to its cap (what its engine runs plus a short
    queue), so continuous batching stays full without a long queue that an interactive request
    arriving next would wait behind. Interactive traffic around: the pool keeps ``busy_per_pod``
    lines per pod whose engine queues nothing. A pod that is unhealthy or whose KV cache is
    nearly full gets nothing.
    """
    if interactive_waiting:  # interactive requests queue in the gateway: nothing is left over
        return 0
    usable = [p for p in pods if p.healthy and p.kv_usage <= limits.max_kv_usage]
    if interactive:
        open_pods = sum(1 for p in usable if p.waiting <= limits.max_waiting)
        return max(0, limits.busy_per_pod * open_pods - batch_inflight)
    return sum(max(0, p.cap - p.in_flight) for p in usable)


class InteractiveWatch:
    """Whether interactive traffic is around: seen in flight within the last ``quiet_s`` seconds."""

    __slots__ = ("quiet_s", "_last")

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._last = float("-inf")

    def around(self, inflight: int, now: float) -> bool:
        if inflight > 0:
            self._last = now
        return now - self._last < self.quiet_s
