"""``Router``: one model pool's scheduler, the object the gateway and the ext_proc server call.

One call per request: ``await router.route(Incoming(body, headers, request_id, size))`` returns
the ``Flight`` that accounts for it, its decision in ``flight.result``. ``route`` tokenizes the
prompt and fingerprints a long one off the event loop, then calls ``decide``, the synchronous
core (a decision over the pool's snapshot), which callers that already hold a
``SchedulingRequest`` (benchmarks, replays) call themselves. What a decision read (the prompt's
fingerprints, each pod's cached prefix) goes into the ``Flight`` it returns, not into a table
keyed by request id. Asynchronous at the edges: ``start`` runs the metrics scraper and the
KV-event subscribers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from time import monotonic, perf_counter
from typing import Any
from zlib import crc32

import numpy as np

from kvflow.errors import InvalidRequestError, KvflowError, RateLimitError
from kvflow.router.config import DEFAULT_MAX_PROMPT_TOKENS, RouterConfig
from kvflow.router.datastore import Datastore
from kvflow.router.flight import Flight, Leg
from kvflow.router.outliers import EjectionPolicy, Outliers
from kvflow.router.framework import Cycle, Profile, StartedHook
from kvflow.router.fingerprint import Fingerprinter, PromptFingerprints, request_keys
from kvflow.router.kv_events import KvEventSubscriber
from kvflow.router.load import LoadCounter
from kvflow.router.model import EngineMetrics, SchedulingRequest, SchedulingResult
from kvflow.router.observability import DecisionLog, RouterMetrics
from kvflow.router.peers import (
    LEG_TTL, PREFILLED, RELEASED, SENT, Message, PeerLink, Peers, fingerprint_secret, read_key,
)
from kvflow.router.pd import Decision, PdPolicy, decide
from kvflow.router.plugins import PluginContext, build
from kvflow.router.request import Incoming, PoolNames, scheduling_request, tokens_off_loop
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex, SpeculativeIndex
from kvflow.router.scraper import Scraper
from kvflow.tokenizer import Tokenizer, load_tokenizer
from kvflow.endpoints import Endpoint, EndpointId

log = logging.getLogger(__name__)

PROFILE_HEADER = "x-kvflow-profile"
"""A request may name another configured profile (benchmarks, A/B tests)."""
PREHASH_TOKENS = 32_768
"""Prompts at least this long are fingerprinted off the event loop (``Router.route``)."""


def _matches(cycle: Cycle) -> Mapping[EndpointId, int]:
    """Leading blocks of the prompt each pod holds, as the decision believed: what its flight
    counts as not to compute there. Blocks a pod's CPU tier would load back count too: the
    load runs beside the engine's steps (vLLM's asynchronous ``load_kv_async``), so it is no
    prefill work the requests sent after it wait behind (the request's own reload is in its
    TTFT estimate). Counted as work, each tier hit queued its whole reloaded prefix, an
    offloading pod's queue looked many times longer than it was, and the router spread
    prefixes over pods to escape queues that were not there."""
    for kind in ("precise", "approx"):
        found = cycle.data.get(f"prefix:{kind}")
        if found is not None:
            offloaded = cycle.data.get("prefix:offloaded")
            if not offloaded:
                return found
            both = dict(found)
            for eid, blocks in offloaded.items():
                both[eid] = both.get(eid, 0) + blocks
            return both
    return {}


def _served_by(result: SchedulingResult, endpoint: Endpoint) -> SchedulingResult:
    """``result`` as it turned out: ``endpoint`` served it (hooks learn where requests really went)."""
    if result.targets and result.targets[0].id == endpoint.id:
        return result
    return replace(result, targets=(endpoint, *(t for t in result.targets if t.id != endpoint.id)))


def build_profiles(config: RouterConfig, ctx: PluginContext) -> tuple[dict[str, Profile], list[Any]]:
    """Every configured profile, with each named plugin built once and shared between profiles."""
    instances: dict[str, tuple[str, Any]] = {}
    for name, spec in config.plugins.items():
        instances[name] = build(name, spec.type, spec.parameters, ctx)
    profiles: dict[str, Profile] = {}
    for pname, pspec in config.profiles.items():
        filters, scorers, pickers = [], [], []
        for ref in pspec.plugins:
            kind, plugin = instances[ref.plugin_ref]
            if kind == "filter":
                filters.append(plugin)
            elif kind == "scorer":
                scorers.append((plugin, float(ref.weight or 0.0)))
            else:
                pickers.append(plugin)
        profiles[pname] = Profile(pname, tuple(filters), tuple(scorers), pickers[0])
    return profiles, [plugin for _, plugin in instances.values()]


class Router:
    def __init__(
        self,
        config: RouterConfig,
        endpoints: Sequence[Endpoint] = (),
        *,
        profile: str = "default",
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = monotonic,
        secret: bytes | None = None,
        ejection: EjectionPolicy | None = None,
    ) -> None:
        self.config = config
        self._peer_key = read_key(config.peers.key_file) if config.peers.enabled and config.peers.key_file else None
        if self._peer_key is not None and secret is None:  # replicas key blocks alike (``router/peers.py``)
            secret = fingerprint_secret(self._peer_key)
        self.tokenizer = tokenizer or load_tokenizer(None)
        self.approx = ApproxPrefixIndex(config.approx_capacity)
        self.fingerprinter = Fingerprinter(config.block_size, secret=secret)
        """The router's block keys (one random secret per router, or ``secret`` where a replay
        must repeat exactly): prompts and KV events alike."""
        self.precise = PrefixIndex(fingerprinter=self.fingerprinter)
        self.speculative = SpeculativeIndex(config.speculative_ttl)
        self.event_sources: set[EndpointId] = set()
        ctx = PluginContext(
            self.approx, self.precise, self.speculative, self.event_sources, config.step_tokens,
            config.predict_evictions,
        )
        self.profiles, plugins = build_profiles(config, ctx)
        if profile not in self.profiles:
            raise ValueError(f"unknown profile {profile!r} (profiles: {', '.join(sorted(self.profiles))})")
        self.profile = profile
        self._hooks = [p for p in plugins if isinstance(p, StartedHook)]
        self.policy = PdPolicy(config.pd_enabled, config.pd_threshold)
        self.datastore = Datastore(
            endpoints or config.endpoints, prefill_rate=config.prefill_rate, block_size=config.block_size,
            working_set_window=config.working_set_window,
        )
        self.metrics = RouterMetrics(config.pool_name)
        self.log = DecisionLog()
        self.outliers = Outliers(ejection or EjectionPolicy())
        """Passive health: pods ejected for failing requests the others serve (``router/outliers.py``)."""
        self._clock = clock
        self.max_prompt_tokens: int = config.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS
        """Longest prompt accepted (a 400 beyond): the config's, else the pods' context length once known."""
        self._scraper: Scraper | None = None
        self._kv: KvEventSubscriber | None = None
        self._link: PeerLink | None = None
        self._leg_names = itertools.count(1)
        self._foreign: dict[tuple[bytes, int], _Foreign] = {}
        """Peers' legs on this router's pods, by (peer, leg), oldest first."""
        self.peers: Peers | None = None
        """The other replicas of this pool's router, told what this one routes (``peers`` config)."""
        self._watcher: Any = None
        self._static = bool(endpoints or config.endpoints)
        """Endpoints given up front; otherwise a ``pool.kubernetes`` config is watched."""
        self._removals: set[asyncio.Task[None]] = set()
        self._later: Callable[..., object] = _now
        """Runs bookkeeping a send needs soon but not before it: at once, or on the event loop
        once the request is on its way (``start``)."""
        self.datastore.subscribe(self._on_endpoint_change)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Scrape /metrics, subscribe to KV events and, for a Kubernetes pool, watch its pods."""
        self._later = asyncio.get_running_loop().call_soon
        self._scraper = Scraper(
            self.datastore,
            interval=self.config.scrape_interval,
            idle_interval=self.config.scrape_idle_interval,
            timeout=self.config.stale_after,
            adapters_interval=self.config.adapters_interval,
            on_metrics=self._on_metrics,
            seed=self.config.seed,
        )
        await self._scraper.start()
        if self.config.kubernetes is not None and not self._static:
            from kvflow.router.k8s import PodWatcher  # only this path needs the Kubernetes client

            self._watcher = PodWatcher(self.config.kubernetes, self.set_endpoints)
            await self._watcher.start()
        if self._peer_key is not None:
            spec = self.config.peers
            self._link = PeerLink(self._peer_key, spec.port, addresses=spec.addresses, service=spec.service,
                                  resolve_seconds=spec.resolve_seconds, on_message=self.heard)
            await self._link.start()
            self.peers = self._link
        if self.config.kv_events_enabled:
            self._kv = KvEventSubscriber(
                self.precise, self._on_kv_event, self.speculative, self.event_sources, self._on_kv_problem
            )
            for ep in self.datastore.endpoints:
                self._kv.add(ep, self.config.kv_events_addresses(ep), self.config.kv_replay_endpoints.get(ep.id))

    async def stop(self) -> None:
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        if self._scraper is not None:
            await self._scraper.stop()
            self._scraper = None
        if self._kv is not None:
            await self._kv.close()
            self._kv = None
        if self._link is not None:
            await self._link.close()
            self._link = self.peers = None
        for task in list(self._removals):
            await task

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Replace the pool's endpoints (the Kubernetes watch calls this)."""
        self.datastore.set_endpoints(endpoints)

    @property
    def endpoints(self) -> Sequence[Endpoint]:
        return self.datastore.endpoints

    @property
    def names(self) -> PoolNames:
        """The model and LoRA adapters this pool serves, as ``scheduling_request`` resolves them:
        the configured ones and those the pods list as loaded."""
        learned = self.datastore.adapters()
        return PoolNames(self.config.model or "", self.config.loras | learned if learned else self.config.loras)

    # -- the data path ---------------------------------------------------------------------

    async def route(self, incoming: Incoming) -> Flight:
        """Where ``incoming`` goes: the ``Flight`` that accounts for it, its decision in
        ``flight.result``. Tell the flight each attempt, then ``finish`` it (``kvflow.router.flight``).

        A large body is tokenized, and a long prompt fingerprinted, in a worker thread, so that
        one huge request does not hold the event loop from every other; then ``decide``. Raises
        ``KvflowError``: a bad request or profile (400), no pod (503), shed (429)."""
        tokens = await tokens_off_loop(self.tokenizer, incoming.body, incoming.size)
        request = scheduling_request(
            incoming.body, incoming.headers, tokens, request_id=incoming.request_id, names=self.names,
            max_prompt_tokens=self.max_prompt_tokens, priority=incoming.priority,
        )
        return self.decide(request, await self._fingerprinted(request))

    async def _fingerprinted(self, request: SchedulingRequest) -> PromptFingerprints | None:
        """A long prompt's fingerprints, computed in a worker thread (which yields the GIL to the
        event loop) when the decision will read them; None: ``decide`` computes what it reads."""
        if len(request.token_ids) < PREHASH_TOKENS:
            return None
        profile = self.profiles.get(self._profile_name(request))
        if profile is None or not (profile.reads_prefixes or self.policy.enabled):
            return None
        fingerprints = self.fingerprints(request)
        try:
            await asyncio.to_thread(fingerprints.all)
        except InvalidRequestError:
            return None  # decide raises it again, where callers expect it
        return fingerprints

    def decide(self, request: SchedulingRequest, fingerprints: PromptFingerprints | None = None) -> Flight:
        """The decision for ``request``, as the ``Flight`` that accounts for it (nothing is
        counted on a pod until the flight is told it was sent there); ``fingerprints``: the
        prompt's, if computed already (``route`` computes a long prompt's off the event loop)."""
        started = perf_counter()
        name = self._profile_name(request)
        profile = self.profiles.get(name)
        if profile is None:
            raise InvalidRequestError(
                f"unknown scheduling profile {name!r} (profiles: {', '.join(sorted(self.profiles))})",
                param=PROFILE_HEADER,
            )
        prefill_profile = self.profiles.get(self.config.pd_prefill_profile or name, profile)
        cycle = self._cycle(request, fingerprints)
        # Forgetting old guesses, recording the decision: after the send (``_later``), each a few
        # dozen µs of sets and records freed, of no use to this decision (a guess then lives a
        # decision longer than its ``ttl``).
        now = self._clock()  # one reading per decision: expiry and readmission see the same instant
        self._later(self.speculative.expire, now)
        if self.outliers.next_due <= now:
            self._readmit(now)
        decoders, prefillers = self.datastore.by_role()
        try:
            decision = decide(
                cycle, decoders, prefillers, profile, prefill_profile, self.policy, self.approx, self.precise
            )
        except KvflowError as exc:
            seconds = perf_counter() - started
            kind = "shed" if isinstance(exc, RateLimitError) else "no_capacity"
            self.metrics.failed(name, kind, seconds)
            self.log.add(request, None, seconds, error=f"{kind}: {exc.message}", hashes=cycle.hashes)
            raise
        self._later(self._record, request, decision, perf_counter() - started, cycle)
        # Only a decision that read the prompt's prefix teaches the indexes where it went.
        return self._flight(request, decision.result, cycle.hashes if decision.reads_prefixes else None, _matches(cycle))

    def _profile_name(self, request: SchedulingRequest) -> str:
        return request.profile or request.headers.get(PROFILE_HEADER) or self.profile

    def _record(self, request: SchedulingRequest, decision: Decision, seconds: float, cycle: Cycle) -> None:
        """A decision into the metrics and the decision log."""
        if cut := cycle.data.get("prefix:evictions"):
            self.metrics.evictions_predicted_child.inc(cut)
        self.metrics.decided(decision, seconds, len(request.token_ids))
        self.log.add(request, decision, seconds, hashes=cycle.hashes)

    def explain(self, n: int = 10) -> list[dict[str, Any]]:
        return self.log.last(n)

    def kv_heard(self) -> dict[EndpointId, tuple[float, float | None]]:
        """Per pod, when its last KV-event batch was applied and its lag (the status API)."""
        return dict(self._kv.heard_at) if self._kv is not None else {}

    def _flight(self, request: SchedulingRequest, result: SchedulingResult, hashes: PromptFingerprints | None,
                matches: Mapping[EndpointId, int]) -> Flight:
        """The accounting of a decided request. ``hashes``: the prompt's fingerprints, which the
        indexes learn where it is sent (None: the decision did not read them, nothing to learn);
        ``matches``: the leading blocks each pod was believed to hold."""
        return Flight(
            request, result, counter=self.datastore.counter, cached_blocks=matches, block_size=self.config.block_size,
            clock=self._clock, beliefs=_Lesson(self, request, result, hashes), step_tokens=self.config.step_tokens,
        )

    def _attempt_failed(self, endpoint: Endpoint) -> None:
        """An attempt there failed (timeout, 5xx, wrong model, reset): maybe eject the pod."""
        if self.outliers.failed(endpoint.id, self._clock(), len(self.datastore.endpoints)):
            self.datastore.set_ejected(endpoint.id, True)
            self.metrics.ejections.labels(self.config.pool_name, endpoint.id).inc()
            log.warning("ejected %s for %.0f s after %d failed requests in a row", endpoint.id,
                        self.outliers.pods[endpoint.id].until - self._clock(), self.outliers.policy.consecutive_failures)

    def _readmit(self, now: float) -> None:
        for eid in self.outliers.due(now):
            self.datastore.set_ejected(eid, False)
            log.info("readmitted %s after its ejection", eid)

    def _touch(self, counter: LoadCounter, fingerprints: np.ndarray, pin: bool) -> None:
        counter.touched(fingerprints, self._clock())
        if pin:
            counter.working_set.pin(fingerprints)

    def pins(self, endpoint: EndpointId) -> bool:
        """Whether a request sent to ``endpoint`` pins its blocks there (the eviction cut then
        keeps them, ``prefix_cache.surviving``): only where the pod offloads to a CPU tier. A
        pin is wrong when its request ends before the one sent now is admitted; there that costs
        a reload, on a pod without a tier a prefill, and on (e) past its knee keeping them cost
        more than the cut's errors did, so there the LRU order alone decides."""
        return self.precise.cpu.offloads(endpoint)

    def refresh_gauges(self) -> None:
        """Set the per-endpoint gauges (in flight, routable) and index sizes: called when the
        metrics are read (the standalone router's /metrics, the gateway's), not per request."""
        pool, m = self.config.pool_name, self.metrics
        m.flush_scores()
        for view in self.datastore.snapshot():
            m.in_flight.labels(pool, view.id).set(view.in_flight)
            m.healthy.labels(pool, view.id).set(1 if view.healthy else 0)
        for eid, (_, lag) in self.kv_heard().items():
            if lag is not None:
                m.kv_event_lag.labels(pool, eid).set(lag)
        m.index_blocks.labels(pool, "approx").set(len(self.approx))
        m.index_blocks.labels(pool, "precise").set(len(self.precise))

    def heard(self, message: Message) -> None:
        """What a peer replica did (``router/peers.py``), believed as if this one had: a leg it
        sent counts on its pod (queued, prefilling, in flight) until its end is heard, and its
        blocks are where the peer believes them (its approximate index where the peer's took
        them, the speculative guess, the pod's working set)."""
        now = self._clock()
        foreign = self._foreign
        while foreign:  # legs whose end was never heard (a lost message, a replica gone)
            oldest = next(iter(foreign))
            if foreign[oldest].leg.sent_at > now - LEG_TTL:
                break
            _end(foreign.pop(oldest), now, undo=False)
        key = (message.sender, message.leg)
        if message.kind == SENT:
            view = self.datastore.view(message.endpoint)
            if view is None:
                return  # a pod this replica does not route to (yet)
            eid, hashes = message.endpoint, message.hashes
            pinned = None
            if hashes:
                if message.taught:
                    self.approx.add(eid, hashes)
                self.speculative.add(eid, hashes, now)
                keys = np.array(hashes, np.uint64)
                view.counter.touched(keys, now)
                if self.pins(eid):
                    view.counter.working_set.pin(keys)
                    pinned = keys
            foreign[key] = _Foreign(Leg(view.endpoint, view.counter, message.work, message.tokens, now), hashes,
                                    message.taught, pinned)
            return
        found = foreign.get(key)
        if found is None:
            return
        if message.kind == PREFILLED:
            found.leg.prefilled()
            return
        del foreign[key]
        _end(found, now, undo=message.undone)
        if message.undone and found.hashes:
            eid = found.leg.endpoint.id
            if found.taught:
                self.approx.discard(eid, found.hashes)
            self.speculative.discard(eid, found.hashes)

    def mark_failed(self, endpoint: Endpoint) -> None:
        self.datastore.mark_failed(endpoint.id)

    # -- internals -------------------------------------------------------------------------

    def fingerprints(self, request: SchedulingRequest) -> PromptFingerprints:
        """The request's block fingerprints (the indexes' keys), computed when first read:
        keyed on its LoRA adapter and cache salt as vLLM's events key the pods' blocks."""
        if request.lora is None and not request.cache_salt and not request.mm_hashes:
            return self.fingerprinter.prompt(request.token_ids)
        first, later = request_keys(request.lora, request.cache_salt, request.mm_hashes)
        return self.fingerprinter.prompt(request.token_ids, first, later)

    def _cycle(self, request: SchedulingRequest, fingerprints: PromptFingerprints | None) -> Cycle:
        # The tie-break generator is seeded only if a picker draws from it (Cycle.rng).
        seed = crc32(request.request_id.encode()) ^ self.config.seed
        if fingerprints is None or fingerprints.token_ids is not request.token_ids:
            fingerprints = self.fingerprints(request)
        return Cycle(request, fingerprints, seed, self.config.block_size, self._clock(), board=self.datastore.loads)

    def _on_metrics(self, endpoint: Endpoint, metrics: EngineMetrics) -> None:
        if metrics.num_blocks:
            self.approx.set_capacity(endpoint.id, metrics.num_blocks)
            self.precise.set_capacity(endpoint.id, metrics.num_blocks)

    def _on_kv_event(self, endpoint_id: str, kind: str, n: int) -> None:
        self.metrics.kv_events.labels(self.config.pool_name, endpoint_id, kind).inc(n)

    def _on_kv_problem(self, endpoint_id: str, kind: str) -> None:
        self.metrics.kv_event_problems.labels(self.config.pool_name, endpoint_id, kind).inc()

    def _on_endpoint_change(self, endpoint: Endpoint, added: bool) -> None:
        if added:
            if self._scraper is not None:
                self._scraper.add(endpoint)
            if self._kv is not None:
                self._kv.add(
                    endpoint, self.config.kv_events_addresses(endpoint), self.config.kv_replay_endpoints.get(endpoint.id)
                )
            return
        self.approx.clear(endpoint.id)
        self.precise.clear(endpoint.id)
        self.speculative.clear(endpoint.id)
        self.outliers.forget(endpoint.id)
        for closer in (self._scraper.remove if self._scraper else None, self._kv.remove if self._kv else None):
            if closer is not None:
                task = asyncio.get_running_loop().create_task(closer(endpoint.id))
                self._removals.add(task)
                task.add_done_callback(self._removals.discard)


