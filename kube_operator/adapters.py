"""LoRA adapters loaded at run time: the spec's adapters on every ready engine, without a restart.

Engines run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, so vLLM serves
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; editing
``spec.model.loraAdapters`` changes no pod template. Each lifecycle round:

1. ``GET /v1/models`` on every ready engine pod (the adapters it has loaded: cards with a parent);
2. ``plan_adapters`` (pure): load what the spec has and the pod lacks, reload in place one whose
   path changed, unload what the spec no longer has; the base model is never touched;
3. the calls, each with a timeout; a pod's failures are named in its ``PodAdapters``, never raised.

``report`` turns the round into the ``AdaptersLoaded`` condition (reason ``Loaded``,
``LoadFailed`` or ``Unreachable``) and a Warning event when its message changes. A pod that
restarts comes back with only its static adapters; the next round loads the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from kvflow.operator import args, names
from kvflow.operator.objects import Obj
from kvflow.operator.render_pools import rendered_roles
from kvflow.operator.spec import LLMService
from kvflow.operator.status import Event
from kvflow.protocol.vllm_models import fetch_models

CONDITION = "AdaptersLoaded"
CALL_TIMEOUT = 60.0
"""Seconds one load may take: vLLM reads (or downloads) the adapter's weights before it answers."""


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    name: str
    path: str
    inplace: bool = False
    """The name is loaded from another path: vLLM's ``load_inplace`` swaps it without a gap."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unload:
    name: str


Action = Load | Unload


def plan_adapters(desired: Mapping[str, str], loaded: Mapping[str, str],
                  base: Iterable[str] = ()) -> tuple[Action, ...]:
    """The calls that make a pod's adapters the spec's: unloads first, then loads, by name.

    ``desired`` and ``loaded`` map adapter names to paths (``loaded`` as ``/v1/models`` lists
    them); ``base`` are the pod's base model names, which are never loaded or unloaded.
    """
    keep = frozenset(base)
    unloads = [Unload(n) for n in sorted(loaded) if n not in desired and n not in keep]
    loads = [Load(n, p, inplace=n in loaded) for n, p in sorted(desired.items())
             if n not in keep and loaded.get(n) != p]
    return (*unloads, *loads)


@dataclasses.dataclass(frozen=True, slots=True)
class PodAdapters:
    """One pod's round: what it had, what was done, what failed."""

    pod: str
    loaded: tuple[str, ...] = ()
    """Adapters the pod listed before the calls."""
    done: tuple[Action, ...] = ()
    errors: tuple[str, ...] = ()
    reachable: bool = True


def desired_adapters(svc: LLMService) -> dict[str, str]:
    """The spec's adapters, name → the path the engine loads it from."""
    return {a.name: args.adapter_path(a.source) for a in svc.spec.model.lora_adapters}


def _ready(pod: Obj) -> bool:
    meta, status = pod["metadata"], pod.get("status") or {}
    return ((meta.get("labels") or {}).get(names.LABEL_ENGINE) == "true" and not meta.get("deletionTimestamp")
            and bool(status.get("podIP")) and status.get("phase") == "Running"
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []))


def engine_targets(svc: LLMService, pods: Iterable[Obj]) -> list[tuple[str, str]]:
    """(pod name, engine URL) of every ready engine pod (a multi-node group's leader only)."""
    ports: dict[str, int] = {role: names.engine_port(svc, role) for role in rendered_roles(svc)}
    out = []
    for pod in pods:
        role = (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE)
        port = ports.get(role) if isinstance(role, str) else None
        if port is not None and _ready(pod):
            out.append((pod["metadata"]["name"], f"http://{pod['status']['podIP']}:{port}"))
    return out


async def _call(session: aiohttp.ClientSession, url: str, action: Action) -> str | None:
    """One load or unload; None on success, else what went wrong."""
    if isinstance(action, Load):
        what, path = f"load {action.name}", "/v1/load_lora_adapter"
        body: dict[str, Any] = {"lora_name": action.name, "lora_path": action.path}
        if action.inplace:
            body["load_inplace"] = True
    else:
        what, path, body = f"unload {action.name}", "/v1/unload_lora_adapter", {"lora_name": action.name}
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT)) as r:
            if r.status == 200:
                return None
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return f"{what}: {type(exc).__name__} {exc}".rstrip()
    return f"{what}: {r.status} {_reason(r.status, text)}"


