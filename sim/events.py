"""KV-cache events on the wire, laid out exactly as vLLM publishes them, and their publisher.

vLLM (``vllm/distributed/kv_events.py``) sends one ZMQ multipart message per engine step::

    [topic (utf-8), sequence (8-byte big-endian), msgpack(EventBatch)]

``EventBatch`` is a msgspec array ``[ts, [event, ...], data_parallel_rank]``; each event is a
msgspec *tagged map* ``{"type": "BlockStored", ...}`` whose fields with default values are
omitted. The structs below reproduce that schema field for field (order, defaults, tagging), so
msgspec encodes byte-identical payloads. The socket is a PUB that **binds** when the endpoint
holds a wildcard (``tcp://*:5557``) or is ipc/inproc, and **connects** otherwise — the rule of
vLLM's ``ZmqEventPublisher`` (plus: the pod's own address binds, see ``is_bind_endpoint``); an
optional ROUTER replay endpoint serves missed batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvflow.hashing import ExternalBlockHash

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
KV_CACHE_SPEC_KIND = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the tagged events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: list[Any], *, ts: float | None = None, dp_rank: int = 0) -> bytes:
    return _ENCODER.encode(EventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=dp_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """The typed batch in a payload (what a subscriber such as the router does)."""
    return _DECODER.decode(payload)


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
