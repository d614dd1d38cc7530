"""Holding requests while a pool has no pod that can serve them: scale from zero.

A pool its autoscaler scaled to zero (KEDA with ``minReplicaCount: 0``), or whose first pod is
still starting, has no endpoint that can decode in its router's datastore. Rather than answer
each request with a 503 at once, the gateway parks it here until such an endpoint appears (the
datastore's change notification, which the Kubernetes pod watch drives), for at most
``seconds``. How many are parked is ``kvflow_gateway_held_requests``, the number an autoscaler
reads to wake the pool. Then:

* an endpoint that can decode appears: every held request goes on to the admission gate and the
  router, as if it had just arrived (a prefill-only pod does not count: it cannot answer);
* ``seconds`` pass first: 503 ``ServiceUnavailableError`` with ``Retry-After``;
* the client leaves: its handler is cancelled and it is forgotten here, nothing is sent;
* ``limit`` requests are held already (the flow config's ``max_queue``): 429 with
  ``Retry-After``, so a flood while at zero stays bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvflow.endpoints import Endpoint, Role
from kvflow.errors import NoCapacityError, RateLimitError

RETRY_AFTER_CAP = 30.0
"""The longest ``Retry-After`` a timed-out request is told: a pod still starting after the hold
may be ready soon, and the OpenAI clients honour at most 60 s before retrying by themselves."""


class Hold:
    """One pool's held requests. ``can_serve`` says whether the pool has a pod that can decode
    now (cheap: it runs on every request); ``endpoint_changed`` is the datastore's listener."""

    def __init__(self, model: str, seconds: float, limit: int, can_serve: Callable[[], bool]) -> None:
        self.model, self.seconds, self.limit = model, seconds, limit
        self._can_serve = can_serve
        self.held = 0
        """Requests waiting here now (the gauge)."""
        self._arrived = asyncio.Event()
        """Set, and replaced, when an endpoint that can decode is added."""
        self._changes: list[asyncio.Future[None]] = []

    def empty(self) -> bool:
        """No pod can serve the pool's requests, and holding is on: the caller should ``wait``."""
        return self.seconds > 0 and not self._can_serve()

    def endpoint_changed(self, endpoint: Endpoint, added: bool) -> None:
        # Called while the datastore is still updating its set, so nothing is read back here:
        # the woken waiters check ``can_serve`` once they run.
        if added and endpoint.role is not Role.PREFILL:
            self._arrived.set()
            self._arrived = asyncio.Event()

    async def wait(self) -> None:
        """Until the pool can serve: NoCapacityError after ``seconds``, RateLimitError when full."""
        if self.held >= self.limit:
            raise RateLimitError(f"too many requests held for model {self.model!r} while it has no ready pod "
                                 f"({self.limit}); retry later", retry_after=1.0)
        self._count(+1)
        try:
            async with asyncio.timeout(self.seconds):
                while not self._can_serve():
                    await self._arrived.wait()
        except TimeoutError:
            raise NoCapacityError(
                f"no ready pod for model {self.model!r} within {self.seconds:g} s (the pool is scaled to zero "
                "or its first pod is still starting); retry later",
                retry_after=max(1.0, min(self.seconds, RETRY_AFTER_CAP)),
            ) from None
        finally:
            self._count(-1)

    async def changed(self) -> int:
        """The number held, once it next changes (for observers such as tests; never polled)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changes.append(future)
        await future
        return self.held

    def _count(self, delta: int) -> None:
        self.held += delta
        changes, self._changes = self._changes, []
        for future in changes:
            if not future.done():
                future.set_result(None)
