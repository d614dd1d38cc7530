"""The router's Prometheus metrics and the decision log behind the debug endpoint.

Each Router owns a registry (tests and benchmarks run many routers in one process) of
``kvflow.exposition`` families, the gateway's and the simulator's fast path: an increment on the
request path is an addition on a child looked up once, and a render formats only numbers. The
CLI serves it on ``--metrics-port`` with ``/metrics`` and ``/debug/decisions?n=N``; the gateway
renders its pools' routers on its own ``/metrics`` (``gateway/metrics.py``).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any

from kvflow.exposition import Counter, CounterChild, Gauge, Histogram, HistogramChild, Registry

from kvflow.router.fingerprint import PromptFingerprints
from kvflow.router.model import SchedulingRequest
from kvflow.router.pd import Decision

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    def __init__(self, pool: str) -> None:
        self.registry = r = Registry()
        self.pool = pool
        self.decisions = Counter(
            "kvflow_router_decisions",
            "Scheduling decisions by profile and result",
            ["pool", "profile", "result"],
            registry=r,
        )
        self.latency = Histogram(
            "kvflow_router_scheduling_seconds",
            "Time to take one scheduling decision",
            ["pool", "profile"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvflow_router_prompt_tokens", "Prompt tokens scheduled", ["pool"], registry=r)
        self.cached_tokens = Counter(
            "kvflow_router_cached_tokens", "Prompt tokens the router believed cached on its pick", ["pool"], registry=r
        )
        self.evictions_predicted = Counter(
            "kvflow_router_evictions_predicted",
            "Pods whose reported prefix match a decision cut, the pod's LRU cache having been filled since",
            ["pool"],
            registry=r,
        )
        self.hit_ratio = Gauge(
            "kvflow_router_prefix_hit_ratio", "Cached / prompt tokens over all decisions", ["pool"], registry=r
        )
        self.scores = Gauge(
            "kvflow_router_endpoint_score",
            "Each endpoint's score in the last decision, per scorer",
            ["pool", "endpoint", "scorer"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvflow_router_endpoint_in_flight", "Requests in flight", ["pool", "endpoint"], registry=r
        )
        self.healthy = Gauge("kvflow_router_endpoint_healthy", "1 if routable", ["pool", "endpoint"], registry=r)
        self.ejections = Counter("kvflow_router_ejections", "Pods taken out of rotation for failing requests that "
                                 "others served (passive health)", ["pool", "endpoint"], registry=r)
        self.kv_events = Counter(
            "kvflow_router_kv_events", "KV events applied", ["pool", "endpoint", "type"], registry=r
        )
        self.kv_event_problems = Counter(
            "kvflow_router_kv_event_problems",
            "KV-event batches dropped as malformed (bad_batch) and subscriber restarts (restart)",
            ["pool", "endpoint", "kind"],
            registry=r,
        )
        self.kv_event_lag = Gauge(
            "kvflow_router_kv_event_lag_seconds",
            "From a pod stamping its last KV-event batch to the router applying it",
            ["pool", "endpoint"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "kvflow_router_prefix_index_blocks", "Distinct blocks in a prefix index", ["pool", "index"], registry=r
        )
        self._last: Decision | None = None
        # Labelled children, looked up once: ``labels()`` costs more than the increment.
        self._prompt_child = self.prompt_tokens.labels(pool)
        self._cached_child = self.cached_tokens.labels(pool)
        self.hit_ratio.labels(pool).set_function(self._hit_ratio)
        self.evictions_predicted_child = self.evictions_predicted.labels(pool)
        self._decision_children: dict[tuple[str, str], CounterChild] = {}
        self._latency_children: dict[str, HistogramChild] = {}

    def _hit_ratio(self) -> float:
        prompt = self._prompt_child.value
        return self._cached_child.value / prompt if prompt else 0.0

    def _count(self, profile: str, result: str, seconds: float) -> None:
        child = self._decision_children.get((profile, result))
        if child is None:
            child = self._decision_children[profile, result] = self.decisions.labels(self.pool, profile, result)
        child.inc()
        latency = self._latency_children.get(profile)
        if latency is None:
            latency = self._latency_children[profile] = self.latency.labels(self.pool, profile)
        latency.observe(seconds)

    def decided(self, decision: Decision, seconds: float, prompt_tokens: int) -> None:
        res = decision.result
        self._count(res.profile, "disaggregated" if res.prefill is not None else "aggregated", seconds)
        self._prompt_child.inc(prompt_tokens)
        if res.cached_tokens:
            self._cached_child.inc(res.cached_tokens)
        # Per-endpoint gauges are set when /metrics is read: hundreds of label lookups per
        # decision would cost more than the decision itself.
        self._last = decision

    def flush_scores(self) -> None:
        decision, self._last = self._last, None
        if decision is None:
            return
        for run in decision.runs:
            for eid, per in run.scores.items():
                for scorer, s in per.items():
                    self.scores.labels(self.pool, eid, scorer).set(s)

    def failed(self, profile: str, result: str, seconds: float) -> None:
        self._count(profile, result, seconds)


def _digest(values: Any) -> str:
    """A short fingerprint of a sequence of ints (tokens, block hashes) to compare two routers' views."""
    return hashlib.sha256(",".join(map(str, values)).encode()).hexdigest()[:16]


class DecisionLog:
    """The last N decisions, each with every endpoint's per-scorer scores: 'why that pod?'."""

    def __init__(self, size: int = 100) -> None:
        # Raw records; rendering to JSON-able dicts happens only when someone asks.
        self._entries: deque[
            tuple[float, SchedulingRequest, Decision | None, float, str | None, PromptFingerprints | None]
        ] = deque(maxlen=size)

    def add(
        self,
        request: SchedulingRequest,
        decision: Decision | None,
        seconds: float,
        error: str | None = None,
        hashes: PromptFingerprints | None = None,
    ) -> None:
        self._entries.append((time.time(), request, decision, seconds, error, hashes))

    def last(self, n: int = 10, *, digests: bool = True) -> list[dict[str, Any]]:
        """Newest first; ``digests=False`` leaves out the token and block digests (the status API)."""
        return [render(*entry, digests=digests) for entry in list(self._entries)[-n:][::-1]]


def render(
    when: float,
    request: SchedulingRequest,
    decision: Decision | None,
    seconds: float,
    error: str | None,
    hashes: PromptFingerprints | None = None,
    *,
    digests: bool = True,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "time": when,
        "request_id": request.request_id,
        "model": request.model,
        "lora": request.lora,
        "cache_salt": request.cache_salt,
        "mm_hashes": list(request.mm_hashes),
        "prompt_tokens": len(request.token_ids),
        "micros": round(seconds * 1e6, 1),
    }
    if digests:
        entry["tokens_digest"] = _digest(request.token_ids)
    if digests and hashes is not None:  # what the blocks are keyed on, the same in any router process
        entry["block_hashes_digest"] = hashes.digest()
    if error is not None:
        entry["error"] = error
    if decision is not None:
        res = decision.result
        entry |= {
            "profile": res.profile,
            "targets": [t.id for t in res.targets],
            "prefill": res.prefill.id if res.prefill else None,
            "cached_tokens": res.cached_tokens,
            "runs": [
                {
                    "profile": run.profile,
                    "filters": dict(run.filtered),
                    "endpoints": {
                        eid: {"total": round(run.totals[eid], 4), "scores": {k: round(v, 4) for k, v in s.items()}}
                        for eid, s in run.scores.items()
                    },
                }
                for run in decision.runs
            ],
        }
    return entry
