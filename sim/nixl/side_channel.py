"""The P/D side channel: how a decode pod gets a prefill pod's NIXL agent metadata.

The wire protocol is vLLM NixlConnector's (0.32, see docs/vllm-protocols.md §5): the prefill pod
binds a ZMQ ROUTER on ``tcp://<side-channel host>:<side-channel port>``; a decode pod connects a
REQ socket, sends msgpack ``(b"get_meta_msg", pp_rank, tp_rank)`` (older vLLM: without
``pp_rank``) and receives two frames: a msgpack ``HandshakePayload`` — a compatibility hash and
the msgpack-encoded ``AgentMetadata`` (engine id, NIXL agent metadata, region base addresses,
block count and lengths, layout, block size) — and msgpack of the server's ``perf_counter()``.
The structs encode as maps with vLLM's field names (a subset of vLLM's metadata fields).

The server runs on the event loop (``zmq.asyncio``); the client gives up after a timeout, since a
dead prefill pod never answers a REQ. Each handshake also tells the local agent to progress
promptly for a while, because the peer is about to open a UCX connection to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from kvflow.sim.nixl.layout import KVLayout

log = logging.getLogger(__name__)

GET_META_MSG = b"get_meta_msg"
LAYOUT = "HND"


class AgentMetadata(msgspec.Struct):
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    kv_cache_layout: str
    block_size: int


class HandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


class HandshakeError(Exception):
    """The peer did not answer, answered garbage, or runs an incompatible KV layout."""


def compatibility_hash(layout: KVLayout, model: str = "") -> str:
    """What must match for two pods' blocks to be interchangeable (vLLM hashes the same kind of facts)."""
    facts = f"kvflow-nixl-v1|{model}|{layout.num_layers}|{layout.num_kv_heads}|{layout.head_dim}|" \
            f"{layout.dtype_bytes}|{layout.block_size}|{LAYOUT}"
    return hashlib.sha256(facts.encode()).hexdigest()


def encode_payload(meta: AgentMetadata, compat: str) -> bytes:
    inner = msgspec.msgpack.encode(meta)
    return msgspec.msgpack.encode(HandshakePayload(compat, inner))


def decode_payload(data: bytes, compat: str, engine_id: str) -> AgentMetadata:
    """Check the hash before decoding the inner metadata, then check it is the expected engine."""
    try:
        payload = msgspec.msgpack.decode(data, type=HandshakePayload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"undecodable handshake payload: {exc}") from exc
    if payload.compatibility_hash != compat:
        raise HandshakeError("incompatible KV layout (compatibility hash differs)")
    try:
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=AgentMetadata)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"undecodable agent metadata: {exc}") from exc
    if meta.engine_id != engine_id:
        raise HandshakeError(f"expected engine {engine_id}, side channel serves {meta.engine_id}")
    return meta


def is_meta_request(body: bytes) -> bool:
    """``(b"get_meta_msg", tp_rank)`` or ``(b"get_meta_msg", pp_rank, tp_rank)``, msgpack-encoded."""
    try:
        message = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(message, list) and len(message) in (2, 3) and message[0] == GET_META_MSG


class SideChannelServer:
    """Answers handshakes with this pod's encoded metadata until closed."""

    def __init__(self, host: str, port: int, payload: bytes, on_handshake: Callable[[], None]) -> None:
        self._address = f"tcp://{host}:{port}"
        self._payload = payload
        self._on_handshake = on_handshake
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._address)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(sock), name="nixl-side-channel")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("side channel: dropping a %d-frame message", len(frames))
                continue
            identity, _, body = frames
            if not is_meta_request(body):
                log.warning("side channel: unexpected message %r", body[:64])
                continue
            self._on_handshake()
            clock = msgspec.msgpack.encode(time.perf_counter())
            await sock.send_multipart([identity, b"", self._payload, clock])


async def fetch_metadata(host: str, port: int, *, compat: str, engine_id: str, timeout: float,
                         ctx: zmq.asyncio.Context, pp_rank: int = 0, tp_rank: int = 0) -> AgentMetadata:
    """One handshake with a prefill pod's side channel; ``HandshakeError`` on any failure."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank)))
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            data = frames[0]  # a second frame, the peer's clock, is not needed here
        except TimeoutError as exc:
            raise HandshakeError(f"no answer from {host}:{port} within {timeout:g}s") from exc
    except zmq.ZMQError as exc:
        raise HandshakeError(f"side channel {host}:{port}: {exc}") from exc
    finally:
        sock.close(linger=0)
    return decode_payload(data, compat, engine_id)
