"""Timestamps along the live path, for ``bench/path_probe.py`` (bench/RESULTS.md, "Every hop").

Put this folder first on ``PYTHONPATH`` and name an output folder in ``KVFLOW_PATH_PROBE``;
every ``kvflow gateway`` and ``kvflow sim`` process started so (a benchmark passes its
environment on) then records, on the machine's shared monotonic clock, each streamed request's
way through it, and appends it to ``<folder>/<role>-<pid>.jsonl`` every second and at exit:

* the gateway: the request's first byte read (its connection's parser began a message),
  handled, serving (parsed, validated, admitted), the time tokenizing and scheduling took (wall
  and the thread's CPU time: the difference is the time the process was not running), sent to
  the pod, first chunk back, and its event loop's lag on 5 ms timers;
* the routing benchmark's load generator (``kvflow bench routing``): each request's send and
  first token, and its ``seed``, whichever router it went through (so a peer's hops show too);
* a simulated pod: its handler entered, the engine's arrival and first token, the first token
  written out; its own address and the request's ``seed`` (the routing benchmark's requests each
  have their own), which say where a router placed each request of a trace
  (``bench/replay_placements.py``).

Both key a request by the ``X-Request-Id`` the gateway forwards. A diagnostic only: it wraps
the functions it times from outside and changes nothing else.
"""

from __future__ import annotations

import os
import sys

_FOLDER = os.environ.get("KVFLOW_PATH_PROBE")
_ROLE = sys.argv[1] if _FOLDER and len(sys.argv) > 1 and sys.argv[0] == "-m" else None  # python -m kvflow ROLE
_BENCH = bool(_FOLDER) and sys.argv[1:3] == ["bench", "routing"]  # the load generator's process


def _dump_every(seconds: float, role: str, state: dict[str, list[object]]) -> None:
    """Append what ``state``'s lists gained, a JSON line per item, now and then and once more
    at exit (items are appended to the lists complete, so each is written once)."""
    import atexit
    import json
    import threading
    import time

    path = f"{_FOLDER}/{role}-{os.getpid()}.jsonl"
    written = dict.fromkeys(state, 0)
    lock = threading.Lock()

    def dump() -> None:
        with lock, open(path, "a") as f:
            for key, items in state.items():
                end = len(items)
                f.writelines(json.dumps([key, item]) + "\n" for item in items[written[key]:end])
                written[key] = end

    def loop() -> None:
        while True:
            time.sleep(seconds)
            dump()

    atexit.register(dump)
    threading.Thread(target=loop, daemon=True, name="path-probe").start()


def probe_gateway() -> None:
    """Record a ``kvflow gateway`` process's requests, hop by hop."""
    import asyncio
    import contextvars
    import time

    from kvflow.gateway import app, httpserver
    from kvflow.router import request as router_request
    from kvflow.router.router import Router

    mono, thread_time = time.monotonic, time.thread_time
    records: list[object] = []
    lag: list[object] = []
    current: contextvars.ContextVar[dict[str, float | str] | None] = contextvars.ContextVar("probe", default=None)
    _dump_every(1.0, "gateway", {"requests": records, "loop_lag": lag})

    async def lag_monitor() -> None:
        while True:
            t = mono()
            await asyncio.sleep(0.005)
            lag.append(mono() - t - 0.005)

    started: list[asyncio.Task[None]] = []
    handle, serve, try_targets, stream = app.Gateway.handle, app.Gateway._serve, app.try_targets, app.stream_response
    tokenize, decide = router_request.prompt_token_ids, Router.decide  # inside Router.route, the gateway's one call

    begin = httpserver._Connection.on_message_begin

    def began(self):  # type: ignore[no-untyped-def]
        # on the connection: a pipelined request would read its successor's (no client here pipelines)
        self.path_probe_began = mono()
        return begin(self)

    httpserver._Connection.on_message_begin = began

    async def handled(self, request, out):  # type: ignore[no-untyped-def]
        if not started:
            started.append(asyncio.get_running_loop().create_task(lag_monitor()))
        current.set({"handled": mono(), "began": getattr(out._conn, "path_probe_began", None)})
        return await handle(self, request, out)

    async def serving(self, request, out, ex, *args):  # type: ignore[no-untyped-def]
        record = current.get()
        if record is not None:
            record.update(serving=mono(), rid=ex.request_id)
        return await serve(self, request, out, ex, *args)

    def timed(fn, key):  # type: ignore[no-untyped-def]
        def wrapper(self, *args):  # type: ignore[no-untyped-def]
            t, cpu = mono(), thread_time()
            try:
                return fn(self, *args)
            finally:
                record = current.get()
                if record is not None:
                    record[key], record[key + "_cpu"] = mono() - t, thread_time() - cpu
        return wrapper

    async def sent(upstream, ex, *args, **kwargs):  # type: ignore[no-untyped-def]
        record = current.get()
        if record is not None:
            record["sent"] = mono()
        answer = await try_targets(upstream, ex, *args, **kwargs)
        if record is not None:
            record["first_chunk"] = mono()
        return answer

    async def relayed(out, ex, answer, idle):  # type: ignore[no-untyped-def]
        record = current.get()
        if record is not None and "first_chunk" in record:
            records.append(record)
        return await stream(out, ex, answer, idle)

    app.Gateway.handle, app.Gateway._serve, app.try_targets, app.stream_response = handled, serving, sent, relayed
    router_request.prompt_token_ids, Router.decide = timed(tokenize, "tokenize"), timed(decide, "schedule")


