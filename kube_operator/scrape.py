"""Scrape engine pods' ``/metrics`` (the I/O edge of the lifecycle decisions).

Fetching and parsing are the router's own (``kvflow.protocol.vllm_metrics.fetch_metrics``); what
the numbers mean for a pod (stuck, queue depth) is ``kvflow.operator.lifecycle``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from kvflow.operator.objects import Obj
from kvflow.protocol.vllm_metrics import EngineMetrics, fetch_metrics


def metrics_url(pod: Obj, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}/metrics" if ip else None


async def scrape_pods(pods: Iterable[Obj], port: int, timeout: float) -> dict[str, EngineMetrics]:
    """Metrics keyed by pod uid, for the pods that answered (one that did not is not stuck)."""
    targets = [(pod["metadata"]["uid"], url) for pod in pods if (url := metrics_url(pod, port))]
    if not targets:
        return {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        results = await asyncio.gather(*(fetch_metrics(session, url) for _, url in targets))
    return {uid: metrics for (uid, _), metrics in zip(targets, results) if metrics is not None}
