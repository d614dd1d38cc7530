"""``plan(svc, desired, observed) -> Plan``: what to apply and delete this round.

Pure. Its one real decision is the rollout order: when a model or engine change touches both
pools, only the first pool in ``rollout.poolOrder`` gets the new pod template; the other keeps
the template it runs until the first pool is fully updated and available. Within a pool the
Deployment's ``maxUnavailable: 0`` keeps the available replicas from dropping.

It also completes what no renderer can know: the router replicas' shared key, kept from the
cluster's Secret, or the fresh one given for a Secret that has none (``render_peers.keep_key``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from kvflow.operator import names
from kvflow.operator.objects import Obj, key
from kvflow.operator.render_peers import keep_key
from kvflow.operator.render_pools import template_hash, workload_kind
from kvflow.operator.spec import LLMService, PoolRole

Key = tuple[str, str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRollout:
    role: PoolRole
    pending: bool  # its template differs from the desired one
    rolling: bool  # its Deployment has not finished rolling out what it was given
    held: bool  # kept on its old template while an earlier pool rolls


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    apply: list[Obj]
    delete: list[Key]
    pools: dict[PoolRole, PoolRollout]

    @property
    def rolling_pool(self) -> PoolRole | None:
        for pool in self.pools.values():
            if not pool.held and (pool.pending or pool.rolling):
                return pool.role
        return None

    @property
    def settled(self) -> bool:
        return all(not (p.pending or p.rolling or p.held) for p in self.pools.values())


def available(observed: Mapping[str, Any]) -> int:
    """Available replicas of a pool's workload: a Deployment's pods, or a LeaderWorkerSet's ready
    groups (it counts no "available")."""
    status = observed.get("status") or {}
    if observed.get("kind") == "LeaderWorkerSet":
        return int(status.get("readyReplicas", 0))
    return int(status.get("availableReplicas", 0))


def deployment_settled(observed: Mapping[str, Any]) -> bool:
    """Has the workload's controller finished the rollout of its current spec?"""
    spec = observed.get("spec") or {}
    status = observed.get("status") or {}
    meta = observed.get("metadata") or {}
    wanted = int(spec.get("replicas", 1))
    # Older LeaderWorkerSet controllers write no observedGeneration: their counts are all there is.
    seen = status.get("observedGeneration", None if observed.get("kind") == "LeaderWorkerSet" else 0)
    if seen is not None and int(seen) < int(meta.get("generation", 0)):
        return False
    return (int(status.get("updatedReplicas", 0)) >= wanted and available(observed) >= wanted
            and int(status.get("replicas", 0)) <= wanted)


def plan(svc: LLMService, desired: list[Obj], observed: Mapping[Key, Obj],
         scale: Mapping[PoolRole, int] | None = None, *, fresh_key: str | None = None) -> Plan:
    """Decide the objects to apply (amended for rollout order and scale) and to delete.

    ``observed`` holds the children that exist now and are owned by ``svc``; ``scale`` holds
    the operator-autoscaler's replica decisions, if it manages the pools; ``fresh_key`` is the
    router replicas' key should their Secret hold none yet (``render_peers.new_key``).
    """
    scale = scale or {}
    apply = [copy.deepcopy(obj) for obj in desired]
    keep_key(apply, observed, fresh_key)
    by_key = {key(obj): obj for obj in apply}
    pools: dict[PoolRole, PoolRollout] = {}
    blocked = False
    for role in rollout_order(svc):
        dkey = (*workload_kind(svc, role), names.child_name(svc, role))
        want = by_key.get(dkey)
        have = observed.get(dkey)
        if want is None:
            continue
        pending = have is not None and template_hash(have) != template_hash(want)
        rolling = have is not None and not pending and not deployment_settled(have)
        held = blocked and pending
        if held:
            assert have is not None
            _hold_template(want, have)
        if pending or rolling:
            blocked = True
        _set_replicas(svc, role, want, have, scale)
        pools[role] = PoolRollout(role=role, pending=pending, rolling=rolling, held=held)
    wanted_keys = set(by_key)
    delete = sorted(k for k in observed if k not in wanted_keys and k[1] != "Pod")
    return Plan(apply=apply, delete=delete, pools=pools)


def rollout_order(svc: LLMService) -> list[PoolRole]:
    """The rendered pools in ``rollout.poolOrder`` (an aggregated service has one)."""
    roles = svc.spec.roles
    return [role for name in svc.spec.rollout.pool_order for role in roles if svc.spec.section_name(role) == name]


def _hold_template(want: Obj, have: Mapping[str, Any]) -> None:
    field = "leaderWorkerTemplate" if want["kind"] == "LeaderWorkerSet" else "template"
    want["spec"][field] = copy.deepcopy(have["spec"][field])
    annotations = want["metadata"].setdefault("annotations", {})
    annotations[names.ANNOTATION_TEMPLATE_HASH] = template_hash(have)


def _set_replicas(svc: LLMService, role: PoolRole, want: Obj, have: Mapping[str, Any] | None,
                  scale: Mapping[PoolRole, int]) -> None:
    if svc.spec.autoscaling.mode != "operator":
        return
    bounds = svc.spec.pool(role).autoscaling
    if role in scale:
        replicas = scale[role]
    elif have is not None and "replicas" in (have.get("spec") or {}):
        replicas = int(have["spec"]["replicas"])
    else:
        return
    if bounds is not None:
        replicas = max(bounds.min_replicas, min(replicas, bounds.max_replicas))
    want["spec"]["replicas"] = replicas
