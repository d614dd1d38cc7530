"""Waiting, in a test, for what another task, thread or process brings about.

Where the code under test offers an event, wait on it: an ``asyncio.Event`` or a ``changed()``
coroutine, a ready URL (``ProcessGroup.wait_ready``), a process's pidfd (``tests/pids.py``).
Where the only sign is state read through a public interface (another process's ``/metrics``
or status API, a router's datastore view, a batch's status), ``eventually`` polls it against a
deadline: the test goes on as soon as the state is there, and when it never comes it fails
saying what it waited for and what it saw last.

    await eventually(lambda: pod_metrics(session, pod), what="the pod's metrics")  # a coroutine too
    eventually_blocking(lambda: pids_with(marker), timeout=60, what="a pod process")
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")

POLL_S = 0.02
"""How long between two looks: short beside any deadline, long enough that polling another
process does not load the machine the test is measuring."""


Says = str | Callable[[], str]
"""What a wait was for: a text, or a function that tells it when the wait fails (with what the
test saw last, say)."""


async def eventually(predicate: Callable[[], T | Awaitable[T]], timeout: float = 20.0, what: Says = "") -> T:
    """Until ``predicate()`` (awaited, when it returns an awaitable) is truthy: that value."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return cast(T, result)
        if time.monotonic() > deadline:
            raise AssertionError(_failed(timeout, what or str(predicate), result))
        await asyncio.sleep(POLL_S)


def eventually_blocking(predicate: Callable[[], T], timeout: float = 20.0, what: Says = "") -> T:
    """``eventually`` for a test that is no coroutine (its I/O blocks: ``urllib``, ``/proc``)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(_failed(timeout, what or str(predicate), result))
        time.sleep(POLL_S)


def _failed(timeout: float, what: Says, last: object) -> str:
    return f"not within {timeout:g}s: {what if isinstance(what, str) else what()} (last seen: {last!r})"
