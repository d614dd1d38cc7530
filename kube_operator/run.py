"""``kvflow operator run``: log in, win the leader election, then run kopf until told to stop.

Every replica serves ``/healthz`` from the start (a standby is alive, just not leading), stands
by until it holds the Lease, and only then starts kopf, whose handlers reconcile. When the Lease
is lost the replica stops kopf and exits non-zero, so Kubernetes restarts it as a fresh
standby; on SIGTERM it stops kopf, then releases the Lease so a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pathlib
import signal
import socket
import uuid
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from kvflow.operator.election import ElectionConfig, LeaderElector, LeadershipLost
from kvflow.operator.handlers import register
from kvflow.operator.kube import KubeClient, connection_info
from kvflow.operator.reconcile import OperatorConfig, Runtime

log = logging.getLogger(__name__)
SERVICE_ACCOUNT_NAMESPACE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclasses.dataclass(frozen=True, slots=True)
class RunOptions:
    config: OperatorConfig
    namespaces: tuple[str, ...] = ()
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    leader_election: bool = True
    lease_name: str = "kvflow-operator"
    lease_namespace: str | None = None


def identity() -> str:
    """The pod's name (or the host's) plus a random part: a restarted pod is a new candidate."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def lease_namespace(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def login(server: str | None) -> kopf.ConnectionInfo:
    info = connection_info(server, logger=log)
    if info is None:
        raise SystemExit("kvflow operator: no in-cluster service account and no kubeconfig")
    return info


class Health:
    """``/healthz``: 200 while standing by or while kopf runs as leader; 500 once kopf died."""

    def __init__(self) -> None:
        self.state = "starting"
        self.operator: asyncio.Task[Any] | None = None

    async def handle(self, _: web.Request) -> web.Response:
        dead = self.operator is not None and self.operator.done()
        return web.json_response({"state": "stopped" if dead else self.state}, status=500 if dead else 200)

    async def serve(self, url: str) -> web.AppRunner:
        parts = urlsplit(url)
        app = web.Application()
        app.router.add_get(parts.path or "/healthz", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port or 8080).start()
        return runner


async def run(options: RunOptions) -> int:
    health = Health()
    runner = await health.serve(options.liveness) if options.liveness else None
    elector: LeaderElector | None = None
    client: KubeClient | None = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if options.leader_election:
            me = identity()
            options = dataclasses.replace(options, config=dataclasses.replace(
                options.config, user_agent=f"{options.config.user_agent}/{me}"))
            client = KubeClient(login(options.config.server), user_agent=options.config.user_agent)
            elector = LeaderElector(client, ElectionConfig(
                namespace=lease_namespace(options.lease_namespace), identity=me, name=options.lease_name))
            health.state = "standby"
            acquired = asyncio.create_task(elector.acquire())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({acquired, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not acquired.done():
                acquired.cancel()
                return 0
            stopped.cancel()
        health.state = "leading"
        return await _operate(options, health, elector, stop)
    finally:
        if elector is not None:
            await elector.release()
        if client is not None:
            await client.close()
        if runner is not None:
            await runner.cleanup()


async def _operate(options: RunOptions, health: Health, elector: LeaderElector | None,
                   stop: asyncio.Event) -> int:
    registry = kopf.OperatorRegistry()
    register(registry, Runtime(config=options.config))
    kopf_stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(
        registry=registry, standalone=True, clusterwide=not options.namespaces,
        namespaces=list(options.namespaces), liveness_endpoint=None, stop_flag=kopf_stop))
    health.operator = operator
    watchers: set[asyncio.Task[Any]] = {operator, asyncio.create_task(stop.wait())}
    if elector is not None:
        watchers.add(asyncio.create_task(elector.hold()))
    done, pending = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for task in done:
        if task is not operator and not task.cancelled() and task.exception() is not None:
            lost = isinstance(task.exception(), LeadershipLost)
            log.error("leader election: %s; stopping so that a fresh replica stands by", task.exception(),
                      exc_info=None if lost else task.exception())
            code = 1
    kopf_stop.set()  # kopf finishes the round in flight, then returns
    for task in pending:
        if task is not operator:
            task.cancel()
    try:
        await operator  # ends by our stop flag, or by SIGTERM/SIGINT, which kopf takes over
    except asyncio.CancelledError:
        pass
    except Exception:
        log.exception("kopf stopped with an error")
        code = 1  # let Kubernetes restart the pod
    return code
