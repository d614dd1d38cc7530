"""Fixtures for the operator tests: an emulated cluster with kopf running the operator in-process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import kmock
import pytest
from operator_emulator import Cluster
from operator_fakes import FakeDeploymentController, FakeEngines
from operator_harness import Harness, operator_running


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
    async with operator_running(cluster) as h:
        yield h
