"""One reconcile round of one LLMService: observe, decide (pure), act, report.

The kopf handlers call ``reconcile`` from ``on.create``/``on.update``/``on.resume`` (spec
changes, immediately) and from a timer (lifecycle duties: stuck engines, queue-depth scaling,
continuing a pool-by-pool rollout). A round never raises for a bad spec or a failing API call:
both end up in the status, and the next timer tick tries again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvflow.operator import adapters, health, lifecycle, names, render_peers, scrape
from kvflow.operator import status as status_mod
from kvflow.operator.kube import ApiError, KubeClient
from kvflow.operator.objects import APPLY_ORDER, RESOURCES, Obj, content_hash, key
from kvflow.operator.plan import Key, plan
from kvflow.operator.render import render
from kvflow.operator.render_pools import rendered_roles, workload_kind
from kvflow.operator.spec import InvalidSpecError, LLMService, PoolRole, parse
from kvflow.operator.status import Event
from kvflow.protocol.vllm_metrics import EngineMetrics

OPTIONAL_KINDS = {"InferencePool": "Gateway API Inference Extension CRDs (InferencePool v1)",
                  "HTTPRoute": "Gateway API CRDs (HTTPRoute v1)", "ScaledObject": "KEDA",
                  "LeaderWorkerSet": "LeaderWorkerSet CRDs (leaderworkerset.x-k8s.io/v1)"}


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorConfig:
    interval: float = 15.0  # seconds between lifecycle rounds
    scrape_timeout: float = 3.0
    images: names.Images = dataclasses.field(default_factory=names.Images)
    server: str | None = None  # explicit API URL (development, tests); else in-cluster/kubeconfig
    user_agent: str = "kvflow-operator"  # with leader election, plus the replica's identity
    # Timer rounds re-apply only children whose rendering changed; every resync_seconds they
    # re-apply everything, which also undoes edits others made to fields the operator owns.
    resync_seconds: float = 300.0
    # Stuck engines are evicted at most this many times per window, over all LLMServices: a
    # cluster-wide fault (a bad driver, a metrics bug) must not cycle every engine at once.
    eviction_budget: int = 3
    eviction_window: float = 600.0
    # Rounds in a row a pool's pods must fail to answer /metrics before the status says so.
    unreachable_rounds: int = 2


def wall_time() -> str:
    """Now, as Kubernetes writes condition timestamps."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class Runtime:
    """Per-process state of the operator: the client, scrape histories, per-object locks.

    Every duration the reconcile path measures comes from ``clock`` (monotonic seconds), and
    every timestamp it writes from ``wall``: tests can run the operator's time faster than the
    wall's, and nothing on the reconcile path reads a clock of its own.
    """

    config: OperatorConfig
    client: KubeClient | None = None
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], str] = wall_time
    histories: dict[tuple[str, str], list[lifecycle.Sample]] = dataclasses.field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    last_full_apply: dict[str, float] = dataclasses.field(default_factory=dict)
    evictions: list[float] = dataclasses.field(default_factory=list)  # when, over all services
    recommendations: dict[tuple[str, PoolRole], list[tuple[float, int]]] = dataclasses.field(default_factory=dict)
    unreachable: dict[tuple[str, PoolRole], int] = dataclasses.field(default_factory=dict)  # rounds in a row

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def resync_due(self, uid: str) -> bool:
        return self.clock() - self.last_full_apply.get(uid, float("-inf")) >= self.config.resync_seconds

    def resynced(self, uid: str) -> None:
        self.last_full_apply[uid] = self.clock()


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    status: dict[str, Any]
    events: list[Event]


def applied_hash(obj: Mapping[str, Any] | None) -> str | None:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    value = annotations.get(names.ANNOTATION_APPLIED_HASH)
    return value if isinstance(value, str) else None


def stamp_applied_hash(obj: Obj) -> None:
    """Record what was applied, so a later round can tell an unchanged child without a diff."""
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(names.ANNOTATION_APPLIED_HASH, None)
    annotations[names.ANNOTATION_APPLIED_HASH] = content_hash(obj)


