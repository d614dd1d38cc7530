"""Router replicas of one pool tell each other where they sent each prompt's blocks.

A replica knows what its pods cache from their KV events and, for a pod that publishes none,
from what it routed there itself (the approximate index). With N replicas behind one Service,
each routes a share of the traffic, so without events each one's approximate index holds a
share of the pool's prefixes and gives a prefix a home of its own: N homes where one would do
(a third of the hit rate lost at three replicas). With events, a replica still learns of its
peers' requests only once their prefills end, so a burst of one prefix is spread before any of
them shows.

So each replica publishes each leg of a request it sends as it sends it (``sent``: the pod, the
prompt's block fingerprints, the prefill work and KV it adds there), its first token
(``prefilled``) and its end (``released``, and whether it was undone: the attempt failed before
it computed anything), and applies its peers' as its own (``Router.heard``): their blocks in its
indexes, their legs in its pods' load (``LoadCounter``), queued, prefilling and released as its
own legs are. A pod's scraped queue then counts only what no replica sent (``foreign_waiting``).
The messages are ZeroMQ PUB/SUB, one socket each way, fire-and-forget: a message lost under
load costs affinity, never a request, and a leg whose end was lost leaves after ``LEG_TTL``.
Every replica fingerprints blocks with a secret derived from the key the replicas share
(``peers.keyFile``), so their fingerprints name the same blocks; the same key signs each message
(BLAKE2b, keyed), and a message that does not verify is dropped and counted, so nothing on the
pod network that lacks the key can steer routing.

Wire format, two frames: a 16-byte MAC, then the payload ``version (1) | sender (8) | kind (1) |
leg (8)``, then for ``SENT`` ``work (4) | tokens (4) | taught (1) | id length (2) | endpoint id
(UTF-8) | fingerprints (8 each)`` and for ``RELEASED`` ``undone (1)``; little endian. ``taught``
says whether the sender's approximate index took the blocks (it does for pods without KV events,
and for all pods where the profile reads it), so the receiver does as the sender did.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from kvflow.endpoints import EndpointId, parse_host_port

log = logging.getLogger(__name__)

VERSION = 2
SENT, PREFILLED, RELEASED = 1, 2, 3
_HEAD = struct.Struct("<B8sBQ")
_SENT = struct.Struct("<IIBH")
_MAC_BYTES = 16
MIN_KEY_BYTES = 16
_SEND_HWM = 10_000
"""Messages queued per peer before the newest are dropped (a peer that stopped reading)."""
LEG_TTL = 300.0
"""Seconds a peer's leg counts on its pod when its end was never heard (a lost message, a
replica gone): longer than any request that ends normally takes."""


@dataclass(frozen=True, slots=True)
class Message:
    sender: bytes
    kind: int
    leg: int
    """The sender's name for the leg (unique among its legs in flight)."""
    endpoint: EndpointId = EndpointId("")
    hashes: list[int] = field(default_factory=list)
    taught: bool = False
    work: int = 0
    tokens: int = 0
    undone: bool = False


class Peers(Protocol):
    """Where a router tells its peers what it did (``PeerLink`` over the network; a replay's
    in-process bus): ``sent`` a leg, its prefill ended (``prefilled``), it was ``released``."""

    sender: bytes
    """This router's name on the wire (its messages' ``sender``)."""

    def tell(self, message: Message) -> None: ...


def read_key(path: str) -> bytes:
    """The shared key in ``path`` (its text, stripped); a one-line ``ValueError`` if unusable."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"peers.keyFile {path}: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"peers.keyFile {path}: the key must be at least {MIN_KEY_BYTES} bytes")
    return key


def fingerprint_secret(key: bytes) -> bytes:
    """The block fingerprints' secret every replica sharing ``key`` derives alike."""
    return hashlib.blake2b(key, person=b"kvflow-peers-fp", digest_size=32).digest()


