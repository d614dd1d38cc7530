"""Decode side: vLLM 0.32's lease heartbeats, which keep a waiting request's prefill blocks pinned.

A decode request may wait for free blocks far longer than the prefill pod's lease. From
``track`` (the engine added a ``do_remote_prefill`` request) to ``untrack`` (its pull ended
either way, or it was aborted) the request is named in a heartbeat: every ``interval_s`` (vLLM:
the lease / 6) one notification per prefill engine naming all its tracked requests (``send``
shakes hands first if the engine is new). The first round follows the first ``track`` at once;
an engine whose last heartbeat is still in flight (waiting for its handshake) is skipped that
round, as vLLM skips it. With nothing tracked the task waits on an event: an idle pod runs no
timer. Rounds are timed on the injected ``Clock``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvflow.protocol.kv_transfer import PrefillEngine
from kvflow.sim.clock import Clock


@dataclass(slots=True)
class EngineLeases:
    """The tracked requests waiting on one prefill engine: what its heartbeat names."""

    engine: PrefillEngine
    request_ids: Counter[str] = field(default_factory=Counter)
    """Remote request id → local requests naming it (a client may send the same params twice)."""


Send = Callable[[EngineLeases], Coroutine[Any, Any, None]]
"""One heartbeat to one engine, naming ``request_ids`` as they are when it is sent; never raises."""


class Heartbeats:
    def __init__(self, clock: Clock, interval_s: float, send: Send) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self._send = send
        self._tracked: dict[str, tuple[str, str]] = {}  # local request id -> (engine id, remote request id)
        self._leases: dict[str, EngineLeases] = {}  # by prefill engine id
        self._tracking = asyncio.Event()  # set while anything is tracked: the task runs
        self._task: asyncio.Task[None] | None = None
        self._beats: dict[str, asyncio.Task[None]] = {}  # a heartbeat in flight, by engine id

    def track(self, request_id: str, engine: PrefillEngine, remote_request_id: str) -> None:
        self.untrack(request_id)  # re-added under the same id: only its latest params count
        leases = self._leases.get(engine.engine_id)
        if leases is None:
            leases = self._leases[engine.engine_id] = EngineLeases(engine)
        leases.request_ids[remote_request_id] += 1
        self._tracked[request_id] = (engine.engine_id, remote_request_id)
        self._tracking.set()

    def untrack(self, request_id: str) -> None:
        key = self._tracked.pop(request_id, None)
        if key is None:
            return
        engine_id, remote_id = key
        leases = self._leases[engine_id]
        leases.request_ids[remote_id] -= 1
        if leases.request_ids[remote_id] <= 0:
            del leases.request_ids[remote_id]
        if not leases.request_ids:
            del self._leases[engine_id]  # no key left behind for an engine that went away
        if not self._leases:
            self._tracking.clear()

    @property
    def tracked(self) -> dict[str, list[str]]:
        """Prefill engine id → the remote request ids its heartbeats name (sorted)."""
        return {engine_id: sorted(leases.request_ids) for engine_id, leases in self._leases.items()}

    @property
    def in_flight(self) -> list[str]:
        """Prefill engine ids whose last heartbeat is still being sent: the next round skips them."""
        return sorted(self._beats)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat_forever(), name="nixl-heartbeats")

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._beats.values()) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._tracked.clear()
        self._leases.clear()
        self._tracking.clear()

    async def _beat_forever(self) -> None:
        while True:
            await self._tracking.wait()
            self._round()
            await self.clock.sleep_until(self.clock.now() + self.interval_s)

    def _round(self) -> None:
        loop = asyncio.get_running_loop()
        for engine_id, leases in self._leases.items():
            if engine_id in self._beats:
                continue
            task = loop.create_task(self._send(leases))
            self._beats[engine_id] = task
            task.add_done_callback(partial(self._beat_done, engine_id))

    def _beat_done(self, engine_id: str, _task: asyncio.Task[None]) -> None:
        self._beats.pop(engine_id, None)
