"""The status document a standalone router serves on its metrics port, and the sentence that
explains a decision (``kvflow.router.status_api.explain``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvflow.endpoints import Endpoint, Role
from kvflow.router import Router, load_config
from kvflow.router.cli import metrics_app
from kvflow.router.model import SchedulingRequest
from kvflow.router.status_api import explain

DECODE = [Endpoint("127.0.0.2", 8000, Role.DECODE), Endpoint("127.0.0.3", 8000, Role.DECODE)]
PREFILL = Endpoint("127.0.0.4", 8000, Role.PREFILL)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Router]]:
    router = Router(load_config({"pd": {"threshold": 16}}), [*DECODE, PREFILL])
    server = TestServer(metrics_app(router), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")), router
    finally:
        await server.close()


async def test_the_router_serves_the_status_document_and_the_page(served: tuple[str, Router]) -> None:
    url, router = served
    long = router.decide(SchedulingRequest("long", "m", list(range(100)))).result
    short = router.decide(SchedulingRequest("short", "m", [1, 2, 3])).result
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/kvflow/status") as resp:
            assert resp.status == 200
            doc = await resp.json()
        async with session.get(url + "/dashboard") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            assert "Content-Security-Policy" in resp.headers
        async with session.get(url + "/dashboard/static/uPlot.iife.min.js") as resp:
            assert resp.status == 200 and (await resp.read()).startswith(b"/*! https://github.com/leeoniya/uPlot")
        async with session.get(url + "/dashboard/static/nothing.js") as resp:
            assert resp.status == 404
    (pool,) = doc["models"]
    assert doc["source"] == "router" and pool["admission"] is None
    assert {p["id"]: p["role"] for p in pool["pods"]} == {
        "127.0.0.2:8000": "decode", "127.0.0.3:8000": "decode", "127.0.0.4:8000": "prefill"}
    assert all(p["served"] is None for p in pool["pods"])  # only a gateway sees the answers
    assert [(d["request_id"], d["mode"], d["pick"], d["prefill"]) for d in pool["decisions"]] == [
        ("short", "aggregated", short.targets[0].id, None), ("long", "pd", long.targets[0].id, PREFILL.id)]


ENTRY = {"time": 1.0, "request_id": "r", "profile": "default", "targets": ["a:1", "b:1"], "prefill": None,
         "cached_tokens": 32, "prompt_tokens": 40, "micros": 5.0,
         "runs": [{"profile": "default", "filters": {"model-filter": 3, "saturation-filter": 2},
                   "endpoints": {"a:1": {"total": 0.9, "scores": {"prefix": 1.0, "queue": 0.8}},
                                 "b:1": {"total": 0.4, "scores": {"prefix": 0.0, "queue": 0.8}}}}]}


@pytest.mark.parametrize(("change", "roles", "says"), [
    ({}, {"a:1": "both", "b:1": "both", "c:1": "both"},
     "a:1 picked: total 0.900 against 0.400 for the next of 2 candidates (prefix 1.00, queue 0.80); "
     "filtered: saturation-filter removed 1; cache hit of 32 of 40 prompt tokens; aggregated: the pool has no "
     "prefill pods"),
    ({}, {"a:1": "decode", "b:1": "decode", "c:1": "decode", "p:1": "prefill"},
     "a:1 picked: total 0.900 against 0.400 for the next of 2 candidates (prefix 1.00, queue 0.80); "
     "filtered: saturation-filter removed 1; cache hit of 32 of 40 prompt tokens; aggregated: 8 uncached tokens, "
     "at most the P/D threshold 16"),
    ({"cached_tokens": 0, "prefill": "p:1"}, {"a:1": "decode", "b:1": "decode", "c:1": "decode", "p:1": "prefill"},
     "a:1 picked: total 0.900 against 0.400 for the next of 2 candidates (prefix 1.00, queue 0.80); "
     "filtered: saturation-filter removed 1; no cached prefix; P/D: 40 uncached tokens exceed the threshold 16, "
     "prefill on p:1"),
    ({"cached_tokens": 0}, {"a:1": "decode", "b:1": "decode", "c:1": "decode", "p:1": "prefill"},
     "a:1 picked: total 0.900 against 0.400 for the next of 2 candidates (prefix 1.00, queue 0.80); "
     "filtered: saturation-filter removed 1; no cached prefix; aggregated: 40 uncached tokens exceed the P/D "
     "threshold 16, but no prefill pod could take it"),
    ({"targets": [], "runs": [], "error": "no_capacity: no endpoint can serve model 'm'"}, {"a:1": "both"},
     "not routed: no_capacity: no endpoint can serve model 'm'"),
], ids=["no-prefill-pods", "under-threshold", "pd", "prefill-pool-full", "no-capacity"])
def test_a_decision_is_explained_by_its_filters_scores_cache_and_pd_choice(change, roles, says) -> None:  # type: ignore[no-untyped-def]
    d = explain({**ENTRY, **change}, roles, threshold=16)
    assert d["reason"] == says
    if d["pick"]:
        assert [(c["id"], c["picked"]) for c in d["candidates"]] == [("a:1", True), ("b:1", False)]