def probe_sim() -> None:
    """Record a ``kvflow sim`` pod's requests: handler, engine arrival, first token written."""
    import re
    import time

    from kvflow.sim import choices, server

    mono = time.monotonic
    records: list[object] = []
    waiting: dict[int, tuple[dict[str, float | str | None], object]] = {}
    _dump_every(1.0, "sim", {"requests": records})
    completions, stream, chunks = server.completions, server._stream, choices.Generation.chunks

    seed_of = re.compile(rb'"seed":\s*(\d+)')

    async def handler(request):  # type: ignore[no-untyped-def]
        record = request["path_probe"] = {"rid": request.headers.get("X-Request-Id"), "handler": mono(),
                                          "pod": request.host}
        found = seed_of.search(await request.read())  # aiohttp keeps the body for the handler
        if found:
            record["seed"] = int(found[1])
        return await completions(request)

    async def streamed(request, state, gen, *args):  # type: ignore[no-untyped-def]
        record = request.get("path_probe")
        if record is not None:
            waiting[id(gen)] = (record, gen.choices[0].req)
        return await stream(request, state, gen, *args)

    def first_out(self, fmt, holdback):  # type: ignore[no-untyped-def]
        out, finished = chunks(self, fmt, holdback)
        found = waiting.get(id(self))
        if found is not None and out and found[1].first_token_at is not None:  # type: ignore[attr-defined]
            del waiting[id(self)]
            record, req = found
            record.update(engine=req.arrival, first_token=req.first_token_at, written=mono())  # type: ignore[attr-defined]
            records.append(record)
        return out, finished

    server.completions, server._stream, choices.Generation.chunks = handler, streamed, first_out


def probe_client() -> None:
    """Record each request the routing benchmark's load generator sends: its seed, when it was
    sent and when its first token came (``kvbench.loadgen.run``, wrapped)."""
    import functools
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, where kvbench is
    from kvbench import loadgen

    records: list[object] = []
    _dump_every(1.0, "client", {"requests": records})
    run = loadgen.run

    @functools.wraps(run)
    async def recorded(url, trace, **kwargs):  # type: ignore[no-untyped-def]
        got = await run(url, trace, **kwargs)
        for result, request in zip(got.results, trace.requests):
            if result.ok:  # perf_counter is the machine's monotonic clock, as the other records'
                records.append({"seed": request.seed, "sent": got.started + result.sent,
                                "first": got.started + result.first})
        return got

    loadgen.run = recorded


if _BENCH:
    probe_client()
elif _ROLE == "gateway":
    probe_gateway()
elif _ROLE == "sim":
    probe_sim()
