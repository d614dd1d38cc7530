"""Pure status computation: conditions, phase, pool counters and the events of a transition."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvflow.operator import names
from kvflow.operator.health import Problem, summary
from kvflow.operator.plan import Key, Plan, available
from kvflow.operator.render_pools import pool_replicas, rendered_roles, workload_kind
from kvflow.operator.spec import LLMService, PoolRole

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"]
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "MetricsReachable", "AggregatedPoolReady",
                   "PrefillPoolReady", "DecodePoolReady")


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def pool_counts(svc: LLMService, role: PoolRole, observed: Mapping[Key, Any]) -> dict[str, Any]:
    have = observed.get((*workload_kind(svc, role), names.child_name(svc, role))) or {}
    spec, status = have.get("spec") or {}, have.get("status") or {}
    desired = int(spec.get("replicas", pool_replicas(svc, role) or 0))
    ready = int(status.get("readyReplicas", 0))
    return {
        "role": role, "desired": desired, "ready": ready,
        "updated": int(status.get("updatedReplicas", 0)),
        "available": available(have),
        "summary": f"{ready}/{desired}",
    }


POOL_CONDITION = {"prefill": "PrefillPoolReady", "decode": "DecodePoolReady", "both": "AggregatedPoolReady"}


def _pool_condition(role: PoolRole, counts: Mapping[str, Any], problems: Sequence[Problem], stuck: str | None,
                    generation: int, now: str, previous: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One pool's condition: ready, or why not (image pull, crash loop, unschedulable, stuck engine)."""
    component = names.component_label(role)
    mine = [p for p in problems if p.component == component]
    ready = counts["ready"] >= counts["desired"] and counts["available"] >= counts["desired"]
    if mine:
        reason, message = mine[0].reason, "; ".join(p.describe() for p in mine)
    elif stuck:
        reason, message = "StuckEngine", stuck
    elif counts["desired"] == 0:
        reason, message = "ScaledToZero", f"{component} pool has no replicas (the gateway holds requests)"
    elif ready:
        reason, message = "Ready", f"{component} pool {counts['summary']} ready"
    else:
        reason, message = "Starting", f"{component} pool {counts['summary']} ready"
    return _condition(POOL_CONDITION[role], ready and not mine, reason, message, generation, now, previous)


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int, now: str,
               previous: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    status = "True" if ok else "False"
    since = now
    for old in previous:
        if old.get("type") == kind and old.get("status") == status and old.get("lastTransitionTime"):
            since = old["lastTransitionTime"]
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def compute(svc: LLMService, plan: Plan, observed: Mapping[Key, Any], *, now: str,
            previous: Mapping[str, Any], error: str | None = None, problems: Sequence[Problem] = (),
            unreachable: Mapping[PoolRole, int] | None = None,
            stuck: Mapping[PoolRole, str] | None = None) -> dict[str, Any]:
    """The status after a reconcile round.

    ``error`` is an apply failure, if any; ``problems`` are pods that will not come up by
    themselves (image pulls, crash loops, unschedulable, a rollout past its deadline); both make
    the service ``Degraded``, with a message that names the pool and the reason.
    ``unreachable`` holds the pools whose pods the operator could not scrape (rounds in a row);
    ``stuck`` what the operator found of stuck engines this round, per pool.
    """
    pools = {role: pool_counts(svc, role, observed) for role in rendered_roles(svc)}
    all_ready = all(p["ready"] >= p["desired"] and p["available"] >= p["desired"] for p in pools.values())
    rolling = plan.rolling_pool
    progressing = rolling is not None or not all_ready
    diagnosis = summary(problems)
    if error or diagnosis:
        phase: Phase = "Degraded"
    elif rolling is not None:
        phase = "Progressing"
    elif all_ready:
        phase = "Ready"
    else:
        phase = "Pending" if all(p["ready"] == 0 for p in pools.values()) else "Progressing"
    prev_conditions = previous.get("conditions") or []
    if rolling is not None:
        held = [p.role for p in plan.pools.values() if p.held]
        progress_msg = f"rolling out pool {rolling}" + (f"; {', '.join(held)} waits" if held else "")
    else:
        progress_msg = "waiting for replicas to become ready" if progressing else "all pools up to date"
    ready_msg = ", ".join(f"{names.component_label(role)} {p['summary']}" for role, p in pools.items())
    conditions = [
        _condition("Ready", all_ready and not error, "PoolsReady" if all_ready else "PoolsNotReady",
                   ready_msg, svc.generation, now, prev_conditions),
        _condition("Progressing", progressing, "RollingOut" if rolling else (
            "ScalingUp" if progressing else "Complete"), progress_msg, svc.generation, now, prev_conditions),
        _degraded(error, diagnosis, svc.generation, now, prev_conditions),
    ]
    conditions += [_pool_condition(role, counts, problems, (stuck or {}).get(role), svc.generation, now,
                                   prev_conditions) for role, counts in pools.items()]
    if svc.spec.lifecycle.stuck_detection or svc.spec.autoscaling.mode == "operator":
        conditions.append(_reachable(unreachable or {}, svc.generation, now, prev_conditions))
    out: dict[str, Any] = {
        "observedGeneration": svc.generation,
        "phase": phase,
        "model": svc.spec.model.name,
        "profile": svc.spec.routing.profile_name,
        "mode": "disaggregated" if svc.spec.disaggregated else "aggregated",
        "conditions": conditions,
        "rollout": {"pool": rolling, "held": [p.role for p in plan.pools.values() if p.held]},
        "pools": {names.component_label(role): counts for role, counts in pools.items()},
        "ready": ready_msg,  # the printer column: "aggregated 2/2" or "prefill 1/1, decode 2/2"
    }
    if svc.spec.gateway.mode == "standalone":
        out["gatewayURL"] = (f"http://{names.child_name(svc, 'gateway')}.{svc.namespace}.svc:"
                             f"{svc.spec.gateway.port}")
    return out


