"""The live set of endpoints and their freshest state; ``snapshot()`` freezes it for a cycle.

Writers are the async collectors (metrics scraper, Kubernetes watch) and the router's own
accounting (requests started/finished, endpoints the gateway saw fail). All run on one event
loop, so plain attributes suffice. A pod's view is rebuilt only when what was scraped about it
changed (metrics, health), and the snapshot tuple only when a view did; requests starting and
finishing just bump the pod's ``LoadCounter``, which its view reads live. Every pod's load numbers
are rows of the datastore's ``LoadBoard`` (``loads``), which scheduling cycles read as columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvflow.router.load import LoadBoard
from kvflow.router.model import DEFAULT_PREFILL_RATE, EndpointView, EngineMetrics, LoadCounter
from kvflow.router.working_set import DEFAULT_WINDOW, WorkingSet
from kvflow.endpoints import Endpoint, EndpointId, Role


@dataclass(slots=True)
class _State:
    endpoint: Endpoint
    metrics: EngineMetrics
    scrape_ok: bool = True
    """Optimistic until the first failure: an unscraped pool still routes."""
    marked_failed: bool = False
    ejected: bool = False
    """Out of rotation for failing requests (passive health, ``router/outliers.py``)."""
    last_ok: float | None = None
    counter: LoadCounter = field(default_factory=LoadCounter)
    view: EndpointView | None = None
    """The pod's view, built when first read after a change."""
    adapters: frozenset[str] | None = None
    """LoRA adapters loaded on the pod (its ``/v1/models``); None until learned."""

    def changed(self) -> None:
        self.view = None

    def current(self) -> EndpointView:
        if self.view is None:
            self.view = EndpointView(
                self.endpoint, self.metrics, self.scrape_ok and not self.marked_failed and not self.ejected,
                counter=self.counter,
                adapters=self.adapters,
            )
        return self.view


Listener = Callable[[Endpoint, bool], None]
"""Called with (endpoint, added) when the set changes."""


