"""Prefill side: exported blocks, their leases, and the notifications that free or renew them.

``export`` gives a finished ``do_remote_decode`` request's prompt blocks deterministic content
derived from its token ids (``layout``) and pins them (``Pins``) until a decode pod's done
notification arrives or the lease runs out (``--kv-pin-timeout``, vLLM 0.32's
``kv_lease_duration``). A heartbeat naming a pinned request moves its lease's end to the later
of its deadline and now + 2/3 of the lease (vLLM's ``lease_extension``); ids not pinned here
(freed, expired, never exported) are ignored, and a heartbeat never frees blocks.

While anything is pinned the agent progresses every millisecond (``busy_holds``): decode pods
are about to read the blocks and notify, and both complete only as this pod progresses.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvflow.sim.clock import Clock
from kvflow.sim.nixl.agent import NixlAgent, Notifs
from kvflow.sim.nixl.layout import block_digests, write_blocks
from kvflow.sim.nixl.metrics import NixlMetrics
from kvflow.sim.nixl.notifications import done_request_id, heartbeat_ids
from kvflow.sim.pins import Pins

log = logging.getLogger(__name__)

EXPIRED_MEMORY = 4096
"""Expired request ids remembered, to count the done notifications that come after expiry."""


class Exports:
    def __init__(self, agent: NixlAgent, clock: Clock, lease_s: float, metrics: NixlMetrics,
                 unpin: Callable[[str], None]) -> None:
        self.agent = agent
        self.metrics = metrics
        self.pins = Pins(clock, lease_s, on_expired=self._expired)
        self._unpin = unpin
        self._expired_ids: deque[str] = deque(maxlen=EXPIRED_MEMORY)

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> None:
        digests = block_digests(token_ids, self.agent.layout.block_size)
        n = min(len(block_ids), len(digests))  # fewer blocks than the prompt: the pull will say so
        write_blocks(self.agent.regions, block_ids[:n], digests[:n])
        self.pins.pin(request_id)
        self.agent.busy_holds = len(self.pins)

    def release(self, request_id: str, cause: str = "engine") -> None:
        if self.pins.release(request_id):
            self._freed(request_id, cause)

    def on_notifications(self, notifs: Notifs) -> None:
        """A batch of NIXL notifications from decode pods (the agent's callback)."""
        for messages in notifs.values():
            for message in messages:
                text = message.decode(errors="replace")
                request_ids = heartbeat_ids(text)
                if request_ids is None:
                    self._on_done(done_request_id(text))
                else:
                    self._on_heartbeat(request_ids)

    def _on_done(self, request_id: str) -> None:
        if request_id in self.pins:
            self.release(request_id, "notified")
        elif request_id in self._expired_ids:
            self.metrics.late_notifications.inc()
        else:
            log.info("notification for unknown request %r", request_id)

    def _on_heartbeat(self, request_ids: list[str]) -> None:
        self.metrics.heartbeats_received.inc()
        extension = self.pins.lease_s * 2 / 3  # vLLM's lease_extension
        for request_id in request_ids:
            if self.pins.extend(request_id, extension):
                self.metrics.leases_extended.inc()

    def _expired(self, request_id: str) -> None:
        self.metrics.expired.inc()
        self._expired_ids.append(request_id)
        self._freed(request_id, "expired")

    def _freed(self, request_id: str, cause: str) -> None:
        self.agent.busy_holds = len(self.pins)
        self.metrics.released[cause].inc()
        self._unpin(request_id)