@dataclass(slots=True)
class _Foreign:
    """A peer's leg on one of the pods: counted there until its end is heard."""

    leg: Leg
    hashes: list[int]
    taught: bool
    pinned: np.ndarray | None = None
    """Its blocks as pinned on the pod (where it offloads), until it ends; None: not pinned."""


class _Lesson:
    """What one request's flight teaches its router (``kvflow.router.flight.Beliefs``): where
    its prompt's blocks now are (the approximate index, a speculative guess until its prefill
    there ends, the pod's working set), taken back where an attempt fails; the plugins'
    ``StartedHook``s, told where it went; passive health, told which pods answer and which fail."""

    __slots__ = ("_router", "_request", "_result", "_hashes", "_teach_all", "_learned", "_guesses", "_legs", "_pinned")

    def __init__(self, router: Router, request: SchedulingRequest, result: SchedulingResult,
                 hashes: PromptFingerprints | None) -> None:
        self._router, self._request, self._result, self._hashes = router, request, result, hashes
        # the approximate index is read for pods that send KV events only by some profiles'
        # plugins: a decision by others teaches it only about the pods that send none (teaching is work on every send)
        routed = [router.profiles.get(n) for n in (result.profile, router.config.pd_prefill_profile) if n]
        self._teach_all = any(p is None or p.reads_routed for p in routed)
        self._learned: list[int] | None = None
        """The prompt's fingerprints as the indexes take them, once it was sent somewhere."""
        self._guesses: dict[tuple[EndpointId, bool], set[int]] = {}
        """Each leg's speculative guess, until its prefill ends."""
        self._legs: dict[bool, int] = {}
        """Each leg's name on the wire to the router's peers, until it is released."""
        self._pinned: set[tuple[EndpointId, bool]] = set()
        """The legs whose blocks are pinned on their pod, until they are released."""

    def sent(self, endpoint: Endpoint, prefill: bool, work: int, tokens: int) -> None:
        router, hashes = self._router, self._hashes
        learned: list[int] = []
        taught = False
        if hashes is not None:
            if hashes.num_blocks:  # (a prompt shorter than a block teaches nothing)
                learned = self._learned = self._learned if self._learned is not None else hashes.all()
                taught = self._teach_all or endpoint.id not in router.event_sources
                if taught:
                    router.approx.add(endpoint.id, learned)
                guess = router.speculative.add(endpoint.id, learned, router._clock())
                if guess is not None:
                    self._guesses[endpoint.id, prefill] = guess
            counter = router.datastore.counter(endpoint.id)
            if counter is not None:  # a long prompt's touch is real work: after the request is sent
                pin = router.pins(endpoint.id)
                if pin:
                    self._pinned.add((endpoint.id, prefill))
                router._later(router._touch, counter, hashes.array, pin)
        if router.peers is not None:
            leg = self._legs[prefill] = next(router._leg_names)
            router.peers.tell(Message(router.peers.sender, SENT, leg, endpoint.id, learned, taught, work, tokens))
        if not prefill:
            for hook in router._hooks:
                hook.request_started(self._request, _served_by(self._result, endpoint))

    def prefilled(self, endpoint: Endpoint, prefill: bool) -> None:
        guess = self._guesses.pop((endpoint.id, prefill), None)
        if guess is not None:
            self._router.speculative.prefilled(endpoint.id, guess)
        peers, leg = self._router.peers, self._legs.get(prefill)
        if peers is not None and leg is not None:
            peers.tell(Message(peers.sender, PREFILLED, leg))

    def released(self, endpoint: Endpoint, prefill: bool, undone: bool) -> None:
        router, hashes = self._router, self._hashes
        if hashes is not None and (endpoint.id, prefill) in self._pinned:
            self._pinned.discard((endpoint.id, prefill))
            counter = router.datastore.counter(endpoint.id)
            if counter is not None:  # after the touch that pinned it (``sent``), in order
                router._later(counter.working_set.unpin, hashes.array)
        peers, leg = router.peers, self._legs.pop(prefill, None)
        if peers is not None and leg is not None:
            peers.tell(Message(peers.sender, RELEASED, leg, undone=undone))

    def undone(self, endpoint: Endpoint, prefill: bool) -> None:
        router = self._router
        router._attempt_failed(endpoint)
        self.prefilled(endpoint, prefill)
        if self._learned is not None:
            router.approx.discard(endpoint.id, self._learned)
            router.speculative.discard(endpoint.id, self._learned)

    def answered(self, endpoint: Endpoint, prefill: bool) -> None:
        self._router.outliers.succeeded(endpoint.id)


def _end(foreign: _Foreign, now: float, *, undo: bool) -> None:
    """A peer's leg ended: its load leaves the pod, and its blocks the pod's pins."""
    leg = foreign.leg
    leg.release(now, undo=undo)
    if foreign.pinned is not None and leg.counter is not None:
        leg.counter.working_set.unpin(foreign.pinned)


def _now(fn: Callable[..., object], *args: object) -> None:
    fn(*args)
