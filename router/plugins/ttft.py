"""Estimated time to first token: the pod where the request would start answering soonest wins.

One estimate weighs cache against load, in one unit (prompt tokens of prefill work)::

    work(pod) = queued(pod) + uncached(pod) + reloadWork × reloaded(pod)
              + copyWeight × copied(pod) + evictWeight × evicted(pod)
              + steps × (stepTokens + decoding(pod) × decodeTokens)

* ``queued``: prefill work already waiting there: this router's requests as a first-in
  first-out queue of uncached tokens draining at the pod's prefill rate, cut short by first
  tokens seen (``LoadCounter.queued``), plus other routers' waiting requests as last scraped,
  each counted at the mean work of this router's own;
* ``uncached``: the prompt tokens the pod does not hold (the precise prefix index with recently
  routed blocks, cut where the pod's LRU cache has evicted since, or the approximate one for a
  pod that sends no KV events; ``plugins.prefix_cache``);
* ``reloaded``: the prompt tokens past the GPU match that the pod's CPU offload tier holds
  (``plugins.prefix_cache.offloaded_matches``): vLLM loads them back over PCIe instead of
  computing them, each at ``reloadWork`` of a prefilled token's work (the ratio of the two
  rates), neither free like a GPU hit nor full price like a miss;
* ``copied``: prompt tokens another pod holds and this one would compute again: the capacity a
  new copy of a prefix takes from every later request (the request's own wait for it is already
  in ``uncached``), so a prefix is copied when its home is busy, not when two of its requests
  merely arrive together;
* ``evicted``: cache still in use that storing the uncached tokens would push out: the pod's
  cache is least-recently-used, and past its capacity less its working set (``LoadCounter.room``:
  the distinct prompt tokens this router's requests touched there in the last
  ``workingSetSeconds``, ``kvflow.router.working_set``; reloaded tokens take GPU room too) what it evicts is some later request's
  prefix, computed again. So a new prefix goes where there is room for it, not onto whichever
  pod is idle this instant though it already homes as many prefixes as it holds;
* ``steps``: engine steps the prefill spans (chunked prefill takes ``batchTokens`` a step), each
  costing a fixed ``stepTokens`` plus a token's worth per decoding request in the batch.

In seconds, the work is multiplied by the pool's prefill speed: the median of the seconds per
token of work its pods were observed at (``Flight``: time to first token over the work that was
ahead). The pods of a pool serve one model on like hardware; what tells them apart is their load,
which the work above models. One speed per pod mostly learned that model's errors instead: in a
burst a pod whose requests waited longer than its queue said looked two or three times slower,
was left alone, and got no first token to correct it (bench/RESULTS.md, "The pool's speed"). With
no observation yet, every pod counts the same. The score is ``best / estimate``: 1 for the
soonest pod, half for a pod twice as slow.

So a popular prefix stays on the pods that cache it until their queue costs more than computing
the prefix elsewhere, and then spreads (it is replicated where it lands next); a cold prefix stays
where it is cached, since a short queue there costs less than recomputing it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from operator import add
from dataclasses import dataclass
from typing import Generic

import numpy as np
from pydantic import Field

from kvflow.router.framework import Cycle, Scores
from kvflow.router.load import VECTOR_MIN, Loads, N
from kvflow.router.model import EndpointView
from kvflow.router.per_list import PerList
from kvflow.router.plugins.prefix_cache import offloaded_matches, precise_matches
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


class TtftParams(NoParams):
    decode_tokens: float = Field(default=1.0, alias="decodeTokens", ge=0)
    """A decoding request's share of a step, in prompt tokens of prefill work."""
    batch_tokens: int = Field(default=8192, alias="batchTokens", gt=0)
    """Prompt tokens one engine step prefills (vLLM's ``max_num_batched_tokens``)."""
    copy_weight: float = Field(default=1.0, alias="copyWeight", ge=0)
    """Extra cost per token of a prefix computed again where another pod already holds it: the
    capacity the copy takes from everyone else (its own wait is already in the estimate). On the
    routing benchmark's replay 0.5 did a little better at round-robin's saturation rate and far
    worse past it (bench/RESULTS.md), so 1 stays."""
    evict_weight: float = Field(default=0.5, alias="evictWeight", ge=0)
    """Cost per token of in-use cache a placement evicts: the share of it computed again later
    (0.5: the best of 0.25, 0.5 and 1 on the routing benchmark's replay, ``bench/replay_policy.py``)."""
    reload_work: float = Field(default=0.066, alias="reloadWork", ge=0, le=1)
    """Work per prompt token loaded back from a pod's CPU offload tier, in tokens of prefill
    work: prefill's rate over the PCIe reload's. 0.066 is Llama-3.1-8B on an H100 (25k tokens/s
    of prefill, 128 KiB of KV a token at 50 GB/s: 380k tokens/s; the simulator's h100-llama8b)."""


