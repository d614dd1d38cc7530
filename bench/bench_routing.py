"""Routing quality: prefix-cache hit rate and load balance per router profile.

Starts 4 simulated vLLM pods (h100-llama8b timing, KV events on), then for each profile resets
the pods' prefix caches, builds a fresh in-process Router and drives a shared-prefix workload
(many groups, each sharing a long system prompt, interleaved) through it. The hit rate is read
from the pods' own ``vllm:prefix_cache_hits/queries`` counters.

Scenarios: ``roomy`` (a quarter of the groups fits on each pod: prefix-aware routing can
partition, round-robin thrashes; one router), ``tight`` (even a partition evicts; one router)
and ``tight-ha`` (the same, with two router replicas splitting the traffic, as an HA endpoint
picker or several gateway replicas would: each approximate index sees half the routing, while
every replica's KV-event index sees all of every pod's cache).

    .venv/bin/python bench/bench_routing.py [--requests 256] [--groups 32] [--scenario roomy tight]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from kvflow.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router import Router, load_config
from kvflow.router.loadtest import Outcome, Workload, run
from kvflow.endpoints import Endpoint

PROFILES = ("round-robin", "least-load", "prefix-approx", "prefix-precise", "default")
NO_PREFIX = frozenset({"round-robin", "least-load"})
SCENARIOS = {"roomy": (420, 1), "tight": (260, 1), "tight-ha": (260, 2)}  # KV blocks per pod, routers


def start_pods(group: ProcessGroup, n: int, num_blocks: int, first_host: int = 40) -> list[tuple[Endpoint, str]]:
    pods = []
    for i in range(n):
        host = f"127.0.0.{first_host + i}"
        port, kv_port = free_port(host), free_port(host)
        argv = kvflow_argv(
            "sim",
            "--host",
            host,
            "--port",
            str(port),
            "--profile",
            "h100-llama8b",
            "--num-blocks",
            str(num_blocks),
            "--kv-events-endpoint",
            f"tcp://*:{kv_port}",
            "--log-level",
            "WARNING",
        )
        group.start(f"sim-{i}", argv, env={"PYTHONHASHSEED": "0"}, ready_url=f"http://{host}:{port}/health")
        pods.append((Endpoint(host, port), f"tcp://{host}:{kv_port}"))
    group.wait_ready(60)
    return pods


def router_config(pods: list[tuple[Endpoint, str]]) -> dict[str, object]:
    return {"pool": {"endpoints": [{"address": ep.id, "kvEvents": kv} for ep, kv in pods]}}


async def reset(pods: list[tuple[Endpoint, str]]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for ep, _ in pods:
            async with session.post(f"{ep.url}/reset_prefix_cache") as resp:
                await resp.read()


async def run_profile(pods: list[tuple[Endpoint, str]], profile: str, workload: Workload, replicas: int) -> Outcome:
    await reset(pods)
    routers = [Router(load_config(router_config(pods)), profile=profile) for _ in range(replicas)]
    for router in routers:
        await router.start()
    try:
        await asyncio.sleep(0.3)  # first scrape, SUB sockets connected
        return await run(routers, profile, workload)
    finally:
        for router in routers:
            await router.stop()


def table(scenario: str, num_blocks: int, replicas: int, outcomes: list[Outcome]) -> str:
    rr = next((o.hit_rate for o in outcomes if o.profile == "round-robin"), 0.0)
    lines = [
        f"scenario {scenario}: {num_blocks} KV blocks per pod, {replicas} router replica(s)",
        f"{'profile':<15} {'hit rate':>8} {'vs RR':>6} {'router':>7} {'imbal.':>6} {'req/pod':<18} "
        f"{'secs':>5} {'err':>3}",
    ]
    for o in outcomes:
        ratio = f"{o.hit_rate / rr:.1f}x" if rr else "-"
        # Profiles without a prefix scorer do not hash prompts, so the router believes nothing.
        believed = f"{o.router_hit_rate:>7.1%}" if o.profile not in NO_PREFIX else f"{'-':>7}"
        lines.append(
            f"{o.profile:<15} {o.hit_rate:>8.1%} {ratio:>6} {believed} {o.imbalance:>6.2f} "
            f"{'/'.join(map(str, o.requests_per_pod)):<18} {o.seconds:>5.1f} {o.errors:>3}"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    workload = Workload(
        groups=args.groups, requests=args.requests, system_words=args.system_words, concurrency=args.concurrency
    )
    for scenario in args.scenario:
        num_blocks, replicas = SCENARIOS[scenario]
        with ProcessGroup(Path(tempfile.mkdtemp(prefix="kvflow-bench-routing-"))) as group:
            pods = await asyncio.to_thread(start_pods, group, 4, num_blocks)
            outcomes = [await run_profile(pods, p, workload, replicas) for p in args.profiles]
        print(table(scenario, num_blocks, replicas, outcomes))
        print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--profiles", nargs="+", default=list(PROFILES))
    p.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = p.parse_args(argv)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
