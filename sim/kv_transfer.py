"""How KV blocks move between a prefill and a decode simulator (P/D disaggregation).

The engine speaks vLLM's NixlConnector request protocol (``kv_transfer_params``); the data
movement sits behind ``KVTransfer``, chosen with ``--kv-transfer``:

* ``modelled`` (default) — moves no bytes. The prefill side pins the request's blocks until the
  decode side releases them (or ``pin_timeout_s`` passes, like vLLM's KV lease). The decode
  side asks the prefill pod over HTTP (``POST /_sim/kv/pull`` on ``remote_host:remote_port``)
  whether the blocks are still pinned, which also releases them, then waits the profile's
  modelled transfer time. Expired or unknown blocks make the pull fail (the decode pod then
  prefills locally), exactly the failure a real pull of expired blocks has.
* ``nixl`` — ``kvflow.sim.nixl_transfer.NixlTransfer``: real bytes through NIXL, and vLLM 0.32's
  lease heartbeats (``track``/``untrack``) that keep a waiting decode request's blocks pinned.
* ``none`` — P/D requests are served as ordinary requests (no export, no pull).

Block contents, where a transfer moves bytes, are ``block_payload(token_ids, nbytes)``: a
deterministic function of the block's tokens, so the receiver can verify what it got.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_PIN_TIMEOUT_S = 30.0  # vLLM 0.32 NixlConnector's default kv_lease_duration


@dataclass(frozen=True, slots=True)
class PullResult:
    ok: bool
    seconds: float = 0.0
    nbytes: int = 0
    reason: str = ""


class KVHost(Protocol):
    """What the engine offers a transfer: its pool geometry and block bookkeeping."""

    block_size: int
    num_blocks: int
    bytes_per_block: int

    def unpin(self, request_id: str) -> None:
        """Free the blocks a finished remote-decode request kept pinned."""

    def block_token_ids(self, block_id: int) -> tuple[int, ...]:
        """The tokens a (full, cached) block holds; empty if it holds none."""


class KVTransfer(Protocol):
    engine_id: str

    def attach(self, host: KVHost) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        """Prefill side, at the end of a ``do_remote_decode`` request: the fields that tell a
        decode pod where to pull from. The blocks stay pinned until ``release`` or a timeout."""
        ...

    def release(self, request_id: str) -> None: ...

    async def pull(self, params: dict[str, Any], local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        """Decode side: fetch the remote blocks named in ``params`` into ``local_block_ids``."""
        ...

    def track(self, request_id: str, params: dict[str, Any]) -> None:
        """Decode side: a ``do_remote_prefill`` request was added. Until ``untrack``, keep its
        prefill blocks alive (vLLM 0.32 sends lease-renewal heartbeats) — it may wait for free
        blocks far longer than the prefill pod's pin timeout."""
        ...

    def untrack(self, request_id: str) -> None:
        """Decode side: the request's pull finished (either way) or it was aborted. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class TransferConfig:
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = "127.0.0.1"
    port: int = 0
    """Where the decode side reaches this pod (the sim's HTTP port for ``modelled``; NIXL's
    side-channel port for ``nixl``)."""
    side_channel_port: int | None = None
    tp_size: int = 1
    pin_timeout_s: float = DEFAULT_PIN_TIMEOUT_S
    transfer_base_s: float = 0.0
    transfer_bytes_per_s: float = 1e12
    modelled_bytes_per_block: int = 0
    """KV bytes a block would hold on the modelled hardware (the profile's bytes per token
    times the block size); sets the modelled transfer time."""


def block_payload(token_ids: Sequence[int], nbytes: int) -> bytes:
    """The deterministic 'KV' of a block: SHA-256 in counter mode over its token ids."""
    seed = hashlib.sha256(b"kvflow-kv:" + ",".join(map(str, token_ids)).encode()).digest()
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(seed + counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:nbytes])


def flat_block_ids(value: Any) -> list[int]:
    """``remote_block_ids`` as vLLM sends it (one list per KV-cache group) or flat."""
    if not value:
        return []
    if isinstance(value[0], list | tuple):
        return [int(b) for b in value[0]]
    return [int(b) for b in value]


class ModelledTransfer:
    """Pins on export, releases on a pull or a timeout, and sleeps the modelled time."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self._host: KVHost | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._session: aiohttp.ClientSession | None = None

    def attach(self, host: KVHost) -> None:
        self._host = host

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._session is not None:
            await self._session.close()

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(self.config.pin_timeout_s, self.release, request_id)
        return {
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.host,
            "remote_port": self.config.port,
            "tp_size": self.config.tp_size,
        }

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._timers

    def release(self, request_id: str) -> None:
        timer = self._timers.pop(request_id, None)
        if timer is None:
            return
        timer.cancel()
        if self._host is not None:
            self._host.unpin(request_id)

    async def pull(self, params: dict[str, Any], local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        start = time.monotonic()
        remote_ids = flat_block_ids(params.get("remote_block_ids"))
        n = min(len(remote_ids), len(local_block_ids))
        nbytes = n * self.config.modelled_bytes_per_block
        ok, reason = await self._claim(params)
        if not ok:
            return PullResult(False, time.monotonic() - start, 0, reason)
        delay = self.config.transfer_base_s + nbytes / self.config.transfer_bytes_per_s
        if delay > 0:
            await asyncio.sleep(delay)
        return PullResult(True, time.monotonic() - start, nbytes, "")

    def track(self, request_id: str, params: dict[str, Any]) -> None:
        pass  # no leases to renew: a waiting decode request's blocks expire after pin_timeout_s

    def untrack(self, request_id: str) -> None:
        pass

    async def _claim(self, params: dict[str, Any]) -> tuple[bool, str]:
        """Ask the prefill pod to hand over (and release) the pinned blocks."""
        host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if not host or not port or not rid:
            return False, "kv_transfer_params lack remote_host/remote_port/remote_request_id"
        if self._session is None:
            return False, "transfer not started"
        url = f"http://{host}:{port}/_sim/kv/pull"
        try:
            async with self._session.post(url, json={"remote_request_id": rid}) as response:
                body = await response.json()
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return False, f"prefill pod unreachable: {type(exc).__name__}"
        if not body.get("ok"):
            return False, str(body.get("reason", "blocks not pinned"))
        return True, ""


class NoTransfer:
    """``--kv-transfer none``: nothing is exported and every pull fails (local prefill)."""

    def __init__(self, config: TransferConfig) -> None:
        self.engine_id = config.engine_id

    def attach(self, host: KVHost) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        return {}

    def release(self, request_id: str) -> None:
        pass

    async def pull(self, params: dict[str, Any], local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        return PullResult(False, 0.0, 0, "kv transfer disabled")

    def track(self, request_id: str, params: dict[str, Any]) -> None:
        pass

    def untrack(self, request_id: str) -> None:
        pass


def make_transfer(kind: str, config: TransferConfig) -> KVTransfer:
    if kind == "modelled":
        return ModelledTransfer(config)
    if kind == "none":
        return NoTransfer(config)
    if kind == "nixl":
        module = importlib.import_module("kvflow.sim.nixl_transfer")
        return module.NixlTransfer(config)  # type: ignore[no-any-return]
    raise ValueError(f"unknown --kv-transfer {kind!r}; expected modelled, nixl or none")