SPEED_SAMPLE = 64
"""Pods whose speeds a large pool's median is taken over (spread over the pool)."""


def pool_speed(seconds_per_token: Sequence[float] | np.ndarray) -> float:
    """The pool's prefill seconds per token of work: the median of its pods' observed speeds
    (``LoadCounter.seconds_per_token`` of each, in order; over ``SPEED_SAMPLE`` of them, spread
    over a larger pool); 0 while none is observed."""
    sample = seconds_per_token[:: len(seconds_per_token) // SPEED_SAMPLE or 1]
    observed = [s for s in (sample.tolist() if isinstance(sample, np.ndarray) else sample) if s > 0.0]
    return statistics.median(observed) if observed else 0.0


@dataclass(frozen=True, slots=True)
class _Ops(Generic[N]):
    """The two operations ``_estimate`` needs beyond arithmetic, on its kind of numbers."""

    maximum: Callable[[N, N | float], N]
    minimum: Callable[[N, N | float], N]


def _larger(a: float, b: float) -> float:
    return b if b > a else a  # ``max(a, b)``, without the builtin's handling of any iterable


def _smaller(a: float, b: float) -> float:
    return b if b < a else a  # ``min(a, b)``


_ONE_POD: _Ops[float] = _Ops(_larger, _smaller)
_EVERY_POD: _Ops[np.ndarray] = _Ops(np.maximum, np.minimum)


@register("ttft-scorer", "scorer")
class TtftScorer:
    Params = TtftParams
    reads_prefixes = True

    def __init__(self, name: str, params: TtftParams, ctx: PluginContext) -> None:
        self.name = name
        self.ctx = ctx
        self.decode_tokens = params.decode_tokens
        self.batch_tokens = params.batch_tokens
        self.copy_weight = params.copy_weight
        self.evict_weight = params.evict_weight
        self.reload_work = params.reload_work
        self.step_tokens = ctx.step_tokens
        self._positions = PerList(lambda endpoints: {ep.id: i for i, ep in enumerate(endpoints)})
        """Each candidate's place in the list, kept while the same list comes back."""

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> list[float] | np.ndarray:
        """Each pod's estimated time to first token for this request (seconds, or tokens of work),
        in the order of ``endpoints``: ``_estimate`` on each pod's numbers for a few pods, and once
        on whole columns (numpy) for ``VECTOR_MIN`` or more, where a thousand pods cost about
        what a few do."""
        if len(endpoints) >= VECTOR_MIN:
            return self._every_pod(cycle, endpoints, cycle.loads(endpoints).columns)
        return self._one_by_one(cycle, endpoints, cycle.numbers(endpoints))

    def _one_by_one(self, cycle: Cycle, endpoints: Sequence[EndpointView], loads: list[Loads[float]]) -> list[float]:
        spt = pool_speed([c.seconds_per_token for c in loads])
        matches, offloaded = self._matches(cycle, endpoints)
        bs = cycle.block_size
        cached = [matches.get(ep.id, 0) * bs for ep in endpoints]  # prompt tokens each pod holds on its GPU
        reloaded = [offloaded.get(ep.id, 0) * bs for ep in endpoints]  # and on its CPU tier, right after
        best_cached: float = max(map(add, cached, reloaded), default=0)
        mean_work = 0.0
        if any([c.foreign_waiting > 0 for c in loads]):
            mean_work = self._mean_work(sum(c.sent_work for c in loads), sum(c.sent_requests for c in loads), cycle)
        terms = self._terms(cycle, loads[0].default_rate if loads else 0.0, spt, best_cached, mean_work)
        return [self._estimate(_ONE_POD, c, n, r, *terms) for c, n, r in zip(loads, cached, reloaded)]

    def _every_pod(self, cycle: Cycle, endpoints: Sequence[EndpointView], loads: Loads[np.ndarray]) -> np.ndarray:
        spt = pool_speed(loads.seconds_per_token)
        matches, offloaded = self._matches(cycle, endpoints)
        bs = cycle.block_size
        cached, reloaded = np.zeros(len(endpoints)), np.zeros(len(endpoints))
        position = self._positions(endpoints)
        for column, found in ((cached, matches), (reloaded, offloaded)):
            for eid, blocks in found.items():
                i = position.get(eid)
                if i is not None:  # matches may name pods that are not candidates
                    column[i] = blocks * bs
        best_cached = float((cached + reloaded).max(initial=0.0))
        mean_work = 0.0
        if loads.foreign_waiting.any():
            mean_work = self._mean_work(float(loads.sent_work.sum()), float(loads.sent_requests.sum()), cycle)
        terms = self._terms(cycle, float(loads.default_rate[0]), spt, best_cached, mean_work)
        return self._estimate(_EVERY_POD, loads, cached, reloaded, *terms)

    def _matches(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> tuple[dict[EndpointId, int], dict[EndpointId, int]]:
        """Blocks of the prompt each pod holds on its GPU, and right after on its CPU tier."""
        matches = precise_matches(cycle, self.ctx, endpoints) if cycle.hashes.num_blocks else {}
        return matches, offloaded_matches(cycle, self.ctx, endpoints, matches)

    @staticmethod
    def _mean_work(sent_work: float, sent_requests: float, cycle: Cycle) -> float:
        """What other routers' waiting requests (several router replicas) each count: this
        router's mean work."""
        return sent_work / sent_requests if sent_requests else float(cycle.prompt_tokens)

    @staticmethod
    def _terms(cycle: Cycle, default_rate: float, spt: float, best_cached: float,
               mean_work: float) -> tuple[float, float, int, float, float, float]:
        rate = 1.0 / spt if spt > 0.0 else default_rate
        scale = spt if spt > 0.0 else 1.0  # seconds per token of work; in tokens until one is observed
        return cycle.now, rate, cycle.prompt_tokens, best_cached, mean_work, scale

    def _estimate(self, m: _Ops[N], c: Loads[N], cached: N, reloaded: N, now: float, rate: float, prompt: int,
                  best_cached: float, mean_work: float, scale: float) -> N:
        """The estimate of the module's docstring for a pod (``c``: its numbers, floats), or for
        every pod at once (``c``: their columns). ``best_cached``: the most prompt tokens any pod
        holds, GPU and CPU tier together."""
        # what is left of the queue: FIFO work draining since, cut short by first tokens
        drained = c.backlog - (now - c.backlog_at) * rate
        queued = m.maximum(m.minimum(drained, c.sent_work - c.done_work), 0.0)  # 0 with none queued
        uncached = prompt - cached - reloaded
        work = queued + m.maximum(uncached, 1) + self.reload_work * reloaded + c.foreign_waiting * mean_work
        stored = uncached + reloaded  # GPU blocks the request fills: computed or loaded back
        over = m.maximum(stored - c.room, 0.0)  # the in-use tokens its new ones push out
        copy = self.copy_weight * (best_cached - cached - reloaded) + self.evict_weight * m.minimum(over, stored)
        decoding = c.in_flight - c.prefilling + c.foreign_running
        estimate: N = (work + copy + (1 + work // self.batch_tokens) * (self.step_tokens + decoding * self.decode_tokens)) * scale
        return estimate

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Scores:
        estimates = self.estimates(cycle, endpoints)
        if isinstance(estimates, list):
            best = min(estimates, default=0.0)
            return Scores(endpoints, [best / est if est > 0 else 1.0 for est in estimates])
        best = estimates.min(initial=np.inf)
        if (estimates > 0.0).all():  # always, but for a config of zero costs
            return Scores(endpoints, best / estimates)
        return Scores(endpoints, np.divide(best, estimates, out=np.ones_like(estimates), where=estimates > 0.0))
