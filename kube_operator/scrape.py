"""Scrape engine pods' ``/metrics`` (the I/O edge of the lifecycle decisions)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from kvflow.operator.lifecycle import parse_metrics
from kvflow.operator.objects import Obj


def metrics_url(pod: Obj, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}/metrics" if ip else None


async def scrape_one(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The summed metrics of one engine, or None if it did not answer (that is not stuck)."""
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            return parse_metrics(await response.text())
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


async def scrape_pods(pods: Iterable[Obj], port: int, timeout: float) -> dict[str, dict[str, float]]:
    """Metrics keyed by pod uid, for the pods that answered."""
    targets = [(pod["metadata"]["uid"], url) for pod in pods if (url := metrics_url(pod, port))]
    if not targets:
        return {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        results = await asyncio.gather(*(scrape_one(session, url) for _, url in targets))
    return {uid: metrics for (uid, _), metrics in zip(targets, results) if metrics is not None}
