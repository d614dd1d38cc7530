"""kopf wiring: thin handlers that call ``reconcile`` and hand its outcome back to kopf.

``register(registry, runtime)`` attaches the handlers to a registry, so tests build a fresh
registry with a short timer instead of relying on import-time global state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvflow.operator.kube import KubeClient, connection_info
from kvflow.operator.reconcile import Outcome, Runtime, reconcile
from kvflow.operator.spec import GROUP, PLURAL, VERSION

RESOURCE = (GROUP, VERSION, PLURAL)
CLIENT_GRACE_SECONDS = 120.0
_closing: set[asyncio.Task[None]] = set()


def _close_later(client: KubeClient) -> None:
    task = asyncio.get_running_loop().create_task(client.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def status_patch(previous: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``previous`` to ``status``: changed top-level fields only."""
    changes = {k: v for k, v in status.items() if previous.get(k) != v}
    changes.update({k: None for k in set(previous) - set(status) - {"kopf"}})  # None deletes
    return changes


def _deliver(outcome: Outcome, body: kopf.Body, patch: kopf.Patch, previous: Mapping[str, Any]) -> None:
    changes = status_patch(previous, outcome.status)
    if changes:  # an unchanged status is not written: no watch event, no churn every round
        patch.setdefault("status", {}).update(changes)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def register(registry: kopf.OperatorRegistry, runtime: Runtime) -> None:
    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvflow.io", key="last-handled-configuration")
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvflow.io")
        # kopf keeps a finalizer while the timer runs, to stop it before the object goes away.
        settings.persistence.finalizer = "kvflow.io/operator"
        # On deletion kopf waits for a running timer round to end before it releases the
        # finalizer; check every 2 s (default 60 s) so deletes are not held up.
        settings.background.cancellation_polling = 2.0
        settings.posting.level = logging.WARNING  # our own Events say what matters
        # One replica reconciles: the Lease election in run.py decides which; no kopf peering CRDs.
        settings.peering.standalone = True
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connection_info(runtime.config.server, **kwargs)
        if info is not None:
            old, runtime.client = runtime.client, KubeClient(info, user_agent=runtime.config.user_agent)
            if old is not None:  # a round may still use it: close it once that round is over
                asyncio.get_running_loop().call_later(CLIENT_GRACE_SECONDS, _close_later, old)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if runtime.client is not None:
            await runtime.client.close()
            runtime.client = None

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def apply_spec(body: kopf.Body, patch: kopf.Patch, status: kopf.Status, **_: Any) -> None:
        async with runtime.lock(body.metadata.uid or ""):
            outcome = await reconcile(runtime, body, lifecycle_duties=False)
        _deliver(outcome, body, patch, status)

    @kopf.timer(*RESOURCE, interval=runtime.config.interval, initial_delay=runtime.config.interval,
                registry=registry)
    async def tend(body: kopf.Body, patch: kopf.Patch, status: kopf.Status, **_: Any) -> None:
        async with runtime.lock(body.metadata.uid or ""):
            outcome = await reconcile(runtime, body, lifecycle_duties=True)
        _deliver(outcome, body, patch, status)
