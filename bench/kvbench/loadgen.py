"""An open-loop, streaming load generator on aiohttp.

Sends a ``Trace`` to one OpenAI ``/v1/completions`` URL (or each request to a URL of its own):
each request at its time whatever the others are doing (a follow-up turn right after its
previous turn's answer plus the think time), streamed, with the time of the first and the last
token. Bodies are encoded before the clock
starts, the collector leaves the process's older objects alone while it runs, and the
generator's own CPU time and how late it sent are measured, so a run can show the client was
not the bottleneck.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from kvbench.workloads import Trace, TraceRequest, after_warmup


@dataclass(slots=True)
class Result:
    index: int
    scheduled: float = math.nan
    sent: float = math.nan
    first: float = math.nan
    last: float = math.nan
    chunks: int = 0
    tokens: int = 0
    status: int = 0
    error: str = ""
    answer_matches: bool = True
    """The answer is the one the trace expects (the history of later turns assumes it)."""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def itl(self) -> float:
        """Mean gap between this request's streamed tokens (NaN with fewer than two)."""
        return (self.last - self.first) / (self.chunks - 1) if self.chunks > 1 else math.nan


@dataclass(frozen=True, slots=True)
class Run:
    results: tuple[Result, ...]
    wall: float
    cpu: float
    """The generator's own CPU seconds (user + system) over the run."""
    started: float = 0.0
    """``time.perf_counter()`` when the run began: the results' times count from it."""
    warmup: float = 0.0
    """The trace's warm-up (seconds): requests sent before it count in no figure."""

    @property
    def counted(self) -> tuple[Result, ...]:
        """The results the run's figures are of: every one, or those sent after the warm-up."""
        return tuple(r for r in self.results if after_warmup(r.sent, self.warmup))

    @property
    def cpu_share(self) -> float:
        return self.cpu / self.wall if self.wall else 0.0

    @property
    def max_lag(self) -> float:
        """Latest a request was sent after its scheduled time (seconds)."""
        lags = [r.sent - r.scheduled for r in self.results if not math.isnan(r.sent)]
        return max(lags, default=0.0)


def body(req: TraceRequest, model: str) -> bytes:
    return json.dumps({
        "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "seed": req.seed,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


async def run(url: str | Sequence[str], trace: Trace, *, model: str, timeout: float = 120.0,
              on_warm: Callable[[], Awaitable[None]] | None = None) -> Run:
    """``url``: where every request goes, or one per trace request (by index: the live oracle
    sends each straight to the pod the oracle placed it on). ``on_warm``: awaited when the
    trace's warm-up ends (not at all without one), e.g. to read the pods' counters there."""
    urls = [url] * len(trace.requests) if isinstance(url, str) else list(url)
    if len(urls) != len(trace.requests):
        raise ValueError(f"{len(urls)} URLs for {len(trace.requests)} requests")
    # The benchmark's process holds every trace, replay and result it computed before: a full
    # collection over them in the middle of a run stalls this loop, late sends and first tokens with it
    # (bench/RESULTS.md, "The load generator's collector"). Collected and frozen first, they are not scanned again
    # until the run ends; the run's own objects are collected as usual.
    gc.collect()
    gc.freeze()
    try:
        return await _run(urls, trace, model, timeout, on_warm)
    finally:
        gc.unfreeze()


async def _run(urls: Sequence[str], trace: Trace, model: str, timeout: float,
               on_warm: Callable[[], Awaitable[None]] | None) -> Run:
    bodies = [body(r, model) for r in trace.requests]
    results = [Result(r.index) for r in trace.requests]
    children = trace.children()
    roots = sorted((r for r in trace.requests if r.after is None), key=lambda r: r.at)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()

        async def send(req: TraceRequest, scheduled: float) -> None:
            res = results[req.index]
            res.scheduled = scheduled
            res.sent = time.perf_counter() - t0
            try:
                async with session.post(urls[req.index], data=bodies[req.index], headers=headers) as resp:
                    res.status = resp.status
                    if resp.status != 200:
                        res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        return
                    text = await _stream(resp, res, t0)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                res.error = f"{type(exc).__name__}: {exc}"[:200]
                return
            if res.tokens != req.max_tokens:
                res.error = f"{res.tokens} tokens, wanted {req.max_tokens}"
            res.answer_matches = not req.answer or text == req.answer

        async def chain(req: TraceRequest) -> None:
            scheduled = req.at
            while True:
                await send(req, scheduled)
                nxt = children.get(req.index)
                if nxt is None:
                    return
                req = trace.requests[nxt]
                await asyncio.sleep(req.at)
                scheduled = time.perf_counter() - t0

        async def warmed(hook: Callable[[], Awaitable[None]]) -> None:
            await asyncio.sleep(max(0.0, trace.warmup - (time.perf_counter() - t0)))
            await hook()

        tasks = [asyncio.create_task(warmed(on_warm))] if on_warm is not None and trace.warmup > 0 else []
        for root in roots:
            delay = root.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(chain(root)))
        await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return Run(tuple(results), wall, cpu, t0, trace.warmup)


async def _stream(resp: aiohttp.ClientResponse, res: Result, t0: float) -> str:
    parts: list[str] = []
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter() - t0
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or ():
            piece = choice.get("text") or ""
            if piece:
                if res.chunks == 0:
                    res.first = now
                res.last = now
                res.chunks += 1
                parts.append(piece)
        usage = chunk.get("usage")
        if usage:
            res.tokens = int(usage.get("completion_tokens") or 0)
    return "".join(parts)


def errors(results: Sequence[Result]) -> list[str]:
    return [f"#{r.index}: {r.error}" for r in results if r.error]
