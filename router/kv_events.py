"""vLLM KV events over ZMQ → the precise prefix index.

vLLM (``vllm/distributed/kv_events.py``) publishes on a ZMQ PUB socket, one multipart message
per batch: ``[topic, seq (8-byte big-endian), payload]``. The payload is msgpack of an
``array_like`` msgspec struct ``[ts, [event, ...], dp_rank?]``; each event is a map tagged by
``"type"`` (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``,
``BlockRemoved``, ``AllBlocksCleared``), as vLLM 0.32 sends them (docs/vllm-protocols.md).
Older vLLM versions made events ``array_like`` too (``["BlockStored", hashes, parent, ...]``);
both decode, and unknown extra fields are ignored. Hashes arrive as ints (the default) or as
32-byte digests; both become the int form ``kvflow.hashing.to_external`` gives.

The index is keyed by the router's own fingerprints (``fingerprint.py``), not by vLLM's
hashes: ``apply`` fingerprints each stored block from its tokens and extra keys, chained on
its parent's fingerprint (looked up by the parent's vLLM hash; no parent: the root), and the
index remembers vLLM's hash of each block, by which ``BlockRemoved`` and later children name
it. A block whose parent the router never heard of (events missed) cannot be fingerprinted;
nor can one whose tokens do not line up with its hashes (another block size): both are
skipped and counted (they could not be matched anyway: a prefix walk reaches a block only
through its parent).

The router connects one SUB socket to each pod's publisher (vLLM binds ``tcp://*:5557``). A
sequence number that goes backwards means the pod restarted with an empty cache: its blocks
are cleared from the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvflow.blockbytes import as_int64
from kvflow.hashing import external_int
from kvflow.router.fingerprint import event_keys
from kvflow.router.prefix_index import PrefixIndex, SpeculativeIndex
from kvflow.throttle import ThrottledLog
from kvflow.endpoints import Endpoint, EndpointId

log = logging.getLogger(__name__)
throttled = ThrottledLog(log)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent: int | None
    block_size: int | None = None
    token_ids: tuple[int, ...] = ()
    """The stored blocks' tokens, block after block."""
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Each block's extra keys as vLLM publishes them (untagged: LoRA name, multimodal
    ``(identifier, offset)`` pairs, cache salt, prompt-embedding digests), or None."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


MAX_HASHES_PER_EVENT = 1 << 16
"""More blocks than any one request stores (a million-token prompt at block size 16)."""
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKENS_PER_EVENT = 1 << 21
"""Twice the longest prompt the router accepts."""
MAX_KEY_LENGTH = 1024
"""Characters (or bytes) in a LoRA name or one extra key; extra keys per block: 64."""


class BadEvent(ValueError):
    """A KV event that breaks the protocol: its whole batch is dropped."""


def _ext(h: Any) -> int:
    """A published block hash → the int form the index keys on; BadEvent for anything else."""
    if isinstance(h, (bytes, bytearray)):
        if not 0 < len(h) <= 64:
            raise BadEvent(f"block hash of {len(h)} bytes")
        return external_int(h)
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 64:
        raise BadEvent(f"block hash {h!r:.40} is not a 64-bit unsigned int or a digest")
    return h


