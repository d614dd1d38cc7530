"""How KV blocks move between a prefill and a decode simulator (P/D disaggregation).

The engine speaks vLLM's NixlConnector request protocol (``kv_transfer_params``, typed as
``kvflow.protocol.kv_transfer.KvTransferParams``); the data movement sits behind ``KVTransfer``,
chosen with ``--kv-transfer``:

* ``modelled`` (default) — moves no bytes. The prefill side pins the request's blocks until the
  decode side releases them (or ``pin_timeout_s`` passes, like vLLM's KV lease). The decode
  side asks the prefill pod over HTTP (``POST /_sim/kv/pull`` on ``remote_host:remote_port``)
  whether the blocks are still pinned, which also releases them, then waits the profile's
  modelled transfer time. Expired or unknown blocks make the pull fail (the decode pod then
  prefills locally), exactly the failure a real pull of expired blocks has.
* ``nixl`` — ``kvflow.sim.nixl.NixlTransfer``: real bytes through NIXL, each block's content a
  function of its prompt prefix so the decode pod verifies what it read, and vLLM 0.32's lease
  heartbeats (``track``/``untrack``) that keep a waiting decode request's blocks pinned.
* ``none`` — P/D requests are served as ordinary requests (no export, no pull).

Leases and pull times are read on the transfer's ``Clock`` (the engine's, injected).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from kvflow.protocol.kv_transfer import InvalidKvTransferParams, KvTransferParams
from kvflow.sim.clock import Clock, MonotonicClock
from kvflow.sim.pins import Pins

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


class KVTransfer(Protocol):
    engine_id: str

    def attach(self, host: KVHost) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> KvTransferParams:
        """Prefill side, at the end of a ``do_remote_decode`` request: the fields that tell a
        decode pod where to pull from (engine id, host, port, tp size). The blocks stay pinned
        until ``release`` or a timeout."""
        ...

    def release(self, request_id: str) -> None: ...

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        """Decode side: fetch the remote blocks named in ``params`` into ``local_block_ids``."""
        ...

    def track(self, request_id: str, params: KvTransferParams) -> None:
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

    def exported_at(self, host: str, port: int) -> KvTransferParams:
        """What ``export`` answers: this engine, reached at ``host:port``."""
        return KvTransferParams(remote_engine_id=self.engine_id, remote_host=host, remote_port=port,
                                tp_size=self.tp_size)


class ModelledTransfer:
    """Pins on export, releases on a pull or a timeout, and sleeps the modelled time."""

    def __init__(self, config: TransferConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.clock: Clock = clock or MonotonicClock()
        self.pins = Pins(self.clock, config.pin_timeout_s, on_expired=self._unpin)
        self._host: KVHost | None = None
        self._session: aiohttp.ClientSession | None = None

    def attach(self, host: KVHost) -> None:
        self._host = host

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self.pins.start()

    async def stop(self) -> None:
        await self.pins.stop()
        if self._session is not None:
            await self._session.close()

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> KvTransferParams:
        self.pins.pin(request_id)
        return self.config.exported_at(self.config.host, self.config.port)

    def release(self, request_id: str) -> None:
        if self.pins.release(request_id):
            self._unpin(request_id)

    def _unpin(self, request_id: str) -> None:
        if self._host is not None:
            self._host.unpin(request_id)

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        start = self.clock.now()
        nbytes = min(len(params.block_ids), len(local_block_ids)) * self.config.modelled_bytes_per_block
        ok, reason = await self._claim(params)
        if not ok:
            return PullResult(False, self.clock.now() - start, 0, reason)
        delay = self.config.transfer_base_s + nbytes / self.config.transfer_bytes_per_s
        if delay > 0:
            await self.clock.sleep_until(self.clock.now() + delay)
        return PullResult(True, self.clock.now() - start, nbytes, "")

    def track(self, request_id: str, params: KvTransferParams) -> None:
        pass  # no leases to renew: a waiting decode request's blocks expire after pin_timeout_s

    def untrack(self, request_id: str) -> None:
        pass

    async def _claim(self, params: KvTransferParams) -> tuple[bool, str]:
        """Ask the prefill pod to hand over (and release) the pinned blocks."""
        try:
            engine, request_id = params.remote()
        except InvalidKvTransferParams as exc:
            return False, str(exc)
        if self._session is None:
            return False, "transfer not started"
        url = f"http://{engine.host}:{engine.port}/_sim/kv/pull"
        try:
            async with self._session.post(url, json={"remote_request_id": request_id}) as response:
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

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> KvTransferParams:
        return KvTransferParams(remote_engine_id=self.engine_id)

    def release(self, request_id: str) -> None:
        pass

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        return PullResult(False, 0.0, 0, "kv transfer disabled")

    def track(self, request_id: str, params: KvTransferParams) -> None:
        pass

    def untrack(self, request_id: str) -> None:
        pass


def make_transfer(kind: str, config: TransferConfig, clock: Clock | None = None) -> KVTransfer:
    if kind == "modelled":
        return ModelledTransfer(config, clock)
    if kind == "none":
        return NoTransfer(config)
    if kind == "nixl":
        from kvflow.sim.nixl import NixlTransfer  # only when asked for: it loads numpy, zmq and NIXL

        return NixlTransfer(config, clock=clock)
    raise ValueError(f"unknown --kv-transfer {kind!r}; expected modelled, nixl or none")
