"""The load generator keeps the benchmark process's collector off its runs, and hands it back;
it sends a trace to one URL, or each request to a URL of its own.

The benchmark's process holds every trace and replay it computed before a run; a full
collection over them in the middle of a run stalled the generator's loop (late sends, late
first tokens) for whichever router ran then. During a run they are frozen (``gc.freeze``):
checked here from a streaming stand-in for a pod, in the same process.
"""

from __future__ import annotations

import gc
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kvbench import loadgen
from kvbench.workloads import Trace, TraceRequest


async def _stream_two_tokens(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in ("a", " b"):
        await resp.write(b"data: " + json.dumps({"choices": [{"text": piece}]}).encode() + b"\n\n")
    usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    return resp


async def test_the_process_s_older_objects_are_frozen_during_a_run_and_only_then() -> None:
    frozen_while_serving: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        frozen_while_serving.append(gc.get_freeze_count())
        return await _stream_two_tokens(request)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    trace = Trace("t", 10.0, 0.2, tuple(TraceRequest(i, 0.05 * i, "hello there", 2, i, "g") for i in range(3)))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        assert gc.get_freeze_count() == 0
        run = await loadgen.run(str(server.make_url("/v1/completions")), trace, model="m")
    finally:
        await server.close()

    assert loadgen.errors(run.results) == []
    assert [r.chunks for r in run.results] == [2, 2, 2]
    assert len(frozen_while_serving) == 3 and min(frozen_while_serving) > 0  # the older objects, frozen
    assert gc.get_freeze_count() == 0  # and handed back to the collector after the run


async def test_each_request_goes_to_its_own_url_when_given_one_per_request() -> None:
    """What the live oracle does: every request straight to the pod its replay placed it on."""
    arrived: dict[str, list[int]] = {"p0": [], "p1": []}

    def pod(name: str):  # type: ignore[no-untyped-def]
        async def completions(request: web.Request) -> web.StreamResponse:
            arrived[name].append((await request.json())["seed"])
            return await _stream_two_tokens(request)

        return completions

    app = web.Application()
    app.router.add_post("/p0/v1/completions", pod("p0"))
    app.router.add_post("/p1/v1/completions", pod("p1"))
    trace = Trace("t", 10.0, 0.4, tuple(TraceRequest(i, 0.05 * i, "hello there", 2, i, "g") for i in range(4)))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        urls = [str(server.make_url(f"/p{pod}/v1/completions")) for pod in (1, 0, 0, 1)]
        run = await loadgen.run(urls, trace, model="m")
        with pytest.raises(ValueError, match="3 URLs for 4 requests"):
            await loadgen.run(urls[:3], trace, model="m")
    finally:
        await server.close()

    assert loadgen.errors(run.results) == []
    assert sorted(arrived["p0"]) == [1, 2] and sorted(arrived["p1"]) == [0, 3]
