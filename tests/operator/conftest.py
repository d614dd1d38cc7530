"""Fixtures for the operator tests: an emulated cluster with kopf running the operator in-process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator

import kmock
import kopf
import pytest
from operator_emulator import Cluster
from operator_fakes import FakeDeploymentController, FakeEngines
from operator_harness import CLOCK_SPEEDUP, Harness

from kvflow.operator.handlers import register
from kvflow.operator.reconcile import OperatorConfig, Runtime

# Helpers live in operator_*.py modules, imported by name: with no __init__.py here, a test
# importing from "conftest" could get another folder's conftest when the whole suite runs.


@pytest.fixture
async def cluster() -> AsyncIterator[Harness]:
    """The emulated cluster with its fake controllers and engines, no operator yet."""
    ips = [f"127.0.0.{i}" for i in range(10, 40)]
    async with contextlib.AsyncExitStack() as stack:
        k8s = await stack.enter_async_context(Cluster())
        server = await stack.enter_async_context(kmock.Server(k8s))
        engines = await stack.enter_async_context(FakeEngines(ips))
        controller = await stack.enter_async_context(FakeDeploymentController(k8s, engines))
        yield Harness(k8s, server, engines, controller)


@pytest.fixture
async def harness(cluster: Harness) -> AsyncIterator[Harness]:
    """The cluster with the operator running in-process (kopf in its own thread and loop)."""
    config = OperatorConfig(interval=0.2, scrape_timeout=1.0, server=str(cluster.server.url).rstrip("/"))
    runtime = Runtime(config=config, clock=lambda: time.monotonic() * CLOCK_SPEEDUP)
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
