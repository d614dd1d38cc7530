"""A shared-prefix workload driven through an in-process ``Router`` against real pods.

Used by the routing integration test (``tests/router/test_routing_integration.py``): many
groups of requests, each group sharing a long system prompt, arriving interleaved, at a fixed
concurrency (closed loop). The router picks, the driver posts the completion to the pick, and
the pods' own ``vllm:prefix_cache_*`` counters say how much of the prompt was served from cache.
It drives a ``Router`` object in-process, which lets a test split the traffic over several
router replicas; ``kvbench.loadgen`` is the open-loop generator that goes through a router's
HTTP front door.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvflow.protocol.vllm_metrics import parse_metrics
from kvflow.router.model import SchedulingRequest
from kvflow.router.router import PROFILE_HEADER, Router
from kvflow.endpoints import Endpoint
from kvflow.tokenizer import prompt_token_ids


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int = 32
    requests: int = 256
    system_words: int = 600
    user_words: int = 30
    concurrency: int = 16
    max_tokens: int = 8
    seed: int = 0

    def prompts(self) -> list[str]:
        rng = random.Random(self.seed)
        vocab = [f"w{i}" for i in range(5000)]
        systems = [" ".join(rng.choices(vocab, k=self.system_words)) for _ in range(self.groups)]
        # Each group gets its share of requests, then everything is shuffled (interleaved groups).
        picks = [i % self.groups for i in range(self.requests)]
        rng.shuffle(picks)
        return [f"{systems[g]} || {' '.join(rng.choices(vocab, k=self.user_words))}" for g in picks]


@dataclass(frozen=True, slots=True)
class Outcome:
    profile: str
    hit_rate: float
    """Prefix-cache hits / queries, summed over the pods' own counters."""
    router_hit_rate: float
    """What the router believed it would hit."""
    requests_per_pod: tuple[int, ...]
    mean_in_flight: tuple[float, ...]
    """Time-averaged requests in flight per pod."""
    seconds: float
    errors: int

    @property
    def imbalance(self) -> float:
        """Busiest pod's time-averaged in-flight over the mean (1.0 = perfectly even)."""
        mean = sum(self.mean_in_flight) / len(self.mean_in_flight)
        return max(self.mean_in_flight) / mean if mean else 1.0


async def prefix_counters(session: aiohttp.ClientSession, endpoints: Sequence[Endpoint]) -> tuple[float, float]:
    hits = queries = 0.0
    for ep in endpoints:
        async with session.get(f"{ep.url}/metrics") as resp:
            m = parse_metrics(await resp.text())
        hits += m.prefix_hits
        queries += m.prefix_queries
    return hits, queries


async def run(
    routers: Router | Sequence[Router], profile: str, workload: Workload, *, model: str = "sim-model"
) -> Outcome:
    """Request ``i`` goes through ``routers[i % n]``: several replicas model an HA router (or
    gateway replicas each embedding one), where no replica sees all the traffic."""
    replicas = [routers] if isinstance(routers, Router) else list(routers)
    router = replicas[0]
    endpoints = list(router.endpoints)
    prompts = workload.prompts()
    counts = {ep.id: 0 for ep in endpoints}
    in_flight_area = {ep.id: 0.0 for ep in endpoints}
    errors = 0
    believed = [0, 0]
    sem = asyncio.Semaphore(workload.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        hits0, queries0 = await prefix_counters(session, endpoints)

        async def one(i: int, prompt: str) -> None:
            nonlocal errors
            router = replicas[i % len(replicas)]
            async with sem:
                body = {"model": model, "prompt": prompt, "max_tokens": workload.max_tokens, "temperature": 0}
                tokens = prompt_token_ids(router.tokenizer, body)
                flight = router.decide(SchedulingRequest(f"{profile}-{i}", model, tokens, {PROFILE_HEADER: profile}))
                flight.dispatch()
                result = flight.result
                pick = result.targets[0]
                counts[pick.id] += 1
                believed[0] += result.cached_tokens
                believed[1] += len(tokens)
                ok = False
                try:
                    async with session.post(f"{pick.url}/v1/completions", json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                finally:
                    if ok:
                        flight.first_token(observe=False)
                    else:
                        flight.failed(pick)
                    flight.finish()
                    errors += not ok

        async def sample(stop: asyncio.Event) -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                for replica in replicas:
                    for view in replica.datastore.snapshot():
                        in_flight_area[view.id] += view.in_flight * (now - last)
                last = now

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        started = time.monotonic()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        seconds = time.monotonic() - started
        stop.set()
        await sampler
        await asyncio.sleep(router.config.scrape_interval * 2)
        hits1, queries1 = await prefix_counters(session, endpoints)
    queries = queries1 - queries0
    return Outcome(
        profile=profile,
        hit_rate=(hits1 - hits0) / queries if queries else 0.0,
        router_hit_rate=believed[0] / believed[1] if believed[1] else 0.0,
        requests_per_pod=tuple(counts[ep.id] for ep in endpoints),
        mean_in_flight=tuple(in_flight_area[ep.id] / seconds for ep in endpoints),
        seconds=seconds,
        errors=errors,
    )