async def observe(client: KubeClient, svc: LLMService) -> dict[Key, Obj]:
    """The children that exist now and that this LLMService owns (by label and owner uid).

    Secrets are read by name, never listed: the one an LLMService has is its routers' key
    (``render_peers.py``), and the operator holds ``get`` on Secrets, not ``list``, so that it
    cannot enumerate what it was never given."""
    selector = {names.LABEL_SERVICE: svc.name, "app.kubernetes.io/managed-by": names.FIELD_MANAGER}
    kinds = [(api, kind) for (api, kind) in RESOURCES if kind in APPLY_ORDER and kind != "Secret"]
    found: list[Obj] = []
    for api_version, kind in kinds:
        if kind in OPTIONAL_KINDS and not await client.has_api(api_version, kind):
            continue
        found += await client.list(api_version, kind, svc.namespace, selector)
    secret = await client.get("v1", "Secret", svc.namespace, render_peers.secret_name(svc))
    if secret is not None:
        found.append({"apiVersion": "v1", "kind": "Secret", **secret})
    out: dict[Key, Obj] = {}
    for item in found:
        meta = item.get("metadata") or {}
        labels = meta.get("labels") or {}
        owners = meta.get("ownerReferences") or []
        if all(labels.get(k) == v for k, v in selector.items()) and any(ref.get("uid") == svc.uid for ref in owners):
            out[key(item)] = item
    return out


async def missing_apis(client: KubeClient, desired: list[Obj]) -> list[str]:
    wanted = sorted({(o["apiVersion"], o["kind"]) for o in desired if o["kind"] in OPTIONAL_KINDS})
    return [f"{kind} ({OPTIONAL_KINDS[kind]})" for api, kind in wanted if not await client.has_api(api, kind)]


async def reconcile(rt: Runtime, body: Mapping[str, Any], *, lifecycle_duties: bool) -> Outcome:
    assert rt.client is not None, "reconcile before login"
    previous = dict(body.get("status") or {})
    try:
        svc = parse(dict(body))
        desired = render(svc, rt.config.images)
    except InvalidSpecError as exc:
        generation = int((body.get("metadata") or {}).get("generation") or 0)
        new = status_mod.invalid(generation, str(exc), now=rt.wall(), previous=previous)
        return Outcome(new, status_mod.transition_events(previous, new))

    events: list[Event] = []
    error: str | None = None
    observed: dict[Key, Obj] = {}
    pods: list[Obj] = []
    scale: dict[PoolRole, int] = {}
    stuck: dict[PoolRole, str] = {}
    loaded: list[adapters.PodAdapters] | None = None  # this round's LoRA loads (lifecycle rounds)
    try:
        observed = await observe(rt.client, svc)
        pods = await rt.client.list("v1", "Pod", svc.namespace, {names.LABEL_SERVICE: svc.name})
        missing = await missing_apis(rt.client, desired)
        if missing:
            # Apply nothing rather than half a service that cannot route.
            raise ApiError(404, "the cluster does not serve " + "; ".join(missing) + ": install it first")
        if lifecycle_duties:
            scale, events, stuck = await _lifecycle(rt, svc, observed, pods)
            loaded = await adapters.sync_service(svc, pods, rt.config.scrape_timeout, previous)
        decided = plan(svc, desired, observed, scale, fresh_key=render_peers.new_key())
        full = not lifecycle_duties or rt.resync_due(svc.uid)
        for obj in decided.apply:
            stamp_applied_hash(obj)
            if full or applied_hash(observed.get(key(obj))) != applied_hash(obj):
                observed[key(obj)] = await rt.client.apply(obj)
        if full:
            rt.resynced(svc.uid)
        for api_version, kind, name in decided.delete:
            await rt.client.delete(api_version, kind, svc.namespace, name)
            observed.pop((api_version, kind, name), None)
    except ApiError as exc:
        error = str(exc)
        decided = plan(svc, desired, observed, scale)
    problems = health.problems(pods, [o for k, o in observed.items() if k[1] in ("Deployment", "LeaderWorkerSet")])
    unreachable = {role: rounds for (uid, role), rounds in rt.unreachable.items()
                   if uid == svc.uid and rounds >= rt.config.unreachable_rounds}
    new = status_mod.compute(svc, decided, observed, now=rt.wall(), previous=previous, error=error,
                             problems=problems, unreachable=unreachable, stuck=stuck)
    events += adapters.report(new, loaded, adapters.desired_adapters(svc), svc.generation, rt.wall(), previous)
    return Outcome(new, events + status_mod.transition_events(previous, new))


def _running_engines(pods: list[Obj]) -> list[Obj]:
    return [p for p in pods if (p["metadata"].get("labels") or {}).get(names.LABEL_ENGINE) == "true"
            and not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("phase") == "Running"]


def _of_role(pods: list[Obj], role: PoolRole) -> list[Obj]:
    return [p for p in pods if p["metadata"]["labels"].get(names.LABEL_ROLE) == role]


