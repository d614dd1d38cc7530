"""Each pod's ``LoadCounter``, also kept column by column so a decision reads every pod's at once.

A ``LoadCounter`` is the router's own, live accounting of what it sent to one pod. ``Flight``
moves one pod's counter a few times per request; every scheduling cycle reads the counters of
every candidate pod. A thousand pods read one attribute at a time cost milliseconds in Python,
so every counter's numbers are also kept in one process-wide table (``LoadTable``): a row per
counter, a column per field. A counter is a plain slotted object whose writes go to the table
too (``LoadCounter.__setattr__``: a write costs ~0.3 us more, a read nothing); a scorer takes its
candidates' rows in one numpy index (``Loads``) and computes each term on a whole column, for
every pod at once. The table is stored field-major (``matrix[FIELDS[name], counter.row]``) so
that a column is contiguous.

A counter holds its row for as long as it lives (a request still in flight on a pod that has
left the pool keeps writing to its own row), and gives it back when it is collected.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.protocol.vllm_metrics import EngineMetrics
from kvflow.router.per_list import PerList
from kvflow.router.working_set import WorkingSet

if TYPE_CHECKING:
    from kvflow.router.model import EndpointView

DEFAULT_PREFILL_RATE = 20_000.0
"""Prompt tokens per second a pod prefills until its own first tokens tell the router better."""


class LoadTable:
    """Every live counter's numbers: ``matrix[FIELDS[name], counter.row]`` (float64: the integer
    fields stay exact below 2**53), grown by doubling. A row handed out is reset to the defaults."""

    def __init__(self, defaults: Sequence[float], size: int = 64) -> None:
        self.size = 0
        self._defaults = np.array(defaults, np.float64)
        self.matrix = np.zeros((len(defaults), 0))
        self._free: list[int] = []
        self._lock = threading.Lock()  # counters are made on the event loop, but collected anywhere
        self._grow(size)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                self._grow(2 * self.size)
            row = self._free.pop()
            self.matrix[:, row] = self._defaults
        return row

    def release(self, row: int) -> None:
        with self._lock:
            self._free.append(row)

    def _grow(self, size: int) -> None:
        old = self.size
        matrix = np.repeat(self._defaults[:, None], size, axis=1)
        matrix[:, :old] = self.matrix
        self.matrix = matrix
        self._free.extend(range(size - 1, old - 1, -1))  # the lowest first
        self.size = size


@dataclass(slots=True, eq=False)
class LoadCounter:
    """The router's own, live accounting of what it sent to one pod.

    Exact for this router's requests and current to the request, where scraped metrics are a
    snapshot of every router's requests up to a few hundred milliseconds old. The ``*_at_scrape``
    fields remember this router's share when the metrics were taken, so a view can tell its own
    load from other replicas' (``EndpointView.foreign_*``) and add what changed since.

    The pod's prefill queue is modelled as first-in first-out work (uncached prompt tokens) that
    drains at the pod's prefill rate, and is cut short by what is known to be done: a request
    that produced its first token (or finished) proves everything sent before it was prefilled.
    """

    row: int = field(init=False, repr=False, default_factory=lambda: _allocate())
    """The counter's row in ``TABLE``, where every number below is written too."""
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

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        column = FIELDS.get(name)
        if column is not None:
            TABLE.matrix[column, self.row] = value

    def __del__(self) -> None:
        try:
            TABLE.release(self.row)
        except AttributeError:  # its __init__ failed before the row was taken
            pass

    def __reduce__(self) -> Any:
        # a copy would share the row, and both would give it back: a counter is live state
        raise TypeError("a LoadCounter cannot be copied or pickled; make a new one")

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
        if capacity != self.kv_capacity:
            self.working_set.fit(capacity)
        self.kv_capacity = capacity
        self.kv_per_token = 1.0 / capacity if capacity > 0 else 0.0
        self.kv_base = metrics.kv_usage - self.tokens_at_scrape * self.kv_per_token
        self._room()

    def touched(self, fingerprints: np.ndarray, now: float) -> None:
        """A request sent here at ``now`` reads or stores these prompt blocks."""
        self.working_set.touch(fingerprints, now)
        self._room()

    def _room(self) -> None:
        capacity = self.kv_capacity
        self.room = capacity - self.working_set.tokens if capacity > 0 else math.inf


_NUMBERS = [f for f in fields(LoadCounter) if f.type in ("int", "float") and f.name != "row"]
FIELDS: dict[str, int] = {f.name: i for i, f in enumerate(_NUMBERS)}
"""Each number's place in the table (``LoadTable.matrix``'s first index)."""
TABLE: LoadTable = LoadTable([f.default for f in _NUMBERS])  # type: ignore[misc]


def _allocate() -> int:
    return TABLE.allocate()


_rows = PerList(lambda endpoints: [ep.counter.row for ep in endpoints])
"""The table rows of a list of views (most cycles read the pool's list, until a scrape changes it)."""

VECTOR_MIN = 32
"""From this many candidates on, plugins compute on ``Loads`` columns; below it, pod by pod:
a numpy operation's fixed cost (~1 us) is more than a few pods' plain Python."""


class Loads:
    """The counters of a cycle's candidate endpoints, a column at a time, in their order.

    ``loads.backlog[i]`` is ``endpoints[i].counter.backlog``, as of when the loads were read (a
    cycle is synchronous: no counter moves while it runs). A formula written for a counter's
    fields computes the same on a ``Loads``, for every pod at once."""

    __slots__ = ("endpoints", "values")

    def __init__(self, endpoints: Sequence[EndpointView], values: np.ndarray | None = None) -> None:
        self.endpoints = endpoints
        self.values = values if values is not None else TABLE.matrix.take(_rows(endpoints), 1)
        """``values[FIELDS[name], i]``: ``endpoints[i]``'s field."""

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.values[FIELDS[name]]
        except KeyError:
            raise AttributeError(f"a counter has no field {name!r}") from None

    def __len__(self) -> int:
        return len(self.endpoints)

    def subset(self, keep: np.ndarray, endpoints: Sequence[EndpointView]) -> Loads:
        """The loads of ``endpoints``: those of these kept by the boolean mask ``keep``."""
        return Loads(endpoints, self.values[:, keep])
