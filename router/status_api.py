"""kvflow's status API: what the gateway and its routers know, as one JSON document.

``GET /v1/kvflow/status`` (the gateway, and ``kvflow router`` on its metrics port) answers
``status_document``; the status page (``kvflow.router.dashboard``) and ``kvflow status`` read
it and nothing else. It is a view of state the router and the gateway already hold: the pool's
endpoints as the router's datastore has them, its decision log, the admission gate's queue, the
Batch API's active batches, and per pod the few sums (requests, errors, TTFT, ITL) the gateway
adds up as it writes its access log. A reader takes rates and means from the difference of two
documents. No prompt text is in it: a decision names its request by id and counts tokens.

Shape (``"kvflow_status": 1``)::

    {"kvflow_status": 1, "source": "gateway" | "router", "time": <unix s>,
     "models": [{"model", "loras", "profile", "pd": {"enabled", "threshold"},
                 "admission": {"in_flight", "queued"} | null,
                 "pods": [{"id", "role", "healthy", "in_flight", "running", "waiting", "kv_usage",
                           "prefix_hit_rate", "loras", "last_scrape_s", "kv_events": {"age_s", "lag_s"} | null,
                           "served": {"requests", "errors", "ttft_sum_s", "ttft_count", "itl_sum_s", "itl_count"}}],
                 "decisions": [{"time", "request_id", "profile", "mode", "pick", "prefill", "prompt_tokens",
                                "cached_tokens", "micros", "reason", "error",
                                "candidates": [{"id", "role", "total", "scores", "picked"}]}]}],
     "batches": [{"id", "status", "endpoint", "total", "completed", "failed", "created_at"}]}

When the gateway authenticates, only a key with ``admin: true`` may read it (``check_admin``):
the document names every pod and every key's batches.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.errors import AuthenticationError
from kvflow.router.router import Router

STATUS_PATH = "/v1/kvflow/status"
DASHBOARD_PATH = "/dashboard"
VERSION = 1
DECISIONS = 10
"""Decisions per pool in one document (the router's log holds the last 100)."""


class AdminKeyRequired(AuthenticationError):
    """A valid key that is not an admin's (403, as OpenAI's PermissionDeniedError)."""

    status = 403
    type = "PermissionDeniedError"


class LoginRequired(AuthenticationError):
    """No key or a wrong one, on the page: a browser asks for it (HTTP Basic, the key as password)."""

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Basic realm="kvflow status (user: any, password: an admin API key)"'}


class Key(Protocol):
    @property
    def admin(self) -> bool: ...


class Checker(Protocol):
    @property
    def enabled(self) -> bool: ...

    def check(self, authorization: str | None) -> Key: ...


def bearer(authorization: str | None) -> str | None:
    """``Basic`` credentials (a browser's login prompt: any user name, the key as password) as
    the ``Bearer`` header the authenticator reads; anything else unchanged."""
    if authorization is None:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return authorization
    try:
        _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return f"Bearer {password}"


def check_admin(auth: Checker, authorization: str | None, *, login: bool = False) -> None:
    """Nothing on an open gateway; else the key must be valid (401) and an admin's (403).
    ``login``: a 401 asks the browser for the key (the page; the API answers plain JSON)."""
    if not auth.enabled:
        return
    try:
        key = auth.check(bearer(authorization))
    except AuthenticationError as exc:
        if login:
            raise LoginRequired(exc.message) from None
        raise
    if not key.admin:
        raise AdminKeyRequired("the status API and page need an admin key (admin: true in the key file)")


# --- what the gateway adds up per pod ------------------------------------------------------


@dataclass(slots=True)
class Served:
    """Sums over the requests one pod answered: a reader differences two documents for rates."""

    requests: int = 0
    errors: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "ttft_sum_s": round(self.ttft_sum, 6),
                "ttft_count": self.ttft_count, "itl_sum_s": round(self.itl_sum, 6), "itl_count": self.itl_count}


MAX_PODS = 4096
"""Pods with sums kept; past it the longest-known is forgotten (pods come and go with rollouts)."""


