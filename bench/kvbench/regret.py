"""Where kvflow's decisions lose against the oracle's model: one-step regret on the replay.

kvflow's real router decides inside the replay (``KvflowReplay``). At each decision the
clairvoyant (``oracle.Clairvoyant``) also prices every pod in that same state: its estimated
time to first token plus ``weight`` times the prefill compute the request would take from it.
A decision's *regret* is what kvflow's pick costs over the cheapest pod. It is one step's
regret only: a different pick changes every later state, so the sum over a trace is not the
gap between the two routers' mean TTFTs, but it says which decisions lose and why.

Each decision that loses more than ``threshold`` seconds is put down to one cause, checked in
this order:

* ``stale cache``: kvflow believed its pick held more of the prompt than the pick did (a pod
  publishes an eviction at the end of the step that made it; a prefix sent there is counted
  as cached before it is computed);
* ``missed cache``: the cheapest pod held more than kvflow believed;
* ``load``: the two agree about both pods' caches; kvflow misjudged the queue or the speed.

Beside it: how often the router's KV-event index agrees with each pod's cache at a decision,
how often the eviction cut (``predictEvictions``) was right where it cut the index's match or
left it whole, and the router's queued prefill work against what is really ahead on each pod
(its rest of the running step included, in tokens at the profile's prefill speed).

    python bench/routing_regret.py --workload b --seed 0 --rate 20
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvflow.router import SchedulingRequest
from kvflow.router.plugins.prefix_cache import surviving
from kvflow.sim.profiles import Profile

from kvbench.oracle import HASH, Clairvoyant, Pod, Prepared, after_step
from kvbench.replay_kvflow import MODEL, KvflowReplay

CAUSES = ("stale cache", "missed cache", "load")


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision, as kvflow saw it and as it was (per pod, in pod order)."""

    at: float
    pick: int
    """kvflow's pick."""
    best: int
    """The cheapest pod by the clairvoyant's cost."""
    cost: tuple[float, ...]
    """The clairvoyant's cost of each pod: estimated TTFT + weight x compute taken (seconds)."""
    cached: tuple[int, ...]
    """Prompt tokens each pod really held (or was about to: the prefixes queued there)."""
    believed: tuple[int, ...]
    """Prompt tokens kvflow believed each pod held: its KV-event index, and the prefixes it sent
    there that no event has confirmed yet, continued by the pod's CPU tier (``cached`` counts a
    CPU-tier hit too)."""
    indexed: tuple[int, ...]
    """Leading blocks the KV-event index alone gave each pod."""
    held: tuple[int, ...]
    """Leading blocks each pod's cache held, nothing queued counted."""
    kept: tuple[int, ...]
    """Of ``indexed``, the leading blocks the eviction cut left (the pod's LRU order, as the
    router's working set places it)."""
    queued: tuple[float, ...]
    """Prefill work kvflow estimated queued on each pod (tokens)."""
    ahead: tuple[float, ...]
    """Prefill work really ahead on each pod: the running step's rest, then what is left to compute."""

    @property
    def regret(self) -> float:
        return self.cost[self.pick] - self.cost[self.best]

    def cause(self) -> str:
        k, b = self.pick, self.best
        if self.believed[k] > self.cached[k] + HASH.block_size:
            return "stale cache"
        if self.cached[b] > self.believed[b] + HASH.block_size:
            return "missed cache"
        return "load"


@dataclass(frozen=True, slots=True)
class Summary:
    decisions: int
    regret_s: float
    losing: dict[str, int] = field(default_factory=dict)
    """Decisions that lost more than the threshold, by cause."""
    lost_s: dict[str, float] = field(default_factory=dict)
    """Their regret, by cause (seconds)."""
    index_agrees: float = 1.0
    """Share of (decision, pod) pairs where the KV-event index held exactly what the pod did."""
    index_over: int = 0
    """Pairs where the index believed more than the pod held (an eviction not yet published)."""
    index_under: int = 0
    """Pairs where the pod held more than the index (a block the pod holds twice lost its entry
    with the first copy's ``BlockRemoved``)."""
    cuts_right: int = 0
    """Pairs the eviction cut shortened, the pod holding no more than it left."""
    false_cuts: tuple[int, int] = (0, 0)
    """Pairs it shortened below what the pod held, and the blocks it took from them."""
    missed_evictions: tuple[int, int] = (0, 0)
    """Pairs it left whole that the pod no longer held whole, and the blocks they lacked."""
    queue_error: float = 0.0
    """Mean of kvflow's queued work less the work really ahead (tokens), over pods and decisions."""
    queue_abs_error: float = 0.0


