"""The handle the operator's end-to-end tests get, and their one waiting helper."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import kmock
from operator_emulator import Cluster
from operator_fakes import FakeDeploymentController, FakeEngines

from kvflow.operator.reconcile import Runtime

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


async def eventually(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what or predicate}")
        await asyncio.sleep(0.05)


