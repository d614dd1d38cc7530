"""Scrape every endpoint's ``/metrics`` about every 50 ms into the datastore.

One task per endpoint, so a slow pod delays only itself; a failed or non-200 scrape takes the
endpoint out of scheduling until the next good one, and the expiry check drops pods that stop
answering without failing (hung connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp

from kvflow.router.datastore import Datastore
from kvflow.router.metrics_scrape import parse_metrics
from kvflow.router.model import EngineMetrics
from kvflow.endpoints import Endpoint, EndpointId

OnMetrics = Callable[[Endpoint, EngineMetrics], None]


class Scraper:
    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float = 0.05,
        stale_after: float = 1.0,
        on_metrics: OnMetrics | None = None,
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.stale_after = stale_after
        self.on_metrics = on_metrics
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[EndpointId, asyncio.Task[None]] = {}
        self._expiry: asyncio.Task[None] | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.stale_after)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        for ep in self.datastore.endpoints:
            self.add(ep)
        self._expiry = asyncio.create_task(self._expire_loop(), name="metrics-expiry")

    def add(self, endpoint: Endpoint) -> None:
        if self._session is not None and endpoint.id not in self._tasks:
            self._tasks[endpoint.id] = asyncio.create_task(self._loop(endpoint), name=f"scrape {endpoint.id}")

    async def remove(self, endpoint_id: EndpointId) -> None:
        task = self._tasks.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape_once(self, endpoint: Endpoint) -> EngineMetrics | None:
        assert self._session is not None
        try:
            async with self._session.get(f"{endpoint.url}/metrics") as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        try:
            return parse_metrics(text)
        except ValueError:
            return None

    async def _loop(self, endpoint: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            metrics = await self.scrape_once(endpoint)
            if metrics is None:
                self.datastore.record_failure(endpoint.id)
            else:
                self.datastore.record_scrape(endpoint.id, metrics, time.monotonic())
                if self.on_metrics is not None:
                    self.on_metrics(endpoint, metrics)
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stale_after / 2)
            self.datastore.expire(time.monotonic(), self.stale_after)
