"""Router replicas of one pool tell each other where they sent each prompt's blocks.

A replica knows what its pods cache from their KV events and, for a pod that publishes none,
from what it routed there itself (the approximate index). With N replicas behind one Service,
each routes a share of the traffic, so without events each one's approximate index holds a
share of the pool's prefixes and gives a prefix a home of its own: N homes where one would do
(a third of the hit rate lost at three replicas). With events, a replica still learns of its
peers' requests only once their prefills end, so a burst of one prefix is spread before any of
them shows.

So each replica publishes what it teaches its own indexes when it sends a request (``routed``:
the pod, the prompt's block fingerprints) or when the attempt fails (``undone``), and applies
what its peers publish the same way (``Router``'s ``heard_routed`` / ``heard_undone``). The
messages are ZeroMQ PUB/SUB, one socket each way, fire-and-forget: a message lost under load
costs affinity, never a request. Every replica fingerprints blocks with a secret derived from
the key the replicas share (``peers.keyFile``), so their fingerprints name the same blocks; the
same key signs each message (BLAKE2b, keyed), and a message that does not verify is dropped and
counted, so nothing on the pod network that lacks the key can steer routing.

Wire format, two frames: a 16-byte MAC, then the payload ``version (1) | sender (8) | kind (1) |
taught (1) | id length (2, little endian) | endpoint id (UTF-8) | fingerprints (uint64, little
endian)``; ``taught`` says whether the sender's approximate index took the blocks (it does for
pods without KV events, and for all pods where the profile reads it), so the receiver does as
the sender did.
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

import zmq
import zmq.asyncio

from kvflow.endpoints import EndpointId, parse_host_port

log = logging.getLogger(__name__)

VERSION = 1
ROUTED, UNDONE = 1, 2
_HEAD = struct.Struct("<B8sBBH")
_MAC_BYTES = 16
_MIN_KEY_BYTES = 16
_SEND_HWM = 10_000
"""Messages queued per peer before the newest are dropped (a peer that stopped reading)."""

Heard = Callable[[EndpointId, list[int], bool], None]
"""A peer's message applied: (pod, fingerprints, whether the sender's approximate index took them)."""


def read_key(path: str) -> bytes:
    """The shared key in ``path`` (its text, stripped); a one-line ``ValueError`` if unusable."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"peers.keyFile {path}: {exc.strerror or exc}") from None
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(f"peers.keyFile {path}: the key must be at least {_MIN_KEY_BYTES} bytes")
    return key


def fingerprint_secret(key: bytes) -> bytes:
    """The block fingerprints' secret every replica sharing ``key`` derives alike."""
    return hashlib.blake2b(key, person=b"kvflow-peers-fp", digest_size=32).digest()


def _mac(key: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(payload, key=key[:64], digest_size=_MAC_BYTES, person=b"kvflow-peers").digest()


def encode(key: bytes, sender: bytes, kind: int, endpoint: EndpointId, hashes: Sequence[int], taught: bool) -> list[bytes]:
    """A message's two frames (see the module's comment)."""
    eid = endpoint.encode()
    payload = _HEAD.pack(VERSION, sender, kind, taught, len(eid)) + eid + array("Q", hashes).tobytes()
    return [_mac(key, payload), payload]


@dataclass(frozen=True, slots=True)
class Message:
    sender: bytes
    kind: int
    endpoint: EndpointId
    hashes: list[int]
    taught: bool


def decode(key: bytes, frames: Sequence[bytes]) -> Message | None:
    """The message, or None if it is not one signed with ``key``."""
    if len(frames) != 2 or not hmac.compare_digest(_mac(key, frames[1]), frames[0]):
        return None
    payload = frames[1]
    if len(payload) < _HEAD.size:
        return None
    version, sender, kind, taught, n = _HEAD.unpack_from(payload)
    body = payload[_HEAD.size + n:]
    if version != VERSION or kind not in (ROUTED, UNDONE) or len(body) % 8:
        return None
    hashes = array("Q")
    hashes.frombytes(body)
    try:
        endpoint = EndpointId(payload[_HEAD.size: _HEAD.size + n].decode())
    except UnicodeDecodeError:
        return None
    return Message(sender, kind, endpoint, hashes.tolist(), bool(taught))


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
                 resolve_seconds: float = 5.0, on_routed: Heard, on_undone: Heard, host: str = "*") -> None:
        self._key, self._port, self._host = key, port, host
        self._addresses = [parse_host_port(a) for a in addresses]
        self._service, self._resolve_seconds = service, resolve_seconds
        self._on = {ROUTED: on_routed, UNDONE: on_undone}
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

    def routed(self, endpoint: EndpointId, hashes: Sequence[int], taught: bool) -> None:
        """This replica sent a request with these blocks to ``endpoint``."""
        self._send(ROUTED, endpoint, hashes, taught)

    def undone(self, endpoint: EndpointId, hashes: Sequence[int], taught: bool) -> None:
        """The attempt there failed before it computed anything."""
        self._send(UNDONE, endpoint, hashes, taught)

    def _send(self, kind: int, endpoint: EndpointId, hashes: Sequence[int], taught: bool) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send_multipart(encode(self._key, self.sender, kind, endpoint, hashes, taught), zmq.NOBLOCK)
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
            self._on[message.kind](message.endpoint, message.hashes, message.taught)

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
