"""vLLM KV events over ZMQ → the precise prefix index.

vLLM (``vllm/distributed/kv_events.py``) publishes on a ZMQ PUB socket, one multipart message
per batch: ``[topic, seq (8-byte big-endian), payload]``. The payload is msgpack of an
``array_like`` msgspec struct ``[ts, [event, ...], dp_rank?]``; each event is a map tagged by
``"type"`` (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``,
``BlockRemoved``, ``AllBlocksCleared``), as vLLM 0.32 sends them (docs/vllm-protocols.md).
Older vLLM versions made events ``array_like`` too (``["BlockStored", hashes, parent, ...]``);
both decode, and unknown extra fields are ignored. Hashes arrive as ints (the default) or as
32-byte digests; both become the int form ``kvflow.hashing.to_external`` gives. The schema and
its validating decoder (``decode_batch``, ``BadEvent``) are ``kvflow.protocol.kv_events``, the
definition the simulator encodes with; this module subscribes and applies.

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
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvflow.protocol.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BadEvent,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_runs,
)
from kvflow.router.fingerprint import event_keys
from kvflow.router.prefix_index import PrefixIndex, SpeculativeIndex
from kvflow.throttle import ThrottledLog
from kvflow.endpoints import Endpoint, EndpointId

log = logging.getLogger(__name__)
throttled = ThrottledLog(log)


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
    removed: list[int] = []
    """Hashes of consecutive GPU ``BlockRemoved`` events (vLLM sends one per evicted block),
    removed together when the run ends: removals commute, and one call costs what one block did."""
    for event in events:
        if type(event) is BlockRemoved and event.medium is None:
            removed += event.block_hashes
            continue
        if removed:
            _remove(index, endpoint, removed, speculative)
            removed = []
        if isinstance(event, BlockRemoved):  # from an offload tier: the GPU copy, if any, stays
            if event.medium == MEDIUM_CPU:
                index.cpu.remove_hashes(endpoint, event.block_hashes)
        elif isinstance(event, BlockStored) and event.medium is not None:
            if event.medium == MEDIUM_CPU and not _offloaded(index, endpoint, event):
                skipped += 1
        elif isinstance(event, BlockStored):
            keys = stored_fingerprints(index, event)
            if keys is None:
                skipped += 1
                continue
            index.add(endpoint, keys, event.block_hashes)
            if speculative is not None:
                speculative.discard(endpoint, keys)
        else:
            index.clear(endpoint)
            if speculative is not None:
                speculative.clear(endpoint)
    if removed:
        _remove(index, endpoint, removed, speculative)
    return skipped


def _offloaded(index: PrefixIndex, endpoint: EndpointId, event: BlockStored) -> bool:
    """The CPU tier stored these blocks. The connector's event names them by vLLM's hash alone
    (no tokens, no parent): each is known by the fingerprint the GPU index holds for the hash,
    since the connector copies a block while the GPU holds it. False if any was unknown (those
    are skipped: a prefix walk could not reach them)."""
    fingerprints, hashes = [], []
    for h in event.block_hashes:
        fp = index.fingerprint_of(h)
        if fp is not None:
            fingerprints.append(fp)
            hashes.append(h)
    index.cpu.store(endpoint, fingerprints, hashes)
    return len(hashes) == len(event.block_hashes)


def _remove(index: PrefixIndex, endpoint: EndpointId, hashes: list[int], speculative: SpeculativeIndex | None) -> None:
    keys = index.remove_hashes(endpoint, hashes)
    if speculative is not None:
        speculative.removed(endpoint, keys)


SLICE_BLOCKS = 64
"""Blocks the subscriber applies between two turns of the event loop (a slice the loop can afford).

