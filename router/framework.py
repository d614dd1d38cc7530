"""The scheduling framework: filters → weighted scorers → picker, composed into profiles.

Shaped after the Gateway API Inference Extension's endpoint picker
(``pkg/epp/framework/interface/scheduling/plugins.go``): plugins are small objects behind the
Protocols below, named and weighted in the config (``config.py``), built by a registry of
factories (``plugins/``). A scorer returns a score in [0, 1] per endpoint (the runner clamps
it); a profile's total is the weighted sum; the picker orders the endpoints. A profile handler
(``pd.py``) decides which profiles run for a request — one, or decode then prefill.

A cycle is synchronous and reads only its ``Cycle`` (the request, its lazily computed block
hashes, its seeded random draws) and a frozen snapshot of endpoints, so it is deterministic.
Both are paid for only when used: tie-break draws are computed one by one from the seed, the
generator a weighted random pick uses is seeded on its first draw, and hashes are computed only
by plugins that declare ``reads_prefixes`` (and by the P/D decider).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvflow.errors import NoCapacityError
from kvflow.router.fingerprint import PromptFingerprints
from kvflow.router.load import CandidateLoads, LoadBoard, Loads
from kvflow.router.model import EndpointView, SchedulingRequest, SchedulingResult
from kvflow.endpoints import EndpointId

try:
    from kvflow import _native as native
except ImportError:  # installed without a C compiler: Python computes the same draws
    native = None  # type: ignore[assignment]


@dataclass(slots=True)
class Cycle:
    """Per-request state shared by the plugins of one scheduling cycle."""

    request: SchedulingRequest
    hashes: PromptFingerprints
    """The prompt's block keys (``num_blocks``; iterating gives them), computed when first read."""
    seed: int
    """Seeds the cycle's random draws: the same request id gives the same decision."""
    block_size: int
    now: float = 0.0
    """The router's clock when the cycle began (load estimates drain with time)."""
    board: LoadBoard | None = None
    """The pods' load numbers (the datastore's ``LoadBoard``); None: the candidates' counters
    are read one by one (views made outside a datastore)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Scratch space plugins share, e.g. prefix matches (``prefix:<kind>``) for the P/D decider."""
    _rng: random.Random | None = None
    _drawn: int = 0

    @property
    def rng(self) -> random.Random:
        """The cycle's generator (a weighted random pick): seeded on first use, since seeding a
        Mersenne Twister costs more than a small pool's whole decision."""
        if self._rng is None:
            self._rng = random.Random(self.seed)
        return self._rng

    def tie_breaks(self, n: int) -> int:
        """Reserves the cycle's next ``n`` tie-break draws and returns the first one's number:
        draw ``k`` is ``tie_break(cycle.seed, k)``, so a second picker in the cycle (a P/D
        prefill run) draws afresh."""
        first = self._drawn
        self._drawn += n
        return first

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    def loads(self, endpoints: Sequence[EndpointView]) -> CandidateLoads:
        """The load numbers of ``endpoints``, column by column (``board.columns``): gathered once
        for the plugins that read the same candidates (a filter that narrows them passes its
        ``CandidateLoads`` on with ``set_loads``)."""
        found: CandidateLoads | None = self.data.get("loads")
        if found is None or found.endpoints is not endpoints:
            found = self.data["loads"] = (self.board or LoadBoard(1)).columns(endpoints)
        return found

    def set_loads(self, loads: CandidateLoads) -> None:
        self.data["loads"] = loads

    def numbers(self, endpoints: Sequence[EndpointView]) -> list[Loads[float]]:
        """Each of a few candidates' load numbers, in their order (``LoadCounter.numbers``),
        read once for the plugins that read the same candidates."""
        found: tuple[Sequence[EndpointView], list[Loads[float]]] | None = self.data.get("numbers")
        if found is None or found[0] is not endpoints:
            found = self.data["numbers"] = (endpoints, [ep.counter.numbers() for ep in endpoints])
        return found[1]


class Filter(Protocol):
    name: str

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]: ...


class Scorer(Protocol):
    name: str

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        """A score in [0, 1] per endpoint (clamped; a missing endpoint scores 0). An empty mapping
        abstains: a scorer with nothing to tell apart (no LoRA, no session) costs nothing then.
        A scorer that scores every endpoint may return ``Scores(endpoints, values)``, in order."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, cycle: Cycle, scored: Sequence[tuple[EndpointView, float]]) -> list[EndpointView]:
        """Endpoints in preference order: the pick first, then fallbacks."""
        ...


@runtime_checkable
class StartedHook(Protocol):
    """A plugin that learns from decisions once the request is really sent (session affinity)."""

    def request_started(self, request: SchedulingRequest, result: SchedulingResult) -> None: ...


@dataclass(frozen=True, slots=True)
class ProfileRun:
    """What one profile decided, with the evidence the debug endpoint explains."""

    profile: str
    targets: tuple[EndpointView, ...]
    totals: Mapping[EndpointId, float]
    scores: Mapping[EndpointId, Mapping[str, float]]
    filtered: Mapping[str, int]
    """Endpoints left after each filter."""


def reads_prefixes(plugin: object) -> bool:
    """Whether a plugin reads the request's block hashes (prefix-cache scorers say so)."""
    return bool(getattr(plugin, "reads_prefixes", False))