def _hashes(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_HASHES_PER_EVENT:
        raise BadEvent("block_hashes is not a list of at most 65536 hashes")
    return tuple(_ext(h) for h in raw)


_POSITIONS = {"block_hashes": 0, "parent_block_hash": 1, "token_ids": 2, "block_size": 3, "lora_name": 6,
              "extra_keys": 7}


def _tokens(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_TOKENS_PER_EVENT or as_int64(raw) is None:
        raise BadEvent("token_ids is not a list of at most 2**21 int64 token ids")
    return tuple(raw)


def _name(raw: Any) -> str | None:
    if raw is not None and (not isinstance(raw, str) or len(raw) > MAX_KEY_LENGTH):
        raise BadEvent(f"lora_name {raw!r:.40}")
    return raw


def _scalar_key(k: Any) -> bool:
    if isinstance(k, (str, bytes)):
        return len(k) <= MAX_KEY_LENGTH
    return k is None or (isinstance(k, int) and not isinstance(k, bool) and -(1 << 63) <= k < 1 << 64)


def _key(k: Any) -> bool:
    if isinstance(k, (list, tuple)):
        return len(k) <= 4 and all(map(_scalar_key, k))
    return _scalar_key(k)


def _extra_keys(raw: Any, blocks: int) -> tuple[Any, ...] | None:
    """Per block: None, or up to 64 keys, each a string, bytes, an int, or a pair of them
    (multimodal ``(identifier, offset)``)."""
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) != blocks:
        raise BadEvent("extra_keys is not a list with one entry per block")
    out: list[Any] = []
    for keys in raw:
        if keys is not None:
            if not isinstance(keys, (list, tuple)) or len(keys) > 64:
                raise BadEvent("a block's extra_keys is not a list of at most 64 keys")
            if not all(map(_key, keys)):
                raise BadEvent("an extra key is not a string, bytes, an int or a short list of them")
            keys = tuple(tuple(k) if isinstance(k, list) else k for k in keys)
        out.append(keys)
    return tuple(out)


def _fields(raw: Any) -> tuple[Any, Any]:
    """(tag, field getter) for a map-tagged or array-tagged event."""
    if isinstance(raw, dict):
        return raw.get("type"), raw.get
    if isinstance(raw, (list, tuple)) and raw:
        rest = raw[1:]

        def get(name: str, default: Any = None) -> Any:
            i = _POSITIONS[name]
            return rest[i] if i < len(rest) else default

        return raw[0], get
    return None, None


def decode_event(raw: Any) -> KvEvent | None:
    tag, get = _fields(raw)
    if tag == "BlockStored":
        parent = get("parent_block_hash")
        size = get("block_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE):
            raise BadEvent(f"block_size {size!r:.40}")
        hashes = _hashes(get("block_hashes"))
        return BlockStored(
            hashes, None if parent is None else _ext(parent), size, _tokens(get("token_ids")),
            _name(get("lora_name")), _extra_keys(get("extra_keys"), len(hashes)),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(get("block_hashes")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> list[KvEvent]:
    """One published payload → its events; unknown event types are skipped.

    Nothing a pod sends is trusted: a payload that is not vLLM's shape, or any event field out of
    range (a hash that is not a 64-bit int or a digest, a negative block size...), is a
    ``BadEvent`` for the whole batch, so the index never applies half of one.
    """
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadEvent(f"not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise BadEvent("KV event batch is not [ts, events, ...]")
    return [e for e in (decode_event(raw) for raw in batch[1]) if e is not None]


def stored_fingerprints(index: PrefixIndex, event: BlockStored) -> list[int] | None:
    """The fingerprints of the blocks a ``BlockStored`` reports, or None when they cannot be
    computed: a parent the index does not know, or tokens that do not line up with the hashes
    (another block size, or blocks vLLM left out of the event's hashes)."""
    fingerprinter = index.fingerprinter
    n, size = len(event.block_hashes), fingerprinter.block_size
    if (event.block_size or size) != size or len(event.token_ids) != n * size:
        return None
    parent = fingerprinter.root if event.parent is None else index.fingerprint_of(event.parent)
    if parent is None:
        return None
    return fingerprinter.stored(parent, event.token_ids, event_keys(event.lora_name, event.extra_keys, n))


def apply(
    index: PrefixIndex, endpoint: EndpointId, events: list[KvEvent], speculative: SpeculativeIndex | None = None
) -> int:
    """Events into the index; a guess about a block (speculative) ends once an event speaks of
    it. Returns how many ``BlockStored`` events could not be fingerprinted (skipped)."""
    skipped = 0
    for event in events:
        if isinstance(event, BlockStored):
            keys = stored_fingerprints(index, event)
            if keys is None:
                skipped += 1
                continue
            index.add(endpoint, keys, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            keys = index.remove_hashes(endpoint, event.block_hashes)
        else:
            index.clear(endpoint)
            if speculative is not None:
                speculative.clear(endpoint)
            continue
        if speculative is not None:
            speculative.discard(endpoint, keys)
    return skipped


Counted = Callable[[EndpointId, str], None]
RESTART_BACKOFF = (0.1, 5.0)
"""A failed subscriber is restarted after 0.1 s, doubling up to 5 s while it keeps failing."""


class KvEventSubscriber:
    """One SUB socket and task per endpoint, feeding one ``PrefixIndex``."""

    def __init__(
        self,
        index: PrefixIndex,
        on_event: Counted | None = None,
        speculative: SpeculativeIndex | None = None,
        heard: set[EndpointId] | None = None,
        on_problem: Counted | None = None,
    ) -> None:
        self.index = index
        self.on_event = on_event
        self.on_problem = on_problem
        """Hears ``(endpoint, "bad_batch" | "restart" | "unchained")``: the router counts them in
        a metric (``unchained``: a ``BlockStored`` whose blocks could not be fingerprinted)."""
        self.speculative = speculative
        self.heard: set[EndpointId] = heard if heard is not None else set()
        """Endpoints that have sent at least one batch."""
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[EndpointId, asyncio.Task[None]] = {}
        self.last_seq: dict[EndpointId, int] = {}

    def add(self, endpoint: Endpoint, address: str | Sequence[str], replay: str | None = None) -> None:
        """Subscribe to ``address``, or to each of several (a data-parallel pod publishes one
        stream per rank, each with its own sequence numbers); ``replay`` is the pod's (first
        rank's) replay socket, asked for missed batches."""
        if endpoint.id in self._tasks:
            return
        addresses = [address] if isinstance(address, str) else list(address)
        runs = [self._run(endpoint.id, a, replay if rank == 0 else None, rank) for rank, a in enumerate(addresses)]
        self._tasks[endpoint.id] = asyncio.create_task(
            runs[0] if len(runs) == 1 else _all(runs), name=f"kv-events {addresses[0]}")

    async def remove(self, endpoint_id: EndpointId) -> None:
        task = self._tasks.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.index.clear(endpoint_id)
        for stream in [s for s in self.last_seq if s == endpoint_id or s.startswith(f"{endpoint_id}#")]:
            del self.last_seq[stream]
        self.heard.discard(endpoint_id)

    async def close(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)
        self._ctx.destroy(linger=0)

    async def _run(self, endpoint_id: EndpointId, address: str, replay: str | None, rank: int = 0) -> None:
        """Subscribe for as long as the endpoint is in the pool: a subscriber that fails for any
        reason is logged, counted and started again (its index is kept: the sequence numbers
        tell whether batches were missed)."""
        backoff = RESTART_BACKOFF[0]
        while True:
            try:
                await self._subscribe(endpoint_id, address, replay, rank)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - whatever broke, the pod's events must keep flowing
                log.exception("KV-event subscriber for %s failed; restarting in %.1fs", endpoint_id, backoff)
                self._problem(endpoint_id, "restart")
                await asyncio.sleep(backoff)
                backoff = min(RESTART_BACKOFF[1], backoff * 2)

    def _problem(self, endpoint_id: EndpointId, kind: str) -> None:
        if self.on_problem is not None:
            self.on_problem(endpoint_id, kind)

    async def _subscribe(self, endpoint_id: EndpointId, address: str, replay: str | None, rank: int = 0) -> None:
        stream = endpoint_id if rank == 0 else EndpointId(f"{endpoint_id}#{rank}")  # sequence numbers per rank
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 2:
                    continue
                seq = int.from_bytes(frames[1], "big") if len(frames) >= 3 and len(frames[1]) == 8 else None
                last = self.last_seq.get(stream)
                if replay and seq is not None and last is not None and seq > last + 1:
                    await self._replay(endpoint_id, replay, last + 1, seq)
                self._handle(endpoint_id, seq, frames[-1], stream)
        finally:
            sock.close(linger=0)

    async def _replay(self, endpoint_id: EndpointId, address: str, first: int, upto: int) -> None:
        """Fetch and apply batches ``first .. upto-1`` from the pod's replay socket.

        The PUB socket drops messages past its high-water mark; without the missed
        ``BlockRemoved`` events the index would believe in evicted blocks forever.
        """
        try:
            batches = await fetch_replay(self._ctx, address, first)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("KV-event replay from %s failed (%s): %d batches lost", endpoint_id, exc, upto - first)
            return
        for seq, payload in batches:
            if first <= seq < upto:
                self._handle(endpoint_id, seq, payload)

    def _handle(self, endpoint_id: EndpointId, seq: int | None, payload: bytes,
                stream: EndpointId | None = None) -> None:
        stream = stream or endpoint_id
        if seq is not None:
            last = self.last_seq.get(stream)
            if last is not None and seq <= last:
                # The publisher restarted: whatever we knew about its cache is gone.
                self.index.clear(endpoint_id)
            self.last_seq[stream] = seq
        try:
            events = decode_batch(payload)
        except (BadEvent, TypeError, IndexError, AttributeError) as exc:
            throttled.warning(endpoint_id, "dropped a bad KV-event batch from %s: %s", endpoint_id, exc)
            self._problem(endpoint_id, "bad_batch")
            return
        self.heard.add(endpoint_id)
        for _ in range(apply(self.index, endpoint_id, events, self.speculative)):
            self._problem(endpoint_id, "unchained")
        if self.on_event is not None:
            for event in events:
                self.on_event(endpoint_id, type(event).__name__)


REPLAY_END = (-1).to_bytes(8, "big", signed=True)


async def fetch_replay(
    ctx: zmq.asyncio.Context, address: str, start: int, *, timeout: float = 1.0
) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol: send ``[b"", start seq]`` to its ROUTER socket; it answers
    ``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", -1 (8 bytes), b""]``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            if len(frames) < 2 or frames[-2] == REPLAY_END:
                return batches
            batches.append((int.from_bytes(frames[-2], "big"), frames[-1]))
    finally:
        sock.close(linger=0)


async def _all(runs: list[Any]) -> None:
    """Run one subscription per rank; cancelling the task cancels them all."""
    await asyncio.gather(*runs)