def _reason(status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if status == 404 and body == {"detail": "Not Found"}:
        return "the engine has no dynamic LoRA API (is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True set?)"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:300]
    return text[:200]


async def sync_pod(session: aiohttp.ClientSession, pod: str, url: str, desired: Mapping[str, str]) -> PodAdapters:
    """Make one engine's adapters the spec's; failures are named in the result."""
    served = await fetch_models(session, f"{url}/v1/models")
    if served is None:
        return PodAdapters(pod, reachable=False, errors=("/v1/models did not answer",))
    done: list[Action] = []
    errors: list[str] = []
    for action in plan_adapters(desired, served.adapters, served.base):
        failed = await _call(session, url, action)
        if failed is None:
            done.append(action)
        else:
            errors.append(failed)
    return PodAdapters(pod, tuple(sorted(served.adapters)), tuple(done), tuple(errors))


async def sync_adapters(targets: Sequence[tuple[str, str]], desired: Mapping[str, str],
                        timeout: float) -> list[PodAdapters]:
    """Every pod at once; ``timeout`` bounds each ``/v1/models`` read (loads get ``CALL_TIMEOUT``)."""
    if not targets:
        return []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        return list(await asyncio.gather(*(sync_pod(session, pod, url, desired) for pod, url in targets)))


async def sync_service(svc: LLMService, pods: Iterable[Obj], timeout: float,
                       previous: Mapping[str, Any]) -> list[PodAdapters] | None:
    """The round for one LLMService; None when it has no adapters and never had (nothing to do)."""
    desired = desired_adapters(svc)
    if not desired and not any(c.get("type") == CONDITION for c in previous.get("conditions") or []):
        return None
    return await sync_adapters(engine_targets(svc, pods), desired, timeout)


def condition(results: Sequence[PodAdapters], desired: Mapping[str, str]) -> tuple[bool, str, str]:
    """(ok, reason, message) of ``AdaptersLoaded`` after a round."""
    failed = [r for r in results if r.errors]
    if not failed:
        wanted = ", ".join(sorted(desired)) or "none"
        return True, "Loaded", f"adapters {wanted} on {len(results)} ready engine pod(s)"
    reason = "LoadFailed" if any(r.reachable for r in failed) else "Unreachable"
    shown = "; ".join(f"pod {r.pod}: {', '.join(r.errors)}" for r in failed[:3])
    more = f" (and {len(failed) - 3} more pods)" if len(failed) > 3 else ""
    return False, reason, shown + more


def report(status: dict[str, Any], results: Sequence[PodAdapters] | None, desired: Mapping[str, str],
           generation: int, now: str, previous: Mapping[str, Any]) -> list[Event]:
    """Add ``AdaptersLoaded`` to ``status`` (the last one, on a round that did not sync) and
    return the events: a Warning when the failure's message changes, Normal per change made."""
    before = next((c for c in previous.get("conditions") or [] if c.get("type") == CONDITION), None)
    if results is None:
        if before is not None:
            status.setdefault("conditions", []).append(dict(before))
        return []
    ok, reason, message = condition(results, desired)
    if ok and not desired:
        return []  # every adapter unloaded: nothing left to manage, the condition goes
    state = "True" if ok else "False"
    since = before["lastTransitionTime"] if before and before.get("status") == state else now
    status.setdefault("conditions", []).append({
        "type": CONDITION, "status": state, "reason": reason, "message": message,
        "observedGeneration": generation, "lastTransitionTime": since})
    events = [Event("Normal", "AdaptersChanged", f"pod {r.pod}: " + ", ".join(_describe(a) for a in r.done))
              for r in results if r.done]
    if not ok and (before is None or before.get("message") != message):
        events.append(Event("Warning", reason, message))
    return events


def _describe(action: Action) -> str:
    if isinstance(action, Unload):
        return f"unloaded {action.name}"
    return f"{'reloaded' if action.inplace else 'loaded'} {action.name} from {action.path}"
