"""Scrape each endpoint's ``/metrics`` now and then, into the datastore.

The router's own accounting (``kvflow.router.flight``) is exact and current for what it sends,
so scrapes only correct it: for other routers' traffic, for what the engine knows better (its
KV-cache use, its real queue), and for health. That makes them rare and cheap:

* **adaptive**: every ``interval`` seconds while the router has requests on the pod or the pod
  reports load, every ``idle_interval`` seconds when it is idle, and ``retry_interval`` after a
  failure (a pod coming back is in rotation within that long of answering);
* **spread**: each pod's scrapes start at a random phase and every wait is jittered by
  ±``JITTER``, so pods are never scraped in lock-step (a synchronised scrape is a synchronised
  stall on every pod);
* **judged by their own outcome**: a pod drops out when a scrape fails or does not answer within
  ``timeout``, never because the router's own loop was too busy to scrape it.

A pod with LoRA on (its ``vllm:lora_requests_info`` is there) is also asked its ``/v1/models``,
the one place vLLM lists the adapters it has loaded: every ``adapters_interval`` seconds, and at
once when the metric shows it running an adapter the router did not know it had. The LoRA filter
and scorer read the answer (``EndpointView.adapters``).

One task per endpoint, so a slow pod delays only itself. Fetching and parsing are
``kvflow.protocol.vllm_metrics``'s (the operator scrapes with the same code); the policy above is
the router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.protocol.vllm_metrics import EngineMetrics, fetch_metrics
from kvflow.protocol.vllm_models import fetch_models
from kvflow.router.datastore import Datastore
from kvflow.throttle import ThrottledLog

log = logging.getLogger(__name__)
throttled = ThrottledLog(log)

OnMetrics = Callable[[Endpoint, EngineMetrics], None]
JITTER = 0.1
"""Each wait is the interval times a uniform draw in [1 - JITTER, 1 + JITTER]."""


class Scraper:
    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float = 0.5,
        idle_interval: float = 2.0,
        retry_interval: float = 0.25,
        timeout: float = 1.0,
        adapters_interval: float = 5.0,
        on_metrics: OnMetrics | None = None,
        seed: int | None = None,
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.idle_interval = max(interval, idle_interval)
        self.retry_interval = min(interval, retry_interval)
        self.timeout = timeout
        self.adapters_interval = adapters_interval
        self.on_metrics = on_metrics
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[EndpointId, asyncio.Task[None]] = {}
        self._adapters_at: dict[EndpointId, float] = {}
        """When each pod's ``/v1/models`` last answered."""

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        for ep in self.datastore.endpoints:
            self.add(ep)

    def add(self, endpoint: Endpoint) -> None:
        if self._session is not None and endpoint.id not in self._tasks:
            self._tasks[endpoint.id] = asyncio.create_task(self._loop(endpoint), name=f"scrape {endpoint.id}")

    async def remove(self, endpoint_id: EndpointId) -> None:
        task = self._tasks.pop(endpoint_id, None)
        self._adapters_at.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape_once(self, endpoint: Endpoint) -> EngineMetrics | None:
        """The pod's metrics, or None when it failed, timed out or sent something unreadable."""
        assert self._session is not None
        metrics = await fetch_metrics(self._session, f"{endpoint.url}/metrics")
        if metrics is not None and metrics.rejected:
            throttled.warning(endpoint.id, "skipped %d malformed or out-of-range metric samples from %s",
                              metrics.rejected, endpoint.id)
        return metrics

    async def scrape_adapters(self, endpoint: Endpoint, now: float) -> None:
        """Learn the adapters the pod has loaded from its ``/v1/models`` (kept as they were if it fails)."""
        assert self._session is not None
        served = await fetch_models(self._session, f"{endpoint.url}/v1/models")
        if served is not None:
            self._adapters_at[endpoint.id] = now
            self.datastore.record_adapters(endpoint.id, frozenset(served.adapters))

    def adapters_due(self, endpoint: Endpoint, metrics: EngineMetrics, now: float) -> bool:
        """Ask the pod its adapters: LoRA is on there, and the last answer is old or misses one it runs."""
        if not metrics.max_loras:
            return False
        last = self._adapters_at.get(endpoint.id)
        if last is None or now - last >= self.adapters_interval:
            return True
        view = self.datastore.view(endpoint.id)
        known = view.adapters if view is not None else None
        # (not sooner than a busy pod's scrapes: an adapter unloaded under running requests stays in the metric)
        return known is not None and now - last >= self.interval and not (
            metrics.running_loras | metrics.waiting_loras) <= known

    def next_wait(self, endpoint: Endpoint, ok: bool) -> float:
        """Seconds until the pod's next scrape: sooner when it failed or is busy."""
        if not ok:
            base = self.retry_interval
        else:
            view = self.datastore.view(endpoint.id)
            busy = view is not None and (view.in_flight or view.metrics.running or view.metrics.waiting)
            base = self.interval if busy else self.idle_interval
        return base * self._rng.uniform(1 - JITTER, 1 + JITTER)

    async def _loop(self, endpoint: Endpoint) -> None:
        await asyncio.sleep(self._rng.uniform(0, self.interval))  # a random phase per pod
        while True:
            metrics = await self.scrape_once(endpoint)
            if metrics is None:
                self.datastore.record_failure(endpoint.id)
            else:
                now = time.monotonic()
                self.datastore.record_scrape(endpoint.id, metrics, now)
                if self.on_metrics is not None:
                    self.on_metrics(endpoint, metrics)
                if self.adapters_due(endpoint, metrics, now):
                    await self.scrape_adapters(endpoint, now)
            await asyncio.sleep(self.next_wait(endpoint, metrics is not None))
