"""kvflow's own router, replayed: the real ``Router`` deciding inside the oracle's simulation.

The replay (``kvbench.oracle.replay``) runs the simulator's scheduler on a virtual clock; this
policy puts an in-process ``kvflow.router.Router`` in it, fed the way it is fed in production:
each pod's KV events (encoded and decoded through the real wire format) after every step, its
``/metrics`` as the scraper would see them every ``scrapeIntervalSeconds`` (spread over the
interval), and its own accounting (``Flight``) told of every dispatch, first token and finish.
The router's clock is the replay's. So a row "kvflow <profile> (replay)" is the routing policy's
quality with no HTTP, no event-loop jitter and no CPU contention: beside the oracle and
round-robin on the same replay, it says how much of a live gap is the policy and how much the
machine, and it is deterministic (a tuning loop runs in seconds).

With ``replicas`` > 1 it is N routers, as N gateway replicas: request *i* decided by router *i*
mod N, every router hearing every pod's events and scrapes, and with ``peers`` each one's sends
told to the others at once (``router/peers.py``, here an in-process bus), so a live replicated
row's gap to one replica is told apart from the machine's share of it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvflow.endpoints import Endpoint
from kvflow.errors import RateLimitError
from kvflow.router import EngineMetrics, Router, SchedulingRequest, load_config
from kvflow.router.flight import Flight
from kvflow.router.peers import Message
from kvflow.protocol.kv_events import decode_batch
from kvflow.router.kv_events import apply
from kvflow.protocol.kv_events import KVEventBatch
from kvflow.sim.profiles import Profile

from kvbench.oracle import HASH, Pod, Prepared

MODEL = "sim-model"
SECRET = b"kvflow-replay".ljust(32, b"\0")
"""The router's fingerprint key in the replay: fixed, so a replay repeats exactly. (The key
decides which blocks the working set samples, so another key is another, equally likely, run;
a live router draws its own.)"""


def secret(i: int) -> bytes:
    """The ``i``-th fingerprint key of the replay: ``SECRET`` first, then keys drawn from ``i``
    (``bench/replay_policy.py --secrets``, ``bench/routing_regret.py --secret``)."""
    return SECRET if i == 0 else hashlib.sha256(f"kvflow-replay-{i}".encode()).digest()


class KvflowReplay:
    """A ``Policy`` and ``Observer`` for ``oracle.replay``: the real router, on the replay's clock."""

    def __init__(self, pods: int, num_blocks: int, *, profile: str = "default",
                 config: Mapping[str, Any] | None = None, secret: bytes = SECRET, replicas: int = 1,
                 peers: bool = True, events: bool = True) -> None:
        self.name = f"kvflow {profile}" + ("" if events else " no-events") + (
            "" if replicas == 1 else f"{'' if peers else ' no-peers'} x{replicas}") + " (replay)"
        self.now = 0.0
        self.endpoints = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(pods)]
        raw = {"kvEvents": {"enabled": False}, "blockSize": HASH.block_size, **(config or {})}
        self.routers = [Router(load_config(raw), self.endpoints, profile=profile, clock=lambda: self.now, secret=secret)
                        for _ in range(replicas)]
        self.router = self.routers[0]
        self.events = events
        """The pods' KV events reach the routers (else they publish none)."""
        if peers and replicas > 1:
            for i, router in enumerate(self.routers):
                router.peers = _Bus(router, self.routers, i)
        self.scrape_interval = self.router.config.scrape_interval
        self.num_blocks = num_blocks
        self.flights: dict[int, Flight] = {}
        self.picks: dict[int, int] = {}
        """Trace request index -> the pod it was sent to."""
        self.decide_seconds = 0.0
        """CPU time the router spent deciding (thread time), for the whole replay."""
        self.unchained = 0
        """``BlockStored`` events the router could not fingerprint (none, when block sizes agree)."""

    def pick(self, prepared: Prepared, pods: Sequence[Pod], now: float, profile: Profile) -> int | None:
        self.now = now
        request = SchedulingRequest(str(prepared.request.index), MODEL, list(prepared.token_ids))
        started = time.thread_time()
        try:
            flight = self.routers[prepared.request.index % len(self.routers)].decide(request)
        except RateLimitError:  # every pod saturated: the gateway answers 429
            self.decide_seconds += time.thread_time() - started
            return None
        result = flight.result
        flight.send(result.targets[0])
        self.decide_seconds += time.thread_time() - started
        self.flights[prepared.request.index] = flight
        pod = self.picks[prepared.request.index] = self.endpoints.index(result.targets[0])
        return pod

    def first_token(self, index: int, now: float) -> None:
        self.now = now
        flight = self.flights.get(index)
        if flight is not None:
            flight.first_token()

    def finished(self, index: int, now: float) -> None:
        self.now = now
        flight = self.flights.pop(index, None)
        if flight is not None:
            flight.finish()

    def stepped(self, pod: Pod, now: float) -> None:
        """The pod's KV events of this step, through the wire format, into the precise index."""
        self.now = now
        events = pod.scheduler.pool.take_events()
        if not events or not self.events:
            return
        eid = self.endpoints[pod.index].id
        payload = msgspec.msgpack.encode(KVEventBatch(ts=now, events=events))
        for router in self.routers:  # every replica subscribes to every pod
            self.unchained += apply(router.precise, eid, decode_batch(payload), router.speculative)
            router.event_sources.add(eid)

    def scraped(self, pod: Pod, now: float) -> None:
        self.now = now
        sched = pod.scheduler
        metrics = EngineMetrics(running=len(sched.running), waiting=sched.num_waiting, kv_usage=sched.pool.usage,
                                block_size=sched.config.block_size, num_blocks=self.num_blocks,
                                models=frozenset({MODEL}))
        endpoint = self.endpoints[pod.index]
        for router in self.routers:
            router.datastore.record_scrape(endpoint.id, metrics, now)
            router.approx.set_capacity(endpoint.id, self.num_blocks)


class _Bus:
    """``router``'s peers, in process: what it tells is heard by every other router at once."""

    def __init__(self, router: Router, routers: Sequence[Router], name: int) -> None:
        self._others = [r for r in routers if r is not router]
        self.sender = name.to_bytes(8, "little")

    def tell(self, message: Message) -> None:
        for other in self._others:
            other.heard(message)