def summarise(decisions: Sequence[Decision], threshold: float = 0.002) -> Summary:
    losing = dict.fromkeys(CAUSES, 0)
    lost = dict.fromkeys(CAUSES, 0.0)
    for d in decisions:
        if d.regret > threshold:
            cause = d.cause()
            losing[cause] += 1
            lost[cause] += d.regret
    pairs = [(i, h) for d in decisions for i, h in zip(d.indexed, d.held, strict=True)]
    cuts = [(i, k, h) for d in decisions for i, k, h in zip(d.indexed, d.kept, d.held, strict=True) if i]
    false = [min(h, i) - k for i, k, h in cuts if k < i and h > k]
    missed = [i - h for i, k, h in cuts if k == i and h < i]
    errors = [q - a for d in decisions for q, a in zip(d.queued, d.ahead, strict=True)]
    return Summary(
        decisions=len(decisions),
        regret_s=sum(d.regret for d in decisions),
        losing=losing,
        lost_s=lost,
        index_agrees=sum(i == h for i, h in pairs) / len(pairs) if pairs else 1.0,
        index_over=sum(i > h for i, h in pairs),
        index_under=sum(i < h for i, h in pairs),
        cuts_right=sum(k < i and h <= k for i, k, h in cuts),
        false_cuts=(len(false), sum(false)),
        missed_evictions=(len(missed), sum(missed)),
        queue_error=statistics.fmean(errors) if errors else 0.0,
        queue_abs_error=statistics.fmean(map(abs, errors)) if errors else 0.0,
    )


def ahead_tokens(pod: Pod, now: float, profile: Profile) -> float:
    """Prefill work ahead of a request sent to ``pod`` now, in tokens: the running step's rest
    (at the profile's prefill speed), then every prompt token still to compute after it."""
    return max(0.0, pod.step_end - now) / profile.prefill_per_token_s + after_step(pod)[0]


class RegretReplay(KvflowReplay):
    """``KvflowReplay`` that records every decision beside the clairvoyant's view of it."""

    def __init__(self, pods: int, num_blocks: int, *, weight: float = 1.0, **kw: object) -> None:
        super().__init__(pods, num_blocks, **kw)  # type: ignore[arg-type]
        self.oracle = Clairvoyant(weight)
        self.decisions: list[Decision] = []

    def pick(self, prepared: Prepared, pods: Sequence[Pod], now: float, profile: Profile) -> int | None:
        self.now = now
        ids = [ep.id for ep in self.endpoints]
        counters = [self.router.datastore.counter(eid) for eid in ids]
        queued = tuple(c.queued(now) if c is not None else 0.0 for c in counters)
        ahead = tuple(ahead_tokens(pod, now, profile) for pod in pods)
        n = len(prepared.token_ids)
        cached = tuple(Clairvoyant.cached_tokens(prepared, pod) for pod in pods)
        cost = tuple(self.oracle.cost(prepared, pod, now, profile, c) for pod, c in zip(pods, cached, strict=True))
        request = SchedulingRequest(str(prepared.request.index), MODEL, list(prepared.token_ids))
        blocks = prepared.hashes[: (n - 1) // HASH.block_size]
        fingerprints = self.router.fingerprints(request)
        matched = self.router.precise.match(fingerprints)
        indexed = tuple(min(matched.get(eid, 0), len(blocks)) for eid in ids)
        kept = tuple(self._kept(eid, fingerprints.array[:n]) if n else 0 for eid, n in zip(ids, indexed))
        self.router.speculative.expire(now)
        self.router.speculative.extend(matched, fingerprints.all())  # as the precise scorer reads it
        reloaded = self.router.precise.cpu.continued(fingerprints.array, matched, ids)  # a CPU tier's, after the GPU's
        believed = tuple(min(matched.get(eid, 0) + reloaded.get(eid, 0), len(blocks)) * HASH.block_size for eid in ids)
        held = tuple(len(pod.scheduler.pool.longest_hit(blocks)) for pod in pods)
        pick = super().pick(prepared, pods, now, profile)
        if pick is None:
            return None
        best = min(range(len(pods)), key=cost.__getitem__)
        if math.isclose(cost[pick], cost[best], abs_tol=1e-9):
            best = pick
        self.decisions.append(Decision(now, pick, best, cost, cached, believed, indexed, held, kept, queued, ahead))
        return pick

    def _kept(self, endpoint_id: str, fingerprints: np.ndarray) -> int:
        counter = self.router.datastore.counter(endpoint_id)
        if counter is None or not self.router.config.predict_evictions:
            return len(fingerprints)
        return surviving(counter, fingerprints)


def report(summary: Summary) -> str:
    lines = [
        f"decisions {summary.decisions}, one-step regret {summary.regret_s * 1e3:.0f} ms "
        f"({summary.regret_s * 1e3 / max(1, summary.decisions):.1f} ms a decision)",
        "losing decisions by cause:",
    ]
    for cause in CAUSES:
        lines.append(f"  {cause:13s} {summary.losing[cause]:5d}   regret {summary.lost_s[cause] * 1e3:8.0f} ms")
    lines.append(
        f"KV-event index vs the pods' caches: {summary.index_agrees:.1%} agree, believed more "
        f"{summary.index_over}, held more {summary.index_under} (decision x pod)"
    )
    lines.append(
        f"eviction cut vs the pods' caches: {summary.cuts_right} cuts right, {summary.false_cuts[0]} false "
        f"({summary.false_cuts[1]} blocks the pods held), {summary.missed_evictions[0]} missed "
        f"({summary.missed_evictions[1]} blocks they no longer held) (decision x matched pod)"
    )
    lines.append(
        f"queued prefill work, kvflow's less the pods' own: mean {summary.queue_error:.0f} tokens, "
        f"mean absolute {summary.queue_abs_error:.0f}"
    )
    return "\n".join(lines)