async def _lifecycle(rt: Runtime, svc: LLMService, observed: Mapping[Key, Obj], all_pods: list[Obj]
                     ) -> tuple[dict[PoolRole, int], list[Event], dict[PoolRole, str]]:
    """Scrape, replace a stuck engine, scale: the replica decisions, the events, and per pool
    what was found stuck this round."""
    assert rt.client is not None
    pods = _running_engines(all_pods)
    metrics: dict[str, EngineMetrics] = {}
    for role in rendered_roles(svc):  # the engine's own port: a decode sidecar may sit in front
        answered = await scrape.scrape_pods(_of_role(pods, role), names.engine_port(svc, role),
                                            rt.config.scrape_timeout)
        metrics |= answered
        silent = bool(_of_role(pods, role)) and not answered
        rt.unreachable[(svc.uid, role)] = rt.unreachable.get((svc.uid, role), 0) + 1 if silent else 0
    now = rt.clock()
    events: list[Event] = []
    keep = svc.spec.lifecycle.stuck_after_seconds * 2 + rt.config.interval * 4
    live = {(svc.uid, p["metadata"]["uid"]) for p in pods}
    for gone in [k for k in rt.histories if k[0] == svc.uid and k not in live]:
        del rt.histories[gone]
    for pod in pods:
        uid = pod["metadata"]["uid"]
        if uid in metrics:
            history = rt.histories.setdefault((svc.uid, uid), [])
            history.append(lifecycle.sample_from_metrics(metrics[uid], now))
            rt.histories[(svc.uid, uid)] = lifecycle.trim(history, now, keep)
    stuck: dict[PoolRole, str] = {}
    if svc.spec.lifecycle.stuck_detection:
        for role in rendered_roles(svc):
            found = await _replace_stuck(rt, svc, role, _of_role(pods, role), now)
            if found:
                stuck[role] = found[0].message
            events += found
    return _autoscale(rt, svc, pods, metrics, observed, events, now), events, stuck


async def _replace_stuck(rt: Runtime, svc: LLMService, role: PoolRole, pods: list[Obj], now: float) -> list[Event]:
    """Evict the first stuck pod of the pool, through the Eviction API so PodDisruptionBudgets hold."""
    assert rt.client is not None
    threshold = svc.spec.lifecycle.stuck_after_seconds
    for pod in pods:
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        if not lifecycle.is_stuck(rt.histories.get((svc.uid, uid), []), now, threshold):
            continue
        rt.evictions = [t for t in rt.evictions if now - t < rt.config.eviction_window]
        if len(rt.evictions) >= rt.config.eviction_budget:
            return [Event("Warning", "EvictionRateLimited",
                          f"{role} pod {name} is stuck, but {len(rt.evictions)} engines were evicted in the last "
                          f"{rt.config.eviction_window:g}s (the operator's limit); it waits")]
        if not await rt.client.evict(svc.namespace, name, uid=uid):
            return [Event("Warning", "EvictionBlocked",
                          f"{role} pod {name} is stuck, but evicting it now would break its PodDisruptionBudget")]
        rt.evictions.append(now)
        rt.histories.pop((svc.uid, uid), None)
        return [Event("Warning", "StuckEngineReplaced",
                      f"{role} pod {name} ran requests without generating a token for {threshold}s; "
                      "evicted it for a fresh one")]
    return []  # at most one per pool per round: a metrics glitch must not empty a pool


def _autoscale(rt: Runtime, svc: LLMService, pods: list[Obj], metrics: Mapping[str, EngineMetrics],
               observed: Mapping[Key, Obj], events: list[Event], now: float) -> dict[PoolRole, int]:
    if svc.spec.autoscaling.mode != "operator":
        return {}
    scale: dict[PoolRole, int] = {}
    window = svc.spec.autoscaling.scale_down_stabilization_seconds
    for role in rendered_roles(svc):
        bounds = svc.spec.pool(role).autoscaling
        have = observed.get((*workload_kind(svc, role), names.child_name(svc, role)))
        if bounds is None or have is None:
            continue
        current = int((have.get("spec") or {}).get("replicas", 1))
        depths = [metrics[p["metadata"]["uid"]].waiting for p in _of_role(pods, role)
                  if p["metadata"]["uid"] in metrics]
        recommended = lifecycle.desired_replicas(current, depths, svc.spec.autoscaling.target_queue_depth,
                                                 bounds.min_replicas, bounds.max_replicas)
        history = rt.recommendations.setdefault((svc.uid, role), [])
        history.append((now, recommended))
        history[:] = [(t, r) for t, r in history if now - t <= window]
        wanted = lifecycle.stabilized(current, history, now, window)
        scale[role] = wanted
        if wanted != current:
            events.append(Event("Normal", "Scaled", f"{role} pool {current} -> {wanted} replicas "
                                f"(queue depth {sum(depths):g})"))
    return scale
