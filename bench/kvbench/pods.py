"""Simulated vLLM pods for the routing benchmark: start them, reset their caches, read their
own counters.

Each pod listens on its own loopback address and binds its KV-event publisher as vLLM does
(``tcp://*:PORT``: every interface), so the pods need distinct ports; ``router_config`` tells
kvflow's router where each one publishes (in a cluster, every pod's own ``:5557``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvflow.endpoints import Endpoint
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class Pod:
    endpoint: Endpoint
    role: str
    """``both`` (aggregated), ``prefill`` or ``decode``."""
    kv_events: str
    """Where it publishes KV events ("": it publishes none)."""

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def address(self) -> str:
        return self.endpoint.id


@dataclass(frozen=True, slots=True)
class Counters:
    """One pod's cumulative counters, as its ``/metrics`` reports them."""

    prefix_hits: float
    prefix_queries: float
    requests: float
    """``vllm:request_success`` over every finish reason."""
    external_hits: float = 0.0
    """Prompt tokens a P/D decode pod got over KV transfer (``vllm:external_prefix_cache_hits``)."""
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    """``vllm:time_to_first_token_seconds``: the time to first token the pod itself measured."""


def start_pods(group: ProcessGroup, *, decode: int, prefill: int = 0, num_blocks: int, profile: str = "h100-llama8b",
               first_host: int = 150, extra: Sequence[str] = (), kv_events: bool = True) -> list[Pod]:
    """``decode`` aggregated pods (decode pods when ``prefill`` > 0), then ``prefill`` pods;
    without ``kv_events`` they publish none (as vLLM without ``--kv-events-config``)."""
    roles = [("decode" if prefill else "both")] * decode + ["prefill"] * prefill
    pods = []
    for i, role in enumerate(roles):
        host = f"127.0.0.{first_host + i}"
        # both on the pod's own address: a wildcard bind (tcp://*) can collide with another
        # process's outgoing connection from 127.0.0.1 that took the same ephemeral port since
        port, kv_port = free_port(host), free_port(host)
        events = f"tcp://{host}:{kv_port}" if kv_events else ""
        argv = kvflow_argv("sim", "--host", host, "--port", str(port), "--model", MODEL, "--profile", profile,
                           "--num-blocks", str(num_blocks), "--role", role,
                           *(("--kv-events-endpoint", events) if events else ()), "--log-level", "WARNING", *extra)
        if role != "both":
            argv += ["--kv-transfer", "modelled"]
        group.start(f"pod-{i}-{role}", argv, env={"PYTHONHASHSEED": "0"}, ready_url=f"http://{host}:{port}/health")
        pods.append(Pod(Endpoint(host, port), role, events))
    group.wait_ready(90)
    return pods


def router_config(pods: Sequence[Pod]) -> dict[str, object]:
    """The least a kvflow router needs here beyond its defaults: where each pod publishes."""
    return {"pool": {"endpoints": [{"address": p.address, "role": p.role, **({"kvEvents": p.kv_events} if p.kv_events else {})}
                                   for p in pods]}}


def parse_counters(text: str) -> Counters:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success",
                           "vllm:external_prefix_cache_hits"):
            sums[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "vllm:time_to_first_token_seconds":
            for suffix in ("_sum", "_count"):
                sums[suffix] = sum(s.value for s in family.samples if s.name.endswith(suffix))
    return Counters(sums.get("vllm:prefix_cache_hits", 0.0), sums.get("vllm:prefix_cache_queries", 0.0),
                    sums.get("vllm:request_success", 0.0), sums.get("vllm:external_prefix_cache_hits", 0.0),
                    sums.get("_sum", 0.0), sums.get("_count", 0.0))


async def counters(session: aiohttp.ClientSession, pods: Sequence[Pod]) -> list[Counters]:
    async def one(pod: Pod) -> Counters:
        async with session.get(f"{pod.url}/metrics") as resp:
            return parse_counters(await resp.text())

    return list(await asyncio.gather(*(one(p) for p in pods)))


async def warm(pods: Sequence[Pod], text: str) -> None:
    """Tokenize ``text`` on every pod (``POST /tokenize``): a fresh simulated pod hashes each word
    the first time it sees one, which would slow its HTTP front end during the first run."""
    await warm_urls([pod.url for pod in pods], text)


async def warm_urls(urls: Sequence[str], text: str) -> None:
    """``POST {url}/tokenize`` ``text`` at each URL: a pod, or the kvflow gateway, whose router
    runs the pods' tokenizer (and answers vLLM's ``/tokenize`` itself)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for url in urls:
            async with session.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url} could not tokenize the warm-up text: {resp.status} "
                                       f"{(await resp.text())[:200]}")


async def wait_idle(session: aiohttp.ClientSession, pods: Sequence[Pod], timeout: float = 60.0) -> bool:
    """Until no pod runs or queues a request (a run's stragglers must not leak into the next)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        busy = 0.0
        for pod in pods:
            async with session.get(f"{pod.url}/metrics") as resp:
                for family in text_string_to_metric_families(await resp.text()):
                    if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                        busy += sum(s.value for s in family.samples)
        if busy == 0:
            return True
        await asyncio.sleep(0.2)
    return False


async def reset(session: aiohttp.ClientSession, pods: Sequence[Pod], attempts: int = 200) -> None:
    """``POST /reset_prefix_cache`` on every pod; vLLM refuses while blocks are in use (a P/D
    prefill pod keeps an exported request's blocks until the decode side pulls them, or for
    the 30 s lease when it never does)."""
    for pod in pods:
        for _ in range(attempts):
            async with session.post(f"{pod.url}/reset_prefix_cache") as resp:
                body = await resp.text()
                if resp.status == 200 and "false" not in body.lower():
                    break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{pod.address} would not reset its prefix cache: {resp.status} {body[:200]}")
