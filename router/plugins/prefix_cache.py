"""Prefix-cache scorers: the share of the prompt's blocks already cached on each endpoint.

``prefix-cache-scorer`` reads the approximate index (what the router routed, LRU-bounded);
``precise-prefix-cache-scorer`` reads the index fed by the pods' KV events, topped up with
what the router routed in the last seconds and no event has confirmed yet, and cut where the
router has since sent the pod a cacheful of other blocks (its LRU cache evicted the rest, though
no ``BlockRemoved`` has said so yet; ``kvflow_router_evictions_predicted_total`` counts the cuts);
for a pod that has never sent a KV event (publishing off, or not connected yet) it uses the
approximate index instead of believing the pod's cache empty. Both leave their matches (blocks
per endpoint) in ``cycle.data`` so the P/D decider and the result's ``cached_tokens`` reuse them.

The precise scorer also keeps a group *at home*: where the pods' caches no longer hold a
prefix, the pod the router last sent it to still scores ``homeWeight`` times its approximate
match. Without that, a prefix evicted everywhere moves to whichever pod is least loaded, and
each move pollutes one more cache; with it, precise routing is never worse than approximate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter

import numpy as np
from pydantic import Field

from kvflow.router.framework import Cycle
from kvflow.router.load import LoadCounter
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex, SpeculativeIndex
from kvflow.endpoints import EndpointId

_id = attrgetter("id")


def prefix_matches(
    cycle: Cycle, kind: str, index: ApproxPrefixIndex | PrefixIndex, speculative: SpeculativeIndex | None = None
) -> dict[EndpointId, int]:
    key = f"prefix:{kind}"
    found = cycle.data.get(key)
    if found is None:
        found = {}
        if cycle.hashes.num_blocks:  # a prompt shorter than a block has nothing to match
            found = index.match(cycle.hashes)
            if speculative:
                speculative.extend(found, cycle.hashes.all())
        cycle.data[key] = found
    return found


def precise_matches(cycle: Cycle, ctx: PluginContext, endpoints: Sequence[EndpointView]) -> dict[EndpointId, int]:
    found = prefix_matches(cycle, "precise", ctx.precise, ctx.speculative)
    if found and ctx.predict_evictions:
        _cut_evicted(cycle, found, ctx.counters(endpoints))
    deaf = set(map(_id, endpoints)).difference(ctx.event_sources)  # (a set difference runs in C)
    if deaf:
        approx = prefix_matches(cycle, "approx", ctx.approx)
        for eid in deaf:
            if approx.get(eid, 0) > found.get(eid, 0):
                found[eid] = approx[eid]
    return found


def offloaded_matches(cycle: Cycle, ctx: PluginContext, endpoints: Sequence[EndpointView],
                      found: Mapping[EndpointId, int] | None = None) -> dict[EndpointId, int]:
    """Per candidate, the blocks after its GPU match (``found``, default ``precise_matches``)
    that its CPU offload tier holds (``PrefixIndex.cpu``, from the pods' medium-``CPU`` events):
    what it would load back instead of computing. A GPU match cut by predicted eviction is
    continued here too: an offloading pod wrote those blocks to CPU when it computed them.
    Also left in ``cycle.data["prefix:offloaded"]`` (every call's pods together, as a P/D
    decision reads decode and prefill pods): the pick's flight queues only the tokens its pod
    computes (``Router``), since a load from the CPU tier runs beside the engine's steps."""
    cpu = ctx.precise.cpu
    if not cycle.hashes.num_blocks or not len(cpu):
        return {}
    gpu = precise_matches(cycle, ctx, endpoints) if found is None else found
    offloaded = cpu.continued(cycle.hashes.array, gpu, map(_id, endpoints))
    cycle.data.setdefault("prefix:offloaded", {}).update(offloaded)
    return offloaded


def _cut_evicted(cycle: Cycle, found: dict[EndpointId, int], counters: Mapping[EndpointId, LoadCounter]) -> None:
    """Cut each candidate's match where its LRU cache has been filled since by other blocks
    this router sent there (``surviving``): the pod evicted the rest, or will before a request
    sent now runs, though its ``BlockRemoved`` has not arrived. Each pod once a cycle,
    whichever call first names it a candidate (a P/D decision reads the decode pods, then the
    prefill pods); the cuts are counted in ``cycle.data["prefix:evictions"]``."""
    checked: set[EndpointId] = cycle.data.setdefault("prefix:checked", set())
    cut = 0
    for eid, n in found.items():  # the matched pods only: a few of a large pool
        if n and eid not in checked and eid in counters:
            checked.add(eid)
            kept = surviving(counters[eid], cycle.hashes.array[:n])
            if kept < n:
                found[eid] = kept
                cut += 1
    if cut:
        cycle.data["prefix:evictions"] = cycle.data.get("prefix:evictions", 0) + cut


def surviving(counter: LoadCounter, fingerprints: np.ndarray) -> int:
    """The leading blocks of a prefix ``counter``'s pod is believed to hold that its LRU order
    still keeps (all of them while the pod has not reported its capacity); never less than what
    its requests in flight use (``WorkingSet.in_use``: pinned only on pods that offload to a CPU
    tier, ``Router.pins``).

    The LRU order is the order requests were sent in; a pod whose full KV cache queues them for
    seconds admits them long after, and a prefix its running requests share is still held. Cut
    there, its next request went to another pod and loaded it again: fewer prefixes were shared
    among the requests running together, fewer fit in KV at once, and (e-cpu)'s queue never
    drained (bench/RESULTS.md, "The cut and requests in flight")."""
    if not counter.kv_capacity:
        return len(fingerprints)
    kept = counter.working_set.surviving(fingerprints, counter.kv_capacity)
    if kept < len(fingerprints):
        kept = max(kept, counter.working_set.in_use(fingerprints))
    return kept


@register("prefix-cache-scorer", "scorer")
class ApproxPrefixScorer:
    reads_prefixes = True
    reads_routed = True

    def __init__(self, name: str, params: NoParams, ctx: PluginContext) -> None:
        self.name = name
        self.ctx = ctx

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        total = cycle.hashes.num_blocks
        if total == 0:
            return dict.fromkeys((ep.id for ep in endpoints), 0.0)
        matches = prefix_matches(cycle, "approx", self.ctx.approx)
        return {ep.id: matches.get(ep.id, 0) / total for ep in endpoints}


class PreciseParams(NoParams):
    home_weight: float = Field(default=0.5, alias="homeWeight", ge=0, le=1)


@register("precise-prefix-cache-scorer", "scorer")
class PrecisePrefixScorer:
    Params = PreciseParams
    reads_prefixes = True

    def __init__(self, name: str, params: PreciseParams, ctx: PluginContext) -> None:
        self.name = name
        self.ctx = ctx
        self.home_weight = params.home_weight
        self.reads_routed = self.home_weight > 0  # the home hint is the approximate index

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        total = cycle.hashes.num_blocks
        if total == 0:
            return dict.fromkeys((ep.id for ep in endpoints), 0.0)
        matches = precise_matches(cycle, self.ctx, endpoints)
        scores = {ep.id: matches.get(ep.id, 0) / total for ep in endpoints}
        if self.home_weight > 0 and len(self.ctx.approx):
            home = prefix_matches(cycle, "approx", self.ctx.approx)
            for eid, n in home.items():
                hint = self.home_weight * n / total
                if eid in scores and hint > scores[eid]:
                    scores[eid] = hint
        return scores
