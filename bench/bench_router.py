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

    .venv/bin/python bench/bench_router.py [--tokens 8192] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from kvflow.router import Router, SchedulingRequest, load_config
from kvflow.router.hashcache import BlockHashCache
from kvflow.endpoints import Endpoint

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=100)
    p.add_argument("--grid", default=None, help="e.g. 64:100000,1000:1000000")
    args = p.parse_args(argv)
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