def _degraded(error: str | None, diagnosis: tuple[str, str] | None, generation: int, now: str,
              previous: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if error:
        reason, message = "ApplyFailed", error + (f"; {diagnosis[1]}" if diagnosis else "")
    elif diagnosis:
        reason, message = diagnosis
    else:
        reason, message = "AsExpected", "children applied"
    return _condition("Degraded", bool(error or diagnosis), reason, message, generation, now, previous)


def _reachable(unreachable: Mapping[PoolRole, int], generation: int, now: str,
               previous: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if not unreachable:
        return _condition("MetricsReachable", True, "Scraped", "the operator reads every engine's /metrics",
                          generation, now, previous)
    pools = " and ".join(f"{role} pool" for role in sorted(unreachable))
    return _condition("MetricsReachable", False, "ScrapeFailed",
                      f"no pod of the {pools} answered /metrics for {max(unreachable.values())} rounds: "
                      "stuck-engine replacement and queue-depth scaling are off for it (does a NetworkPolicy "
                      "keep the operator out?)", generation, now, previous)


def invalid(generation: int, message: str, *, now: str, previous: Mapping[str, Any]) -> dict[str, Any]:
    """The status of an object whose spec cannot be rendered: nothing was applied."""
    prev = previous.get("conditions") or []
    return {
        "observedGeneration": generation,
        "phase": "Invalid",
        "conditions": [
            _condition("Ready", False, "InvalidSpec", message, generation, now, prev),
            _condition("Progressing", False, "InvalidSpec", "nothing applied until the spec is fixed",
                       generation, now, prev),
            _condition("Degraded", True, "InvalidSpec", message, generation, now, prev),
        ],
    }


def transition_events(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[Event]:
    """Kubernetes Events worth emitting when the status moves from ``previous`` to ``current``."""
    old_phase, new_phase = previous.get("phase"), current.get("phase")
    old_pool = (previous.get("rollout") or {}).get("pool")
    new_pool = (current.get("rollout") or {}).get("pool")
    events: list[Event] = []
    if new_pool and new_pool != old_pool:
        events.append(Event("Normal", "RolloutStarted", f"rolling out the {new_pool} pool"))
    if old_pool and not new_pool and new_phase != "Degraded":
        events.append(Event("Normal", "RolloutFinished", f"the {old_pool} pool is up to date"))
    if new_phase != old_phase:
        if new_phase == "Ready":
            events.append(Event("Normal", "Ready", "all pools are ready"))
        elif new_phase in ("Degraded", "Invalid"):
            message = next((c["message"] for c in current.get("conditions", []) if c["type"] == "Degraded"), "")
            events.append(Event("Warning", new_phase, message))
    return events
