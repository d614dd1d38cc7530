"""Each pod's load, as the router accounts for it: one row of numbers per pod in the pool's
``LoadBoard``, which the datastore owns.

``Flight`` moves one pod's numbers a few times per request; every scheduling cycle reads the
numbers of every candidate pod. A thousand pods read one attribute at a time cost milliseconds
in Python, so the numbers live in one flat array, a row of ``WIDTH`` floats per pod
(``values[base + FIELDS[name]]``, the integer fields exact below 2**53): a cycle takes its
candidates' rows in one numpy index (``LoadBoard.columns``) and computes each term on a whole
column, for every pod at once, and a cycle over a few pods copies each one's row
(``LoadCounter.numbers``). Both read as ``Loads``, one named tuple of the numbers: floats for one
pod, numpy columns for many, so a formula is written once for either.

A ``LoadCounter`` is the handle that writes a pod's row: its numbers are typed attributes of the
row it points at (``counter.in_flight`` reads ``counter.board.values[counter.base + FIELDS["in_flight"]]``),
beside the pod's working set. Plugins read numbers, never counters: the cycle hands them the
datastore's board (``Cycle.board``, ``Cycle.loads``, ``Cycle.numbers``). A pod that leaves the pool hands its row back (``LoadBoard.detach``); its
counter keeps its numbers on a board of its own, so a request still in flight there goes on
counting without touching the row's next owner.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import numpy as np

from kvflow.protocol.vllm_metrics import EngineMetrics
from kvflow.router.per_list import PerList
from kvflow.router.working_set import WorkingSet

if TYPE_CHECKING:
    from kvflow.router.model import EndpointView

DEFAULT_PREFILL_RATE = 20_000.0
"""Prompt tokens per second a pod prefills until its own first tokens tell the router better."""

N = TypeVar("N", float, np.ndarray)


class Loads(NamedTuple, Generic[N]):
    """A pod's load numbers (``N``: float), or the candidates' (``N``: a numpy column each, in
    the candidates' order). The fields are a board row's, in its order."""

    #: Requests the router sent there that have not finished.
    in_flight: N
    #: Of those, requests not yet known to have produced a first token.
    prefilling: N
    #: KV the requests in flight added there (prompt tokens not already cached), as far as the router
    #: knows.
    tokens: N
    #: Requests sent there since the metrics were scraped: load the metrics cannot show yet.
    dispatched: N
    in_flight_at_scrape: N
    prefilling_at_scrape: N
    tokens_at_scrape: N
    #: Prefill work (tokens) queued at time ``backlog_at``, before draining.
    backlog: N
    backlog_at: N
    #: Cumulative uncached prompt tokens sent: each request's position in the pod's queue.
    sent_work: N
    #: The queue position up to which prefill is known to be done.
    done_work: N
    sent_requests: N
    #: Observed seconds per token of prefill work (EWMA over first tokens); 0: not yet seen.
    seconds_per_token: N
    default_rate: N
    #: Waiting requests that are not this router's (other replicas'), as of the last scrape.
    foreign_waiting: N
    #: Running requests that are not this router's, as of the last scrape.
    foreign_running: N
    #: ``kv_usage`` is ``kv_base + tokens * kv_per_token``: the scraped usage, moved by the KV sent since.
    kv_base: N
    kv_per_token: N
    #: Tokens the pod's KV cache holds, as it reports (``num_gpu_blocks`` x block size); 0: unknown.
    kv_capacity: N
    #: KV tokens the pod can store without evicting any in use: its capacity less its working set (inf
    #: while it has not reported its capacity).
    room: N


FIELDS: dict[str, int] = {name: i for i, name in enumerate(Loads._fields)}
"""Each number's place in a row."""
WIDTH = len(FIELDS)
_DEFAULTS: dict[str, float] = dict.fromkeys(FIELDS, 0.0) | {"default_rate": DEFAULT_PREFILL_RATE, "room": math.inf}
_DEFAULT_ROW = array("d", _DEFAULTS.values())
_ROW = struct.Struct(f"{WIDTH}d")
"""A row as it lies in ``LoadBoard.values`` (native doubles): read in one C call, without the
array a slice would copy it into first."""
_ITEMSIZE = _DEFAULT_ROW.itemsize
_BACKLOG, _BACKLOG_AT, _SENT_WORK, _DONE_WORK, _SENT_REQUESTS, _SECONDS_PER_TOKEN, _DEFAULT_RATE = (
    FIELDS[name] for name in ("backlog", "backlog_at", "sent_work", "done_work", "sent_requests",
                              "seconds_per_token", "default_rate"))


class LoadBoard:
    """Every pod's load numbers, a row of ``WIDTH`` floats per pod, in one flat array grown by
    doubling; a row handed out starts from the defaults. One per datastore (a stand-alone
    counter has one of its own)."""

    __slots__ = ("values", "_free", "_bases")

    def __init__(self, rows: int = 64) -> None:
        self.values = array("d")
        """``values[base + FIELDS[name]]``: the number ``name`` of the pod whose row starts at ``base``."""
        self._free: list[int] = []
        """Free rows' bases, the lowest last."""
        self._bases = PerList(self._bases_of)
        """The row bases of a list of views (most cycles read the pool's list, until a scrape changes it)."""
        self._grow(rows)

    @property
    def size(self) -> int:
        """Rows, taken or free."""
        return len(self.values) // WIDTH

    def allocate(self) -> int:
        """A free row, reset to the defaults: its base (the index of its first number)."""
        if not self._free:
            self._grow(2 * self.size)
        base = self._free.pop()
        self.values[base: base + WIDTH] = _DEFAULT_ROW
        return base

    def detach(self, counter: LoadCounter) -> None:
        """``counter``'s pod left: its numbers move to a board of their own and its row is free."""
        if counter.board is not self:
            return
        own = LoadBoard(1)
        base = own.allocate()
        own.values[base: base + WIDTH] = self.values[counter.base: counter.base + WIDTH]
        self._free.append(counter.base)
        counter.board, counter.base = own, base

    def columns(self, endpoints: Sequence[EndpointView]) -> CandidateLoads:
        """The numbers of ``endpoints``' counters, a column each, in their order (counters on
        other boards, as stand-alone views have, are read one by one)."""
        bases = self._bases(endpoints)
        if bases is not None:
            matrix = np.frombuffer(self.values).reshape(-1, WIDTH).take(bases // WIDTH, axis=0).T
        else:
            matrix = np.array([ep.counter.numbers() for ep in endpoints], np.float64).reshape(-1, WIDTH).T
        return CandidateLoads(endpoints, matrix)

    def _bases_of(self, endpoints: Sequence[EndpointView]) -> np.ndarray | None:
        if any(ep.counter.board is not self for ep in endpoints):
            return None
        return np.array([ep.counter.base for ep in endpoints], np.intp)

    def _grow(self, rows: int) -> None:
        old = self.size
        # a new array, not the old one extended: a numpy view of the old may still be alive
        self.values = self.values + _DEFAULT_ROW * (rows - old)
        self._free.extend(range((rows - 1) * WIDTH, old * WIDTH - 1, -WIDTH))


@dataclass(frozen=True, slots=True, eq=False)
class CandidateLoads:
    """A cycle's candidates and their numbers, a column each (``matrix[FIELDS[name], i]`` is
    ``endpoints[i]``'s), as of when they were read (a cycle is synchronous: nothing moves them
    while it runs)."""

    endpoints: Sequence[EndpointView]
    matrix: np.ndarray

    @property
    def columns(self) -> Loads[np.ndarray]:
        return Loads._make(self.matrix)

    def __len__(self) -> int:
        return len(self.endpoints)

    def subset(self, keep: np.ndarray, endpoints: Sequence[EndpointView]) -> CandidateLoads:
        """The loads of ``endpoints``: those of these kept by the boolean mask ``keep``."""
        return CandidateLoads(endpoints, self.matrix[:, keep])


class _Float:
    """A ``LoadCounter`` attribute that is one number of its row, read and written there."""

    __slots__ = ("offset",)

    def __init__(self, name: str) -> None:
        self.offset = FIELDS[name]

    def __get__(self, counter: LoadCounter, owner: type[LoadCounter] | None = None) -> float:
        return counter.board.values[counter.base + self.offset]

    def __set__(self, counter: LoadCounter, value: float) -> None:
        counter.board.values[counter.base + self.offset] = value


class _Int:
    """A whole number of a ``LoadCounter``'s row (stored as a float: exact below 2**53)."""

    __slots__ = ("offset",)

    def __init__(self, name: str) -> None:
        self.offset = FIELDS[name]

    def __get__(self, counter: LoadCounter, owner: type[LoadCounter] | None = None) -> int:
        return int(counter.board.values[counter.base + self.offset])

    def __set__(self, counter: LoadCounter, value: int) -> None:
        counter.board.values[counter.base + self.offset] = value


class LoadCounter:
    """The router's own, live accounting of what it sent to one pod: its row of a ``LoadBoard``
    (each number is documented on ``Loads``) and its working set.

    Exact for this router's requests and current to the request, where scraped metrics are a
    snapshot of every router's requests up to a few hundred milliseconds old. The ``*_at_scrape``
    fields remember this router's share when the metrics were taken, so a view can tell its own
    load from other replicas' (``EndpointView.foreign_*``) and add what changed since.

    The pod's prefill queue is modelled as first-in first-out work (uncached prompt tokens) that
    drains at the pod's prefill rate, and is cut short by what is known to be done: a request
    that produced its first token (or finished) proves everything sent before it was prefilled.
    """

    __slots__ = ("board", "base", "working_set")

    in_flight = _Int("in_flight")
    prefilling = _Int("prefilling")
    tokens = _Int("tokens")
    dispatched = _Int("dispatched")
    in_flight_at_scrape = _Int("in_flight_at_scrape")
    prefilling_at_scrape = _Int("prefilling_at_scrape")
    tokens_at_scrape = _Int("tokens_at_scrape")
    backlog = _Float("backlog")
    backlog_at = _Float("backlog_at")
    sent_work = _Int("sent_work")
    done_work = _Int("done_work")
    sent_requests = _Int("sent_requests")
    seconds_per_token = _Float("seconds_per_token")
    default_rate = _Float("default_rate")
    foreign_waiting = _Int("foreign_waiting")
    foreign_running = _Int("foreign_running")
    kv_base = _Float("kv_base")
    kv_per_token = _Float("kv_per_token")
    kv_capacity = _Int("kv_capacity")
    room = _Float("room")

    def __init__(self, in_flight: int = 0, *, board: LoadBoard | None = None,
                 working_set: WorkingSet | None = None, **numbers: float) -> None:
        """A new row on ``board`` (None: a board of the counter's own), at the defaults but for
        ``in_flight`` and ``numbers`` (by ``Loads`` field name)."""
        unknown = numbers.keys() - FIELDS.keys()
        if unknown:
            raise TypeError(f"a load counter has no field {', '.join(map(repr, sorted(unknown)))}")
        self.board = board if board is not None else LoadBoard(1)
        self.base = self.board.allocate()
        """Where the counter's row starts in ``board.values``."""
        self.working_set = working_set if working_set is not None else WorkingSet()
        """The distinct prompt tokens the requests sent here touched lately: the cache in use."""
        values, base = self.board.values, self.base
        values[base + FIELDS["in_flight"]] = in_flight
        for name, value in numbers.items():
            values[base + FIELDS[name]] = value

    def numbers(self) -> Loads[float]:
        """The pod's numbers as of now (a copy)."""
        return Loads._make(_ROW.unpack_from(self.board.values, self.base * _ITEMSIZE))

    def __repr__(self) -> str:
        return f"LoadCounter({', '.join(f'{k}={v!r}' for k, v in self.numbers()._asdict().items())})"

    @property
    def rate(self) -> float:
        """Prefill work the pod gets through per second."""
        spt = self.seconds_per_token
        return 1.0 / spt if spt > 0 else self.default_rate

    # The queue's methods run a few times per request: they read and write the row directly.

    def queued(self, now: float) -> float:
        """Prefill work still ahead of a request sent at ``now``."""
        v, b = self.board.values, self.base
        spt = v[b + _SECONDS_PER_TOKEN]
        rate = 1.0 / spt if spt > 0 else v[b + _DEFAULT_RATE]
        drained = v[b + _BACKLOG] - (now - v[b + _BACKLOG_AT]) * rate
        known = v[b + _SENT_WORK] - v[b + _DONE_WORK]
        return max(0.0, min(drained, known))

    def enqueue(self, work: int, now: float) -> tuple[float, int]:
        """A request with ``work`` tokens to prefill joins the queue: (work ahead of it, its position)."""
        ahead = self.queued(now)
        v, b = self.board.values, self.base
        v[b + _BACKLOG], v[b + _BACKLOG_AT] = ahead + work, now
        position = int(v[b + _SENT_WORK]) + work
        v[b + _SENT_WORK] = position
        v[b + _SENT_REQUESTS] += 1
        return ahead, position

    def dequeue(self, work: int, now: float) -> None:
        """A request sent with ``work`` failed before computing anything: take its work back out."""
        ahead = self.queued(now)
        v, b = self.board.values, self.base
        v[b + _BACKLOG], v[b + _BACKLOG_AT] = max(0.0, ahead - work), now

    def prefilled(self, position: int) -> None:
        """The request at ``position`` has its first token: everything up to it is done."""
        v, at = self.board.values, self.base + _DONE_WORK
        if position > v[at]:
            v[at] = position

    @property
    def mean_work(self) -> float:
        """Mean prefill work of the requests sent here (0 before the first)."""
        sent = self.sent_requests
        return self.sent_work / sent if sent else 0.0

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
        foreign_waiting = max(0, metrics.waiting - self.prefilling_at_scrape)
        self.foreign_waiting = foreign_waiting
        self.foreign_running = max(
            0, metrics.running + metrics.waiting - self.in_flight_at_scrape - foreign_waiting
        )
        capacity = (metrics.num_blocks or 0) * (metrics.block_size or 0)
        if capacity != self.kv_capacity:
            self.working_set.fit(capacity)
        self.kv_capacity = capacity
        per_token = 1.0 / capacity if capacity > 0 else 0.0
        self.kv_per_token = per_token
        self.kv_base = metrics.kv_usage - self.tokens_at_scrape * per_token
        self._room()

    def touched(self, fingerprints: np.ndarray, now: float) -> None:
        """A request sent here at ``now`` reads or stores these prompt blocks."""
        self.working_set.touch(fingerprints, now)
        self._room()

    def _room(self) -> None:
        capacity = self.kv_capacity
        self.room = capacity - self.working_set.tokens if capacity > 0 else math.inf


VECTOR_MIN = 32
"""From this many candidates on, plugins compute on ``CandidateLoads`` columns; below it, on each
pod's numbers: a numpy operation's fixed cost (~1 us) is more than a few pods' plain Python."""
