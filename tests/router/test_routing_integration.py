"""Routing quality on real simulated pods: the 'done when' criteria, at test size.

4 simulated vLLM pods (h100-llama8b timing), a shared-prefix workload (groups of requests
sharing a long system prompt, interleaved), hit rates read from the pods' own
``vllm:prefix_cache_*`` counters. ``bench/bench_routing.py`` compares routers at full size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from kvbench.loadtest import Outcome, Workload, run
from kvbench.pods import Pod, reset, router_config, start_pods

from kvflow.local.procs import ProcessGroup
from kvflow.router import Router, load_config
from tests.waiting import eventually


@pytest.fixture
def pods_factory(tmp_path: Path) -> Iterator[object]:
    with ProcessGroup(tmp_path / "logs") as group:
        yield lambda num_blocks, first_host: start_pods(group, decode=4, num_blocks=num_blocks, first_host=first_host)


async def following(session: aiohttp.ClientSession, pods: list[Pod], routers: list[Router]) -> bool:
    """Every router has scraped every pod and hears its KV events. A SUB socket misses what was
    published before it connected, so the pods reset their (empty) caches again, each time
    publishing an ``AllBlocksCleared``, until every router has heard one from each."""
    await reset(session, pods)
    ids = {pod.endpoint.id for pod in pods}
    return all(ids <= r.event_sources and all(v.metrics.num_blocks is not None for v in r.datastore.snapshot())
               for r in routers)


async def drive(pods: list[Pod], profile: str, workload: Workload, replicas: int = 1) -> Outcome:
    routers = [Router(load_config(router_config(pods)), profile=profile) for _ in range(replicas)]
    for r in routers:
        await r.start()
    try:
        async with aiohttp.ClientSession() as session:
            await eventually(lambda: following(session, pods, routers), what="every router to follow every pod")
        return await run(routers, profile, workload)
    finally:
        for r in routers:
            await r.stop()


WORKLOAD = Workload(groups=24, requests=288, system_words=600, concurrency=16, max_tokens=8)


async def test_default_profile_triples_round_robin_hit_rate_and_stays_balanced(pods_factory) -> None:  # type: ignore[no-untyped-def]
    pods = await asyncio.to_thread(pods_factory, 300, 70)
    rr = await drive(pods, "round-robin", WORKLOAD)
    default = await drive(pods, "default", WORKLOAD)
    assert rr.errors == default.errors == 0
    assert default.hit_rate >= 3 * rr.hit_rate, (rr, default)
    assert default.imbalance <= 1.5, default


@pytest.mark.slow
async def test_precise_beats_approx_when_caches_evict(pods_factory) -> None:  # type: ignore[no-untyped-def]
    """Two router replicas split the traffic: only the KV-event index sees the whole truth."""
    pods = await asyncio.to_thread(pods_factory, 200, 80)
    approx = await drive(pods, "prefix-approx", WORKLOAD, replicas=2)
    precise = await drive(pods, "prefix-precise", WORKLOAD, replicas=2)
    assert precise.hit_rate > approx.hit_rate, (approx, precise)