def _mac(key: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(payload, key=key[:64], digest_size=_MAC_BYTES, person=b"kvflow-peers").digest()


def encode(key: bytes, message: Message) -> list[bytes]:
    """A message's two frames (see the module's comment)."""
    payload = _HEAD.pack(VERSION, message.sender, message.kind, message.leg)
    if message.kind == SENT:
        eid = message.endpoint.encode()
        payload += (_SENT.pack(message.work, message.tokens, message.taught, len(eid)) + eid
                    + array("Q", message.hashes).tobytes())
    elif message.kind == RELEASED:
        payload += bytes([message.undone])
    return [_mac(key, payload), payload]


def decode(key: bytes, frames: Sequence[bytes]) -> Message | None:
    """The message, or None if it is not one signed with ``key``."""
    if len(frames) != 2 or not hmac.compare_digest(_mac(key, frames[1]), frames[0]):
        return None
    payload = frames[1]
    if len(payload) < _HEAD.size:
        return None
    version, sender, kind, leg = _HEAD.unpack_from(payload)
    if version != VERSION:
        return None
    rest = payload[_HEAD.size:]
    if kind == PREFILLED and not rest:
        return Message(sender, kind, leg)
    if kind == RELEASED and len(rest) == 1:
        return Message(sender, kind, leg, undone=bool(rest[0]))
    if kind != SENT or len(rest) < _SENT.size:
        return None
    work, tokens, taught, n = _SENT.unpack_from(rest)
    body = rest[_SENT.size + n:]
    if len(body) % 8:
        return None
    hashes = array("Q")
    hashes.frombytes(body)
    try:
        endpoint = EndpointId(rest[_SENT.size: _SENT.size + n].decode())
    except UnicodeDecodeError:
        return None
    return Message(sender, kind, leg, endpoint, hashes.tolist(), bool(taught), work, tokens)


@dataclass
class PeerCounts:
    sent: int = 0
    dropped: int = 0
    """Not sent: a peer's queue was full."""
    heard: int = 0
    refused: int = 0
    """Received but not signed with the shared key (or malformed)."""
    peers: set[str] = field(default_factory=set)
    """The peers' addresses this replica subscribes to now."""


class PeerLink:
    """This replica's side: publishes on ``port``, subscribes to every peer (``addresses``, and
    whatever ``service`` resolves to, re-read every ``resolve_seconds``)."""

    def __init__(self, key: bytes, port: int, *, addresses: Sequence[str] = (), service: str | None = None,
                 resolve_seconds: float = 5.0, on_message: Callable[[Message], None], host: str = "*") -> None:
        self._key, self._port, self._host = key, port, host
        self._addresses = [parse_host_port(a) for a in addresses]
        self._service, self._resolve_seconds = service, resolve_seconds
        self._on_message = on_message
        self.sender = secrets.token_bytes(8)
        """This replica's name on the wire: its own messages, heard back through a service that
        lists it too, are skipped."""
        self.counts = PeerCounts()
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        pub = zmq.Socket(self._ctx, zmq.PUB)  # a plain socket: a PUB send never waits
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, _SEND_HWM)
        try:
            pub.bind(f"tcp://{self._host}:{self._port}")
        except zmq.ZMQError as exc:
            pub.close(0)
            raise OSError(f"peers.port {self._port}: {exc} (another replica on this host has it: give each "
                          "its own port; gateway --workers > 1 cannot share one router config with peers)") from None
        self._pub = pub
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        self._sub = sub
        self._connect({f"{h}:{p}" for h, p in self._addresses})
        self._tasks.append(asyncio.get_running_loop().create_task(self._listen()))
        if self._service is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._resolve()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(0)
        self._pub = self._sub = None
        self._ctx.term()

    def tell(self, message: Message) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send_multipart(encode(self._key, message), zmq.NOBLOCK)
            self.counts.sent += 1
        except zmq.Again:
            self.counts.dropped += 1

    def _connect(self, wanted: set[str]) -> None:
        assert self._sub is not None
        for address in wanted - self.counts.peers:
            host, port = parse_host_port(address)
            self._sub.connect(f"tcp://{_bracketed(host)}:{port}")
        for address in self.counts.peers - wanted:
            host, port = parse_host_port(address)
            try:
                self._sub.disconnect(f"tcp://{_bracketed(host)}:{port}")
            except zmq.ZMQError:
                pass
        self.counts.peers = set(wanted)

    async def _listen(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            message = decode(self._key, frames)
            if message is None:
                self.counts.refused += 1
                continue
            if message.sender == self.sender:
                continue
            self.counts.heard += 1
            self._on_message(message)

    async def _resolve(self) -> None:
        assert self._service is not None
        static = {f"{h}:{p}" for h, p in self._addresses}
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(self._service, self._port, type=socket.SOCK_STREAM)
                found = {f"{info[4][0]}:{self._port}" for info in infos}
                self._connect(static | found)
            except OSError as exc:  # (the Service has no ready replica yet, or DNS is down)
                log.debug("peers: %s does not resolve: %s", self._service, exc)
            await asyncio.sleep(self._resolve_seconds)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
