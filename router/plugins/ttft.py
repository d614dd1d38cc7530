"""Estimated time to first token: the pod where the request would start answering soonest wins.

One estimate weighs cache against load, in one unit (prompt tokens of prefill work)::

    work(pod) = queued(pod) + uncached(pod) + copyWeight × copied(pod) + evictWeight × evicted(pod)
              + steps × (stepTokens + decoding(pod) × decodeTokens)

* ``queued``: prefill work already waiting there: this router's requests as a first-in
  first-out queue of uncached tokens draining at the pod's prefill rate, cut short by first
  tokens seen (``LoadCounter.queued``), plus other routers' waiting requests as last scraped,
  each counted at the mean work of this router's own;
* ``uncached``: the prompt tokens the pod does not hold (the precise prefix index with recently
  routed blocks, or the approximate one for a pod that sends no KV events);
* ``copied``: prompt tokens another pod holds and this one would compute again: the capacity a
  new copy of a prefix takes from every later request (the request's own wait for it is already
  in ``uncached``), so a prefix is copied when its home is busy, not when two of its requests
  merely arrive together;
* ``evicted``: cache still in use that storing the uncached tokens would push out: the pod's
  cache is least-recently-used, and past its capacity less its working set (``LoadCounter.room``:
  the distinct prompt tokens this router's requests touched there in the last
  ``workingSetSeconds``, ``kvflow.router.working_set``) what it evicts is some later request's
  prefix, computed again. So a new prefix goes where there is room for it, not onto whichever
  pod is idle this instant though it already homes as many prefixes as it holds;
* ``steps``: engine steps the prefill spans (chunked prefill takes ``batchTokens`` a step), each
  costing a fixed ``stepTokens`` plus a token's worth per decoding request in the batch.

In seconds, the work is multiplied by the pool's prefill speed: the median of the seconds per
token of work its pods were observed at (``Flight``: time to first token over the work that was
ahead). The pods of a pool serve one model on like hardware; what tells them apart is their load,
which the work above models. One speed per pod mostly learned that model's errors instead: in a
burst a pod whose requests waited longer than its queue said looked two or three times slower,
was left alone, and got no first token to correct it (docs/router.md, "The pool's speed"). With
no observation yet, every pod counts the same. The score is ``best / estimate``: 1 for the
soonest pod, half for a pod twice as slow.

So a popular prefix stays on the pods that cache it until their queue costs more than computing
the prefix elsewhere, and then spreads (it is replicated where it lands next); a cold prefix stays
where it is cached, since a short queue there costs less than recomputing it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import Field

from kvflow.router.framework import Cycle, Scores
from kvflow.router.model import EndpointView
from kvflow.router.plugins.prefix_cache import precise_matches
from kvflow.router.plugins.registry import NoParams, PluginContext, register


class TtftParams(NoParams):
    decode_tokens: float = Field(default=1.0, alias="decodeTokens", ge=0)
    """A decoding request's share of a step, in prompt tokens of prefill work."""
    batch_tokens: int = Field(default=8192, alias="batchTokens", gt=0)
    """Prompt tokens one engine step prefills (vLLM's ``max_num_batched_tokens``)."""
    copy_weight: float = Field(default=1.0, alias="copyWeight", ge=0)
    """Extra cost per token of a prefix computed again where another pod already holds it: the
    capacity the copy takes from everyone else (its own wait is already in the estimate). On the
    routing benchmark's replay 0.5 did a little better at round-robin's saturation rate and far
    worse past it (docs/router.md), so 1 stays."""
    evict_weight: float = Field(default=0.5, alias="evictWeight", ge=0)
    """Cost per token of in-use cache a placement evicts: the share of it computed again later
    (0.5, measured on the routing benchmark's replay over five seeds; 1 and 0.25 did worse)."""


SPEED_SAMPLE = 64
"""Pods whose speeds a large pool's median is taken over (spread over the pool)."""


def pool_speed(endpoints: Sequence[EndpointView]) -> float:
    """The pool's prefill seconds per token of work: the median of its pods' observed speeds
    (over ``SPEED_SAMPLE`` of them, spread over a larger pool); 0 while none is observed."""
    step = len(endpoints) // SPEED_SAMPLE or 1
    observed = [s for ep in endpoints[::step] if (s := ep.counter.seconds_per_token) > 0.0]
    return statistics.median(observed) if observed else 0.0


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
        self.step_tokens = ctx.step_tokens

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> list[float]:
        """Each pod's estimated time to first token for this request (seconds, or tokens of work),
        in the order of ``endpoints``.

        The arithmetic is inlined, in one pass: this runs for every endpoint of every decision,
        and a thousand pods must cost well under a millisecond. Other routers' waiting requests
        (rare: several router replicas) are filled in after it, once the mean work per request
        is known."""
        spt = pool_speed(endpoints)
        rate = 1.0 / spt if spt > 0.0 else endpoints[0].counter.default_rate if endpoints else 0.0
        scale = spt if spt > 0.0 else 1.0  # seconds per token of work; in tokens until one is observed
        prompt = cycle.prompt_tokens
        matches = precise_matches(cycle, self.ctx, endpoints) if cycle.hashes.num_blocks else {}
        held = matches.get
        bs, now = cycle.block_size, cycle.now
        best_cached = 0
        if matches:
            candidates = {ep.id for ep in endpoints}
            best_cached = max((n for eid, n in matches.items() if eid in candidates), default=0) * bs
        step, per_decode, batch, copy_weight = self.step_tokens, self.decode_tokens, self.batch_tokens, self.copy_weight
        evict_weight = self.evict_weight
        estimates: list[float] = []
        foreign: list[tuple[int, float, float, int, int]] = []
        for ep in endpoints:
            c = ep.counter
            queued = c.backlog  # what is left of it: FIFO work draining since, cut short by first tokens
            if queued:
                queued -= (now - c.backlog_at) * rate
                known = c.sent_work - c.done_work
                if known < queued:
                    queued = known
                if queued < 0.0:
                    queued = 0.0
            cached = held(ep.id, 0) * bs
            uncached = prompt - cached
            work = queued + (uncached if uncached > 1 else 1)
            copy = copy_weight * (best_cached - cached)
            over = uncached - c.room  # the in-use tokens its new ones push out
            if over > 0.0:
                copy += evict_weight * (over if over < uncached else uncached)
            decoding = c.in_flight - c.prefilling + c.foreign_running
            if c.foreign_waiting:
                foreign.append((len(estimates), work, copy, decoding, c.foreign_waiting))
            estimates.append((work + copy + (1 + work // batch) * (step + decoding * per_decode)) * scale)
        if foreign:
            sent = sum(ep.counter.sent_requests for ep in endpoints)
            mean_work = sum(ep.counter.sent_work for ep in endpoints) / sent if sent else float(prompt)
            for i, work, copy, decoding, waiting in foreign:
                work += waiting * mean_work
                estimates[i] = (work + copy + (1 + work // batch) * (step + decoding * per_decode)) * scale
        return estimates

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Scores:
        estimates = self.estimates(cycle, endpoints)
        best = min(estimates, default=0.0)
        return Scores(endpoints, [best / est if est > 0 else 1.0 for est in estimates])
