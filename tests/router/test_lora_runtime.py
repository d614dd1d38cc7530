"""The router's LoRA routing follows what each pod has loaded, learned from its ``/v1/models``.

Real ``kvflow sim`` pods with vLLM's dynamic LoRA API on; adapters are loaded and unloaded on
them at run time and the router, started once, follows.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from kvflow.errors import NoCapacityError
from kvflow.router import Incoming, Router, SchedulingRequest, load_config
from kvflow.router.plugins.lora_affinity import ROOM, lora_score
from tests.waiting import eventually

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
LORA_PODS = ("--profile", "instant", "--enable-lora", "--max-loras", "2")


async def lora_call(pod: Any, action: str, name: str, path: str = "") -> None:
    body = {"lora_name": name, **({"lora_path": path} if path else {})}
    async with aiohttp.ClientSession() as s, s.post(f"{pod.url}/v1/{action}_lora_adapter", json=body) as r:
        assert r.status == 200, await r.text()


def router_for(pods: list[Any], **extra: Any) -> Router:
    return Router(load_config({
        "pool": {"model": "sim-model", "endpoints": [{"address": p.id} for p in pods]},
        "kvEvents": {"enabled": False},
        "scrapeIntervalSeconds": 0.05, "scrapeIdleIntervalSeconds": 0.05, "adaptersIntervalSeconds": 0.05,
        **extra,
    }), profile="default")


async def targets(router: Router, model: str) -> list[str]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 1}
    flight = await router.route(Incoming(body, {}, f"r-{time.monotonic_ns()}", 64))
    return sorted(t.id for t in flight.result.targets)


def learned(router: Router) -> dict[str, frozenset[str] | None]:
    return {v.id: v.adapters for v in router.datastore.snapshot()}


@pytest.fixture
def lora_pods(sim_pods: Any) -> list[Any]:
    return sim_pods(2, *LORA_PODS, env=RUNTIME)  # type: ignore[no-any-return]


async def test_a_lora_request_goes_only_to_pods_that_have_the_adapter_loaded(lora_pods: list[Any]) -> None:
    a, b = lora_pods
    await lora_call(b, "load", "sql", "/adapters/sql")
    router = router_for(lora_pods)
    await router.start()
    try:
        await eventually(lambda: learned(router) == {a.id: frozenset(), b.id: {"sql"}}, what="adapters learned")
        assert "sql" in router.names.adapters  # a request naming it is a LoRA request
        assert await targets(router, "sql") == [b.id]
        assert await targets(router, "sim-model") == sorted([a.id, b.id])

        await lora_call(a, "load", "sql", "/adapters/sql")
        await lora_call(b, "unload", "sql")
        await eventually(lambda: learned(router) == {a.id: {"sql"}, b.id: frozenset()}, what="the move learned")
        assert await targets(router, "sql") == [a.id]

        await lora_call(a, "unload", "sql")
        await eventually(lambda: not router.datastore.adapters(), what="the unload learned")
        gone = SchedulingRequest("gone", "sim-model", [1, 2, 3], lora="sql")  # named in a gateway's config, say
        with pytest.raises(NoCapacityError, match="model-filter"):  # vLLM would answer 404: no pod has it
            router.decide(gone)
    finally:
        await router.stop()


async def test_the_affinity_scorer_prefers_a_pod_with_the_adapter_loaded(lora_pods: list[Any]) -> None:
    a, b = lora_pods
    await lora_call(a, "load", "chat", "/adapters/chat")
    router = router_for(lora_pods)
    await router.start()
    try:
        await eventually(lambda: learned(router) == {a.id: {"chat"}, b.id: frozenset()}, what="adapters learned")
        views = {v.id: v for v in router.datastore.snapshot()}
        assert (lora_score(views[a.id], "chat"), lora_score(views[b.id], "chat")) == (ROOM, 0.0)
    finally:
        await router.stop()


async def test_lora_paths_name_adapters_on_pods_that_say_nothing_of_lora(sim_pods: Any) -> None:
    """Pods without LoRA metrics are never asked their models: a configured adapter may go to any."""
    pods = sim_pods(2, "--profile", "instant")
    router = router_for(pods, loraPaths={"sql": "/adapters/sql"})
    await router.start()
    try:
        assert "sql" in router.names.adapters
        await eventually(lambda: all(v.metrics.num_blocks for v in router.datastore.snapshot()), what="scraped")
        assert learned(router) == {p.id: None for p in pods}
        assert await targets(router, "sql") == sorted(p.id for p in pods)
    finally:
        await router.stop()


async def test_static_lora_modules_are_learned_like_loaded_ones(sim_pods: Any) -> None:
    [a] = sim_pods(1, "--profile", "instant", "--lora-modules", "sql=/adapters/sql")
    [b] = sim_pods(1, "--profile", "instant", "--lora-modules", "chat=/adapters/chat")
    router = router_for([a, b])
    await router.start()
    try:
        await eventually(lambda: learned(router) == {a.id: {"sql"}, b.id: {"chat"}}, what="adapters learned")
        assert (await targets(router, "sql"), await targets(router, "chat")) == ([a.id], [b.id])
    finally:
        await router.stop()
