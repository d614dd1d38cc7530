"""The simulator's KV-event publisher: vLLM's ZMQ PUB socket (plus its replay ROUTER).

vLLM (``vllm/distributed/kv_events.py``) sends one ZMQ multipart message per engine step::

    [topic (utf-8), sequence (8-byte big-endian), msgpack(EventBatch)]

The payload's schema and encoder are ``kvflow.protocol.kv_events`` (shared with the router's
decoder). The socket is a PUB that **binds** when the endpoint holds a wildcard
(``tcp://*:5557``) or is ipc/inproc, and **connects** otherwise — the rule of vLLM's
``ZmqEventPublisher`` (plus: the pod's own address binds, see ``is_bind_endpoint``); an
optional ROUTER replay endpoint serves missed batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from kvflow.protocol.kv_events import encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_bind_endpoint(endpoint: str, own_host: str | None = None) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints; connect to the rest.

    One addition: an endpoint on the pod's own address (``tcp://<--host>:P``) is bound too.
    vLLM would connect there, which can never work (no other process owns a pod's address), and
    binding lets many local pods, one per 127.0.0.x, publish on the same port.
    """
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    if own_host and endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
        return host == own_host
    return False


class ZmqPublisher:
    """A PUB socket (plus optional ROUTER replay) driven from the event loop.

    ``publish`` never blocks: the PUB socket drops at its high-water mark, as vLLM's does.
    """

    def __init__(
        self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
        buffer_steps: int = 10_000, hwm: int = 100_000, own_host: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context.instance()
        self._binds = is_bind_endpoint(endpoint, own_host)
        # XPUB is PUB on the wire; it also tells us when a subscriber's subscription arrived,
        # so a connecting publisher can wait for it instead of dropping its first batches.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self._binds:
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)

    async def start(self, connect_timeout: float = 2.0) -> None:
        """Start serving replays; when connecting, wait (bounded) for the subscriber."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        if not self._binds:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pub.recv(), connect_timeout)

    def publish(self, events: list[Any], *, ts: float | None = None) -> None:
        """One batch; ``ts`` (Unix time, default now) is when the step that made the events ended."""
        if not events:
            return
        payload = encode_batch(events, ts=ts)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
