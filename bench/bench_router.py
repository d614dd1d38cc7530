"""Decision cost: one scheduling decision for an 8k-token prompt, as endpoints and index grow.

Builds an in-process Router (no I/O) with N endpoints and a precise prefix index holding B
blocks (random blocks spread over the endpoints, plus the prompt's own chain cached fully on
some endpoints and half on others), then times ``Router.schedule`` for the default profile
(filters, precise prefix 2 : KV cache 1 : queue 1, LoRA and session affinity, max-score).

Columns: ``hash cold`` hashes all 512 blocks with nothing memoised (sha256 + pickle, as vLLM);
``decide cold`` is a whole decision for a prompt never seen (its hashes computed in the walk);
``decide warm`` is a decision whose block hashes are memoised (a shared system prompt, or the
second profile run of a P/D decision); ``walk`` is the prefix-index lookup alone. Times are the
thread's CPU time (``time.thread_time``), so other processes on a shared machine do not count.

A second table is the per-request cost the gateway pays in-process: ``Router.schedule`` +
``request_started`` + ``request_finished`` for each built-in profile, with 4 and 64 endpoints
(scraped metrics set, ``--window`` requests kept in flight as under concurrent clients,
256-token prompts drawn from 64 shared prefixes, so hashes are memoised as in steady state).

    .venv/bin/python bench/bench_router.py [--tokens 8192] [--repeat 200] [--table decision|request|both]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from kvflow.router import EngineMetrics, Router, SchedulingRequest, load_config
from kvflow.router.hashcache import BlockHashCache
from kvflow.endpoints import Endpoint

PROFILES = ("round-robin", "least-load", "prefix-approx", "prefix-precise", "default")
GRID = [(4, 10_000), (64, 10_000), (64, 100_000), (64, 1_000_000), (256, 1_000_000), (1000, 1_000_000)]


def build(endpoints: int, blocks: int, tokens: list[int]) -> Router:
    eps = [Endpoint(f"10.{i // 250}.{i % 250}.1", 8000) for i in range(endpoints)]
    router = Router(load_config({"kvEvents": {"enabled": False}}), eps, profile="default")
    rng = random.Random(0)
    chain = BlockHashCache(16).for_request(tokens).all()
    ids = [ep.id for ep in eps]
    per = max(1, blocks // endpoints)
    for eid in ids:
        router.precise.add(eid, (rng.getrandbits(64) for _ in range(per)))
    for eid in ids[:8]:
        router.precise.add(eid, chain)
    for eid in ids[8:16]:
        router.precise.add(eid, chain[: len(chain) // 2])
    return router


def micros(samples: list[float]) -> str:
    """Best and median: on a shared machine the best is the uncontended cost."""
    return f"{min(samples) * 1e6:6.0f} / {statistics.median(samples) * 1e6:6.0f}"


def bench(endpoints: int, blocks: int, n_tokens: int, repeat: int) -> list[str]:
    rng = random.Random(1)
    tokens = [rng.randrange(32000) for _ in range(n_tokens)]
    router = build(endpoints, blocks, tokens)
    hash_cold, cold, warm, walk = [], [], [], []
    for i in range(repeat):
        t = time.thread_time()
        BlockHashCache(16).for_request(tokens).all()
        hash_cold.append(time.thread_time() - t)
        router.hash_cache = BlockHashCache(16)  # nothing memoised
        t = time.thread_time()
        router.schedule(SchedulingRequest(f"c{i}", "m", tokens))
        cold.append(time.thread_time() - t)
        t = time.thread_time()
        router.schedule(SchedulingRequest(f"w{i}", "m", tokens))  # memo now holds the prompt
        warm.append(time.thread_time() - t)
        hashes = router.hash_cache.for_request(tokens)
        hashes.all()
        t = time.thread_time()
        router.precise.match(hashes)
        walk.append(time.thread_time() - t)
    return [f"{endpoints:>9} {len(router.precise):>9} {micros(hash_cold)} {micros(cold)} {micros(warm)} {micros(walk)}"]


def per_request(profile: str, endpoints: int, *, requests: int, window: int, batches: int) -> list[float]:
    """CPU microseconds per request (schedule + started + finished), one sample per batch."""
    eps = [Endpoint(f"10.{i // 250}.{i % 250}.1", 8000) for i in range(endpoints)]
    router = Router(load_config({"kvEvents": {"enabled": False}}), eps, profile=profile)
    rng = random.Random(2)
    for ep in eps:
        router.datastore.record_scrape(
            ep.id, EngineMetrics(running=rng.randrange(8), waiting=rng.randrange(4), kv_usage=rng.random() / 2), 0.0
        )
    prompts = [[rng.randrange(32000) for _ in range(256)] for _ in range(64)]
    samples = []
    n = 0
    for _ in range(batches):
        live: list[tuple[SchedulingRequest, object]] = []
        t = time.thread_time()
        for _ in range(requests):
            req = SchedulingRequest(f"req-{n}", "m", prompts[n % len(prompts)])
            n += 1
            result = router.schedule(req)
            router.request_started(req, result)
            live.append((req, result))
            if len(live) > window:
                done, res = live.pop(0)
                router.request_finished(done, res, ok=True)  # type: ignore[arg-type]
        for done, res in live:
            router.request_finished(done, res, ok=True)  # type: ignore[arg-type]
        samples.append((time.thread_time() - t) / requests)
    return samples


def request_table(requests: int, window: int, batches: int) -> None:
    print(
        f"\nper-request router cost (schedule + request_started + request_finished), {window} in flight,"
        " 256-token prompts; CPU microseconds per request, best / median"
    )
    print(f"{'profile':<15} {'4 endpoints':>15} {'64 endpoints':>15}")
    for profile in PROFILES:
        cells = [micros(per_request(profile, n, requests=requests, window=window, batches=batches)) for n in (4, 64)]
        print(f"{profile:<15} {cells[0]:>15} {cells[1]:>15}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=100)
    p.add_argument("--grid", default=None, help="e.g. 64:100000,1000:1000000")
    p.add_argument("--table", choices=("decision", "request", "both"), default="both")
    p.add_argument("--requests", type=int, default=2000, help="requests per batch (request table)")
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--window", type=int, default=32, help="requests kept in flight (request table)")
    args = p.parse_args(argv)
    if args.table in ("request", "both"):
        request_table(args.requests, args.window, args.batches)
    if args.table == "request":
        return 0
    grid = GRID if not args.grid else [tuple(map(int, x.split(":"))) for x in args.grid.split(",")]
    print(
        f"decision cost, {args.tokens}-token prompt ({args.tokens // 16} blocks), default profile;"
        " CPU microseconds, best / median"
    )
    print(f"{'endpoints':>9} {'blocks':>9} {'hash cold':>15} {'decide cold':>15} {'decide warm':>15} {'walk':>15}")
    for endpoints, blocks in grid:
        for line in bench(endpoints, blocks, args.tokens, args.repeat):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