class PodStats:
    """Per pod ``Served`` sums, one table per gateway (``Gateway.pod_stats``)."""

    def __init__(self) -> None:
        self.pods: dict[str, Served] = {}

    def observe(self, pod: str, status: int, first_token: float | None, gaps: Sequence[float]) -> None:
        served = self.pods.get(pod)
        if served is None:
            if len(self.pods) >= MAX_PODS:
                del self.pods[next(iter(self.pods))]
            served = self.pods[pod] = Served()
        served.requests += 1
        if status >= 400:
            served.errors += 1
        if first_token is not None:
            served.ttft_sum += first_token
            served.ttft_count += 1
            if gaps:
                served.itl_sum += sum(gaps)
                served.itl_count += len(gaps)


# --- the document -----------------------------------------------------------------------------


def pool_status(model: str, router: object, *, admission: tuple[int, int] | None = None,
                stats: PodStats | None = None, loras: Iterable[str] = (), now: float | None = None,
                decisions: int = DECISIONS) -> dict[str, Any]:
    """One pool as the status document shows it. A router that is not kvflow's (a test's
    stand-in) shows only its endpoints."""
    wall = time.time() if now is None else now
    entry: dict[str, Any] = {
        "model": model, "loras": sorted(loras), "profile": None, "pd": None,
        "admission": None if admission is None else {"in_flight": admission[0], "queued": admission[1]},
        "pods": [], "decisions": [],
    }
    if not isinstance(router, Router):
        for ep in getattr(router, "endpoints", ()):
            entry["pods"].append(_pod_basic(ep.id, str(ep.role), stats))
        return entry
    entry["profile"] = router.profile
    entry["pd"] = {"enabled": router.policy.enabled, "threshold": router.policy.threshold}
    mono = time.monotonic()
    kv_heard = router.kv_heard()
    for view in router.datastore.snapshot():
        m = view.metrics
        last = router.datastore.last_scrape(view.id)
        heard = kv_heard.get(view.id)
        pod = _pod_basic(view.id, str(view.endpoint.role), stats)
        pod |= {
            "healthy": view.healthy, "in_flight": view.in_flight, "running": m.running, "waiting": m.waiting,
            "kv_usage": round(m.kv_usage, 4),
            "prefix_hit_rate": round(m.prefix_hits / m.prefix_queries, 4) if m.prefix_queries else None,
            "loras": sorted((view.adapters or frozenset()) | m.running_loras | m.waiting_loras),
            "last_scrape_s": None if last is None else round(mono - last, 3),
            "kv_events": None if heard is None else {
                "age_s": round(wall - heard[0], 3), "lag_s": None if heard[1] is None else round(heard[1], 4)},
        }
        entry["pods"].append(pod)
    roles = {str(ep.id): str(ep.role) for ep in router.endpoints}
    entry["decisions"] = [explain(d, roles, router.policy.threshold) for d in router.log.last(decisions, digests=False)]
    return entry


def _pod_basic(pod_id: str, role: str, stats: PodStats | None) -> dict[str, Any]:
    served = stats.pods.get(pod_id) if stats is not None else None
    return {"id": pod_id, "role": role, "healthy": None, "in_flight": None, "running": None, "waiting": None,
            "kv_usage": None, "prefix_hit_rate": None, "loras": [], "last_scrape_s": None, "kv_events": None,
            "served": (served or Served()).as_json() if stats is not None else None}


def status_document(source: str, pools: Sequence[dict[str, Any]], batches: Sequence[dict[str, Any]] = (),
                    now: float | None = None) -> dict[str, Any]:
    return {"kvflow_status": VERSION, "source": source, "time": round(time.time() if now is None else now, 3),
            "models": list(pools), "batches": list(batches)}


# --- a decision, explained ----------------------------------------------------------------------