A pod publishes the blocks a prefill stored in the same engine step as the request's first
token, so the gateway reads the two together. Applied whole, a batch of a long prompt's
hundreds of blocks holds the event loop for milliseconds while that first token waits to be
relayed; in slices, the first token is relayed after one slice at most. (A long event whose
blocks cannot be fingerprinted is counted ``unchained`` once per slice.)"""


def slices(events: list[KvEvent], max_blocks: int = SLICE_BLOCKS) -> Iterator[list[KvEvent]]:
    """``events`` in order, in runs of at most ``max_blocks`` blocks each (an
    ``AllBlocksCleared`` counts as one). A longer ``BlockStored`` is cut into consecutive ones,
    each chained on the last block of the one before: applied in order, they store what it
    stores. A longer ``BlockRemoved`` (a run of them, ``decode_runs``) is cut likewise."""
    part: list[KvEvent] = []
    n = 0
    for event in events:
        if isinstance(event, AllBlocksCleared):
            size = 1
        elif (size := len(event.block_hashes)) > max_blocks:
            cuts = _cut(event, max_blocks) if isinstance(event, BlockStored) else _cut_removed(event, max_blocks)
            if len(cuts) > 1:
                if part:
                    yield part
                    part, n = [], 0
                for cut in cuts:
                    yield [cut]
                continue
        if part and n + size > max_blocks:
            yield part
            part, n = [], 0
        part.append(event)
        n += size
    if part:
        yield part


def _cut_removed(event: BlockRemoved, max_blocks: int) -> list[KvEvent]:
    hashes = event.block_hashes
    return [BlockRemoved(hashes[i : i + max_blocks], event.medium) for i in range(0, len(hashes), max_blocks)]


def _cut(event: BlockStored, max_blocks: int) -> list[KvEvent]:
    """``event`` as consecutive events of at most ``max_blocks`` blocks (itself alone when its
    tokens do not line up with its blocks: it is skipped as it is)."""
    hashes, tokens, keys = event.block_hashes, event.token_ids, event.extra_keys
    size, rest = divmod(len(tokens), len(hashes))
    if rest or (event.block_size or size) != size:
        return [event]
    return [
        BlockStored(
            hashes[i : i + max_blocks], event.parent if i == 0 else hashes[i - 1], event.block_size,
            tokens[i * size : (i + max_blocks) * size], event.lora_name,
            None if keys is None else keys[i : i + max_blocks], event.medium,
        )
        for i in range(0, len(hashes), max_blocks)
    ]


Counted = Callable[[EndpointId, str, int], None]
"""``(endpoint, event type, how many)``: once per type and batch, not once per event."""
Problem = Callable[[EndpointId, str], None]
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
        on_problem: Problem | None = None,
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
        self.heard_at: dict[EndpointId, tuple[float, float | None]] = {}
        """Per endpoint, when its last batch was applied (unix time) and how long after the pod
        stamped it (the status API's KV-event lag; None for a stamp that is not a float)."""

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
        self.heard_at.pop(endpoint_id, None)

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
                await self._handle(endpoint_id, seq, frames[-1], stream)
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
                await self._handle(endpoint_id, seq, payload)

    async def _handle(self, endpoint_id: EndpointId, seq: int | None, payload: bytes,
                      stream: EndpointId | None = None) -> None:
        """Check a whole batch, then apply it in slices (``SLICE_BLOCKS``), letting the event loop
        turn between them."""
        stream = stream or endpoint_id
        if seq is not None:
            last = self.last_seq.get(stream)
            if last is not None and seq <= last:
                # The publisher restarted: whatever we knew about its cache is gone.
                self.index.clear(endpoint_id)
            self.last_seq[stream] = seq
        try:
            events, counts = decode_runs(payload)
        except (BadEvent, TypeError, IndexError, AttributeError) as exc:
            throttled.warning(endpoint_id, "dropped a bad KV-event batch from %s: %s", endpoint_id, exc)
            self._problem(endpoint_id, "bad_batch")
            return
        self.heard.add(endpoint_id)
        now = time.time()
        self.heard_at[endpoint_id] = (now, _lag(payload, now))
        for i, part in enumerate(slices(events)):
            if i:
                await asyncio.sleep(0)
            for _ in range(apply(self.index, endpoint_id, part, self.speculative)):
                self._problem(endpoint_id, "unchained")
        if self.on_event is not None:
            for kind, n in counts.items():
                self.on_event(endpoint_id, kind, n)


def _lag(payload: bytes, now: float) -> float | None:
    """``now`` less the batch's ``ts``, read from its msgpack head (an array, then a float 64)
    without decoding the rest; None where the head is another shape."""
    if len(payload) >= 10 and 0x92 <= payload[0] <= 0x9F and payload[1] == 0xCB:
        return now - struct.unpack_from(">d", payload, 2)[0]
    return None


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
