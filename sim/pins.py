"""Exported requests' blocks, pinned under a lease: the prefill side's bookkeeping, for every KV transfer.

A prefill pod keeps a finished ``do_remote_decode`` request's blocks until a decode pod has
them or the lease runs out (vLLM 0.32's ``kv_lease_duration``, ``--kv-pin-timeout``). vLLM's
heartbeats may move the end of a lease later, never earlier. Deadlines are read on an injected
``Clock``; one task expires them, sleeping until the earliest, and waits on an event while
nothing is pinned (an idle pod runs no timer).

Why one sleeper is enough: a new pin ends ``lease_s`` from now, which is never before any
existing deadline (each was set at most ``lease_s`` from an earlier now: heartbeats extend by
less than a lease), so the earliest deadline never moves earlier while the task sleeps towards it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from kvflow.sim.clock import Clock


class Pins:
    def __init__(self, clock: Clock, lease_s: float, on_expired: Callable[[str], None]) -> None:
        self.clock = clock
        self.lease_s = lease_s
        self._on_expired = on_expired
        self._deadlines: dict[str, float] = {}
        self._held = asyncio.Event()  # set while anything is pinned: the expiry task runs
        self._task: asyncio.Task[None] | None = None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)

    def deadline(self, request_id: str) -> float | None:
        """When the request's lease ends, on the clock; None if it is not pinned."""
        return self._deadlines.get(request_id)

    def pin(self, request_id: str) -> None:
        """Pin for one lease from now (a request id pinned again gets a fresh lease)."""
        self._deadlines[request_id] = self.clock.now() + self.lease_s
        self._held.set()

    def release(self, request_id: str) -> bool:
        """Unpin; whether it was pinned (a release after expiry, or twice, does nothing)."""
        if self._deadlines.pop(request_id, None) is None:
            return False
        if not self._deadlines:
            self._held.clear()
        return True

    def extend(self, request_id: str, seconds: float) -> bool:
        """Make the lease end no earlier than ``seconds`` from now; whether that moved it."""
        deadline = self._deadlines.get(request_id)
        later = self.clock.now() + seconds
        if deadline is None or deadline >= later:
            return False
        self._deadlines[request_id] = later
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._expire_forever(), name="kv-pin-leases")

    async def stop(self) -> None:
        """Stop expiring and forget every pin (the engine is going away with its blocks)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._deadlines.clear()
        self._held.clear()

    async def _expire_forever(self) -> None:
        while True:
            await self._held.wait()
            await self.clock.sleep_until(min(self._deadlines.values()))
            self.expire()

    def expire(self) -> None:
        """Release every pin whose lease has ended, calling ``on_expired`` for each."""
        now = self.clock.now() + self.clock.resolution
        for request_id in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            self.release(request_id)
            self._on_expired(request_id)