class Datastore:
    def __init__(
        self, endpoints: Iterable[Endpoint] = (), *, prefill_rate: float = DEFAULT_PREFILL_RATE,
        block_size: int = 16, working_set_window: float = DEFAULT_WINDOW,
    ) -> None:
        self.prefill_rate = prefill_rate
        """A new pod's prefill rate (tokens/s) until the router observes its own."""
        self.block_size = block_size
        self.working_set_window = working_set_window
        self.loads = LoadBoard()
        """Every pod's load numbers, a row each (their ``LoadCounter`` writes them)."""
        self._states: dict[EndpointId, _State] = {}
        self._snapshot: tuple[EndpointView, ...] | None = None
        self._by_role: tuple[list[EndpointView], list[EndpointView]] | None = None
        self._listeners: list[Listener] = []
        self._adapters: frozenset[str] | None = None
        self.set_endpoints(endpoints)

    # -- the set ---------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(s.endpoint for s in self._states.values())

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        state = self._states.get(endpoint_id)
        return state.endpoint if state else None

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = {ep.id: ep for ep in endpoints}
        for eid in [eid for eid in self._states if eid not in wanted]:
            gone = self._states.pop(eid)
            self.loads.detach(gone.counter)  # requests still in flight there count on its own
            self._notify(gone.endpoint, False)
        for eid, ep in wanted.items():
            state = self._states.get(eid)
            if state is None:
                counter = LoadCounter(board=self.loads, default_rate=self.prefill_rate,
                                      working_set=WorkingSet(self.block_size, self.working_set_window))
                self._states[eid] = _State(ep, EngineMetrics(), counter=counter)
                self._notify(ep, True)
            elif state.endpoint != ep:
                state.endpoint = ep  # role or models changed: same pod, same cache
                state.changed()
        self._invalidate()

    def _invalidate(self) -> None:
        self._snapshot = None
        self._by_role = None
        self._adapters = None

    def _notify(self, endpoint: Endpoint, added: bool) -> None:
        for listener in self._listeners:
            listener(endpoint, added)

    # -- collectors ------------------------------------------------------------------------

    def record_scrape(self, endpoint_id: EndpointId, metrics: EngineMetrics, now: float) -> None:
        state = self._states.get(endpoint_id)
        if state is None:
            return
        state.last_ok = now
        state.counter.scraped(metrics, now)  # the metrics now include what was sent before
        if state.metrics == metrics and state.scrape_ok and not state.marked_failed:
            return  # nothing the scorers read changed: keep the view (and the snapshot)
        state.metrics = metrics
        state.scrape_ok = True
        state.marked_failed = False
        state.changed()
        self._invalidate()

    def record_adapters(self, endpoint_id: EndpointId, adapters: frozenset[str]) -> None:
        """The LoRA adapters the pod lists as loaded now (``/v1/models``)."""
        state = self._states.get(endpoint_id)
        if state is not None and state.adapters != adapters:
            state.adapters = adapters
            state.changed()
            self._invalidate()

    def adapters(self) -> frozenset[str]:
        """Every adapter some pod has loaded: requests naming one are LoRA requests."""
        if self._adapters is None:
            self._adapters = frozenset().union(*(s.adapters for s in self._states.values() if s.adapters))
        return self._adapters

    def record_failure(self, endpoint_id: EndpointId) -> None:
        state = self._states.get(endpoint_id)
        if state is not None and state.scrape_ok:
            state.scrape_ok = False
            state.changed()
            self._invalidate()

    def mark_failed(self, endpoint_id: EndpointId) -> None:
        state = self._states.get(endpoint_id)
        if state is not None and not state.marked_failed:
            state.marked_failed = True
            state.changed()
            self._invalidate()

    def set_ejected(self, endpoint_id: EndpointId, ejected: bool) -> None:
        """Take the pod out of rotation for its failing requests, or put it back (scrapes do not)."""
        state = self._states.get(endpoint_id)
        if state is not None and state.ejected != ejected:
            state.ejected = ejected
            state.changed()
            self._invalidate()

    # -- request accounting ----------------------------------------------------------------

    def counter(self, endpoint_id: EndpointId) -> LoadCounter | None:
        """The pod's live load counter, which ``kvflow.router.flight`` moves; None if it left."""
        state = self._states.get(endpoint_id)
        return state.counter if state is not None else None

    def started(self, endpoint_id: EndpointId) -> None:
        """One request sent there, with no token accounting (tests, simple callers)."""
        counter = self.counter(endpoint_id)
        if counter is not None:
            counter.in_flight += 1
            counter.dispatched += 1

    def finished(self, endpoint_id: EndpointId) -> None:
        counter = self.counter(endpoint_id)
        if counter is not None and counter.in_flight > 0:
            counter.in_flight -= 1
            if counter.dispatched > 0:
                counter.dispatched -= 1

    # -- readers ---------------------------------------------------------------------------

    def snapshot(self) -> tuple[EndpointView, ...]:
        if self._snapshot is None:
            self._snapshot = tuple(s.current() for s in self._states.values())
        return self._snapshot

    def by_role(self) -> tuple[list[EndpointView], list[EndpointView]]:
        """The snapshot split into (pods that can decode, prefill-only pods), kept with it."""
        if self._by_role is None:
            snapshot = self.snapshot()
            self._by_role = (
                [v for v in snapshot if v.endpoint.role is not Role.PREFILL],
                [v for v in snapshot if v.endpoint.role is Role.PREFILL],
            )
        return self._by_role

    def last_scrape(self, endpoint_id: EndpointId) -> float | None:
        """When the pod's /metrics last answered (``time.monotonic()``), None if never."""
        state = self._states.get(endpoint_id)
        return state.last_ok if state else None

    def view(self, endpoint_id: EndpointId) -> EndpointView | None:
        state = self._states.get(endpoint_id)
        return state.current() if state else None