def reads_routed(plugin: object) -> bool:
    """Whether a plugin reads the approximate index (what the router routed) for every pod, not
    only for pods that send no KV events (``prefix-cache-scorer`` and the precise scorer's home
    hint say so)."""
    return bool(getattr(plugin, "reads_routed", False))


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    reads_prefixes: bool = field(init=False)
    """A plugin reads block hashes: the router hashes the prompt and teaches the prefix
    indexes what it routed only for such profiles (and for P/D decisions)."""
    reads_routed: bool = field(init=False)
    """A plugin reads the approximate index for pods that send KV events too: without one the
    router teaches it only about pods that send none (their prefixes are known no other way)."""

    def __post_init__(self) -> None:
        plugins = (*self.filters, *(s for s, _ in self.scorers), self.picker)
        object.__setattr__(self, "reads_prefixes", any(reads_prefixes(p) for p in plugins))
        object.__setattr__(self, "reads_routed", any(reads_routed(p) for p in plugins))

    def run(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> ProfileRun:
        candidates = endpoints
        filtered: dict[str, int] = {}
        for f in self.filters:
            candidates = f.filter(cycle, candidates)
            filtered[f.name] = len(candidates)
            if not candidates:
                raise NoCapacityError(f"no endpoint can serve model {cycle.request.model!r} (filter {f.name})")
        ids: list[EndpointId] = []  # read only for a scorer that answers with a dict
        totals: list[float] | np.ndarray | None = None
        by_scorer: dict[str, Mapping[EndpointId, float]] = {}
        for scorer, weight in self.scorers:
            got = scorer.score(cycle, candidates)
            if not got:  # the scorer abstains: it would score every endpoint alike
                continue
            by_scorer[scorer.name] = got
            # Each total is summed in scorer order: the same floats whatever the endpoint count.
            # A missing endpoint scores 0, and scores are clamped to [0, 1]. Scores that come as
            # a numpy array (a scorer's columns, for many endpoints) are added up as one.
            if type(got) is Scores and got.endpoints is candidates:
                values: Iterable[float] | np.ndarray = got.aligned
            else:
                ids = ids or [ep.id for ep in candidates]
                values = map(got.get, ids, repeat(0.0))
            if isinstance(values, np.ndarray) or isinstance(totals, np.ndarray):
                column = values if isinstance(values, np.ndarray) else np.fromiter(values, np.float64, len(candidates))
                term = weight * np.minimum(np.maximum(column, 0.0), 1.0)  # (np.clip costs more)
                totals = term if totals is None else totals + term
            elif totals is None:
                totals = [weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s) for s in values]
            else:
                totals = [t + weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s) for t, s in zip(totals, values)]
        aligned = totals.tolist() if isinstance(totals, np.ndarray) else totals or [0.0] * len(candidates)
        scores = _PerEndpoint(by_scorer, candidates)
        ordered = self.picker.pick(cycle, list(zip(candidates, aligned)))
        return ProfileRun(self.name, tuple(ordered), Scores(candidates, aligned), scores, filtered)


class Scores(Mapping[EndpointId, float]):
    """Scores aligned with the endpoints a scorer was given (``aligned[i]`` is ``endpoints[i]``'s).

    A scorer that scores every endpoint returns this instead of a dict: the runner then adds the
    values up in order, with no dict to build and none to look up, which is most of a thousand
    endpoints' cost. Read as a mapping (tests, debug output) it is keyed by endpoint id."""

    __slots__ = ("endpoints", "aligned", "_by_id")

    def __init__(self, endpoints: Sequence[EndpointView], aligned: Sequence[float] | np.ndarray) -> None:
        self.endpoints = endpoints
        self.aligned = aligned
        self._by_id: dict[EndpointId, float] | None = None

    def _mapping(self) -> dict[EndpointId, float]:
        if self._by_id is None:
            values = self.aligned.tolist() if isinstance(self.aligned, np.ndarray) else self.aligned
            self._by_id = {ep.id: v for ep, v in zip(self.endpoints, values)}
        return self._by_id

    def __getitem__(self, eid: EndpointId) -> float:
        return self._mapping()[eid]

    def __iter__(self) -> Iterator[EndpointId]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self.aligned)

    def __repr__(self) -> str:
        return f"Scores({self._mapping()!r})"


_M64 = (1 << 64) - 1


def splitmix64_draw(seed: int, k: int) -> int:
    """The ``k``-th tie-break draw of a cycle seeded with ``seed``: 64 random bits (SplitMix64's
    ``k``-th output, Steele et al. 2014), computed directly rather than by advancing a generator."""
    z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


tie_break: Callable[[int, int], int] = splitmix64_draw if native is None else native.tie_break
"""``splitmix64_draw``, in C where ``kvflow._native`` is built (Python's big-int arithmetic makes
a draw cost about what a small pool's scoring of one endpoint does)."""


def _clamp(s: float) -> float:
    return 0.0 if s < 0.0 else 1.0 if s > 1.0 else float(s)


class _PerEndpoint(Mapping[EndpointId, Mapping[str, float]]):
    """Scores by endpoint, transposed from scores by scorer only when read (debug, metrics)."""

    __slots__ = ("_by_scorer", "_endpoints")

    def __init__(self, by_scorer: dict[str, Mapping[EndpointId, float]], endpoints: Sequence[EndpointView]) -> None:
        self._by_scorer = by_scorer
        self._endpoints = endpoints

    def __getitem__(self, eid: EndpointId) -> Mapping[str, float]:
        if eid not in iter(self):  # a linear scan, but only debug output reads this
            raise KeyError(eid)
        return {name: _clamp(per.get(eid, 0.0)) for name, per in self._by_scorer.items()}

    def __iter__(self) -> Iterator[EndpointId]:
        return (ep.id for ep in self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)


def min_max_inverse(values: Mapping[EndpointId, float]) -> dict[EndpointId, float]:
    """Lowest value → 1, highest → 0, linear between; all equal → 1 (nothing to prefer)."""
    if not values:
        return {}
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}