def explain(entry: Mapping[str, Any], roles: Mapping[str, str], threshold: int) -> dict[str, Any]:
    """A decision-log entry (``kvflow.router.observability.render``) with its candidates and a
    sentence saying why the pick won: the filters' cuts, the winning total and its scorers, the
    cache hit, and why it went P/D or stayed aggregated."""
    targets: list[str] = list(entry.get("targets") or [])
    prefill = entry.get("prefill")
    pick = targets[0] if targets else None
    out: dict[str, Any] = {
        "time": entry.get("time"), "request_id": entry.get("request_id"), "profile": entry.get("profile"),
        "mode": None if pick is None else ("pd" if prefill else "aggregated"), "pick": pick, "prefill": prefill,
        "prompt_tokens": entry.get("prompt_tokens", 0), "cached_tokens": entry.get("cached_tokens", 0),
        "micros": entry.get("micros"), "error": entry.get("error"), "candidates": [], "reason": "",
    }
    runs: list[Mapping[str, Any]] = list(entry.get("runs") or [])
    for i, run in enumerate(runs):
        chosen = prefill if i == 1 else pick
        ranked = sorted(run.get("endpoints", {}).items(), key=lambda kv: (kv[0] != chosen, -kv[1]["total"]))
        for eid, score in ranked:
            out["candidates"].append({"id": eid, "role": roles.get(eid, "?"), "leg": "prefill" if i else "decode",
                                      "total": score["total"], "scores": score["scores"], "picked": eid == chosen})
    decoders = sum(1 for r in roles.values() if r != "prefill")
    out["reason"] = _reason(out, runs, decoders, threshold, "prefill" in roles.values())
    return out


def _reason(d: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], pods: int, threshold: int,
            has_prefill: bool) -> str:
    """``pods``: the pods that can decode (the first leg's candidates before any filter)."""
    if d["pick"] is None:
        return f"not routed: {d['error'] or 'no decision'}"
    parts: list[str] = []
    decode = [c for c in d["candidates"] if c["leg"] == "decode"]
    chosen = next((c for c in decode if c["picked"]), None)
    cuts, before = [], pods
    for name, left in ((runs[0].get("filters") or {}) if runs else {}).items():
        if left < before:
            cuts.append(f"{name} removed {before - left}")
        before = left
    head = f"{d['pick']} picked"
    if chosen is not None and len(decode) > 1:
        runner_up = max((c["total"] for c in decode if not c["picked"]), default=0.0)
        top = sorted(chosen["scores"].items(), key=lambda kv: -kv[1])[:3]
        versus = "tied with" if chosen["total"] <= runner_up else "against"
        head += (f": total {chosen['total']:.3f} {versus} {runner_up:.3f} for the next of {len(decode)} candidates"
                 + (f" ({', '.join(f'{k} {v:.2f}' for k, v in top)})" if top else ""))
    elif len(decode) == 1:
        head += ": the only candidate"
    parts.append(head)
    if cuts:
        parts.append("filtered: " + ", ".join(cuts))
    cached, prompt = d["cached_tokens"], d["prompt_tokens"]
    parts.append(f"cache hit of {cached} of {prompt} prompt tokens" if cached else "no cached prefix")
    uncached = prompt - cached
    if d["prefill"]:
        parts.append(f"P/D: {uncached} uncached tokens exceed the threshold {threshold}, prefill on {d['prefill']}")
    elif not has_prefill:
        parts.append("aggregated: the pool has no prefill pods")
    elif uncached > threshold:
        parts.append(f"aggregated: {uncached} uncached tokens exceed the P/D threshold {threshold}, "
                     "but no prefill pod could take it")
    else:
        parts.append(f"aggregated: {uncached} uncached tokens, at most the P/D threshold {threshold}")
    return "; ".join(parts)


# --- batches ----------------------------------------------------------------------------------


async def active_batches(service: Any) -> list[dict[str, Any]]:
    """The Batch API's active batches (``kvflow.gateway.batch.service.BatchService``, once its
    store is open; none before any batch was made)."""
    store = getattr(service, "store", None)
    if store is None:
        return []
    return batch_rows(await store.run(store.store.active))


def batch_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    """Active batches (``kvflow.gateway.batch.states.BatchRecord``) with their progress."""
    return [{"id": r.id, "status": str(r.status),
             "endpoint": r.endpoint, "total": r.total, "completed": r.completed, "failed": r.failed,
             "created_at": r.created_at} for r in records]
