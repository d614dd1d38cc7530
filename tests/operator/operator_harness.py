"""The handle the operator's end-to-end tests get; they wait with the suite's ``eventually``
(``tests/waiting.py``), re-exported here for them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import kmock
import kopf
from operator_emulator import Cluster
from operator_fakes import FakeDeploymentController, FakeEngines

from kvflow.operator.handlers import register
from kvflow.operator.reconcile import OperatorConfig, Runtime
from tests.waiting import eventually

__all__ = ["CLOCK_SPEEDUP", "Harness", "eventually", "operator_running"]

CLOCK_SPEEDUP = 20.0  # the operator's lifecycle clock runs 20x: stuckAfterSeconds 10 -> 0.5 s


@dataclasses.dataclass
class Harness:
    k8s: Cluster
    server: kmock.Server
    engines: FakeEngines
    controller: FakeDeploymentController
    runtime: Runtime | None = None

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/merge-patch+json") -> Any:
        headers = {"Content-Type": content_type}
        async with self.server.client.request(method, path, json=body, headers=headers) as response:
            assert response.status < 400, await response.text()
            return await response.json()


@contextlib.asynccontextmanager
async def operator_running(cluster: Harness, **config: Any) -> AsyncIterator[Harness]:
    """Run the operator against ``cluster``, with ``OperatorConfig`` fields overridden."""
    settings = {"interval": 0.2, "scrape_timeout": 1.0, "server": str(cluster.server.url).rstrip("/"), **config}
    runtime = Runtime(config=OperatorConfig(**settings), clock=lambda: time.monotonic() * CLOCK_SPEEDUP)
    registry = kopf.OperatorRegistry()
    register(registry, runtime)
    # At exit kopf cancels every task of its loop that it did not see at start, which must not
    # include the emulator or the test itself: hence a thread of its own.
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        registry=registry, standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)),
        name="kopf", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10), "kopf did not start"
    try:
        yield dataclasses.replace(cluster, runtime=runtime)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive(), "kopf did not stop"
