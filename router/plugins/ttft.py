"""Estimated time to first token: the pod where the request would start answering soonest wins.

One estimate weighs cache against load, in one unit (prompt tokens of prefill work)::

    work(pod) = queued(pod) + uncached(pod) + steps × (stepTokens + decoding(pod) × decodeTokens)

* ``queued``: prefill work already waiting there: this router's requests as a first-in
  first-out queue of uncached tokens draining at the pod's prefill rate, cut short by first
  tokens seen (``LoadCounter.queued``), plus other routers' waiting requests as last scraped,
  each counted at the mean work of this router's own;
* ``uncached``: the prompt tokens the pod does not hold (the precise prefix index with recently
  routed blocks, or the approximate one for a pod that sends no KV events);
* ``steps``: engine steps the prefill spans (chunked prefill takes ``batchTokens`` a step), each
  costing a fixed ``stepTokens`` plus a token's worth per decoding request in the batch.

In seconds, the work is multiplied by the pod's observed seconds per token of work (a slower or
busier-than-it-looks pod shows it in its time to first token; pods not yet observed count at the
pool's median, and with no observation at all every pod counts the same). The score is
``best / estimate``: 1 for the soonest pod, half for a pod twice as slow.

So a popular prefix stays on the pods that cache it until their queue costs more than computing
the prefix elsewhere, and then spreads (it is replicated where it lands next); a cold prefix stays
where it is cached, since a short queue there costs less than recomputing it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from pydantic import Field

from kvflow.endpoints import EndpointId
from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.prefix_cache import precise_matches
from kvflow.router.plugins.registry import NoParams, PluginContext, register


class TtftParams(NoParams):
    decode_tokens: float = Field(default=1.0, alias="decodeTokens", ge=0)
    """A decoding request's share of a step, in prompt tokens of prefill work."""
    batch_tokens: int = Field(default=8192, alias="batchTokens", gt=0)
    """Prompt tokens one engine step prefills (vLLM's ``max_num_batched_tokens``)."""


@register("ttft-scorer", "scorer")
class TtftScorer:
    Params = TtftParams
    reads_prefixes = True

    def __init__(self, name: str, params: TtftParams, ctx: PluginContext) -> None:
        self.name = name
        self.ctx = ctx
        self.decode_tokens = params.decode_tokens
        self.batch_tokens = params.batch_tokens
        self.step_tokens = ctx.step_tokens

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> dict[EndpointId, float]:
        """Each pod's estimated time to first token for this request (seconds, or tokens of work)."""
        prompt = cycle.prompt_tokens
        matches = precise_matches(cycle, self.ctx, endpoints) if cycle.hashes.num_blocks else {}
        mean_work = _mean_work(endpoints, prompt)
        speeds = [ep.counter.seconds_per_token for ep in endpoints if ep.counter.seconds_per_token > 0]
        default_speed = statistics.median(speeds) if speeds else 0.0
        bs, step, per_decode, batch = cycle.block_size, self.step_tokens, self.decode_tokens, self.batch_tokens
        now = cycle.now
        out: dict[EndpointId, float] = {}
        for ep in endpoints:
            counter = ep.counter
            uncached = max(1, prompt - matches.get(ep.id, 0) * bs)
            foreign = ep.foreign_waiting
            work = counter.queued(now) + (foreign * mean_work if foreign else 0.0) + uncached
            steps = 1 + work // batch
            work += steps * (step + ep.decoding * per_decode)
            out[ep.id] = work * (counter.seconds_per_token or default_speed or 1.0 / counter.rate)
        return out

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        estimates = self.estimates(cycle, endpoints)
        cycle.data["ttft"] = estimates
        best = min(estimates.values(), default=0.0)
        return {eid: best / est if est > 0 else 1.0 for eid, est in estimates.items()}


def _mean_work(endpoints: Sequence[EndpointView], fallback: int) -> float:
    """Mean prefill work of the requests this router sent to these pods (``fallback`` before any)."""
    requests = sum(ep.counter.sent_requests for ep in endpoints)
    if not requests:
        return float(fallback)
    return sum(ep.counter.sent_work for ep in endpoints) / requests
