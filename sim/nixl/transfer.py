"""``NixlTransfer``: the simulator's ``KVTransfer`` over NIXL, put together from this package's parts.

A started transfer owns a NIXL agent over the pod's registered KV buffer (``agent``, ``layout``)
and a side-channel server that hands its metadata to decode pods (``side_channel``). Prefill side:
``exports``. Decode side: ``peers`` (handshakes), ``pulls``, ``heartbeats`` (lease renewal, which
works before ``start`` too: tracking is bookkeeping). ``metrics`` joins the engine's ``/metrics``.

Leases and heartbeats are timed on the injected ``Clock`` (the engine's). Waits on real I/O are
not: handshake and READ timeouts, notification retries and the agent's progress pacing are real
time, because sockets and the NIXL thread run in real time.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvflow.protocol.kv_transfer import InvalidKvTransferParams, KvTransferParams
from kvflow.sim.clock import Clock, MonotonicClock
from kvflow.sim.kv_transfer import KVHost, PullResult, TransferConfig
from kvflow.sim.nixl.agent import NixlAgent, Notifs, ProgressConfig
from kvflow.sim.nixl.exports import Exports
from kvflow.sim.nixl.heartbeats import EngineLeases, Heartbeats
from kvflow.sim.nixl.layout import KVLayout
from kvflow.sim.nixl.metrics import NixlMetrics
from kvflow.sim.nixl.notifications import heartbeat_message
from kvflow.sim.nixl.peers import Peers
from kvflow.sim.nixl.pulls import Pulls
from kvflow.sim.nixl.side_channel import LAYOUT, AgentMetadata, SideChannelServer, compatibility_hash, encode_payload

log = logging.getLogger(__name__)

HANDSHAKE_BUSY_S = 10.0
"""How long a pod progresses promptly after answering a handshake (its peer is connecting)."""
WIREUP_BUSY_S = 1.0
"""How long a decode pod progresses promptly after a heartbeat found no connection to its engine:
UCX wires a connection up only as both sides progress, and with no READ of ours polling, the idle
tick (200 ms) would hold the first heartbeats back for half a second."""
HEARTBEATS_PER_LEASE = 6
"""vLLM 0.32 beats every ``kv_lease_duration // 6`` seconds (5 s at the default 30 s)."""
HEARTBEAT_MIN_INTERVAL_S = 0.01
"""A floor under the interval: a tiny pin timeout must not make the heartbeat task spin."""


@dataclass(frozen=True, slots=True)
class NixlOptions:
    shape: str | None = None
    """A named model shape (``layout.MODEL_SHAPES``); None: shaped from the engine's bytes per block."""
    handshake_timeout: float = 2.0
    transfer_timeout: float = 5.0
    verify: bool = True
    model_name: str = ""
    advertise_host: str | None = None
    """The side-channel host decode pods are told (vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``); default
    the host the side channel binds, which must then be reachable (not ``0.0.0.0``)."""
    progress: ProgressConfig = field(default_factory=ProgressConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> NixlOptions:
        """``KVFLOW_NIXL_{SHAPE,HANDSHAKE_TIMEOUT,TRANSFER_TIMEOUT,VERIFY,IDLE_INTERVAL,MODEL_NAME}`` and
        ``VLLM_NIXL_SIDE_CHANNEL_HOST``."""
        default = cls()
        return cls(
            shape=env.get("KVFLOW_NIXL_SHAPE") or None,
            handshake_timeout=float(env.get("KVFLOW_NIXL_HANDSHAKE_TIMEOUT", default.handshake_timeout)),
            transfer_timeout=float(env.get("KVFLOW_NIXL_TRANSFER_TIMEOUT", default.transfer_timeout)),
            verify=env.get("KVFLOW_NIXL_VERIFY", "1") not in ("0", "false", "no"),
            model_name=env.get("KVFLOW_NIXL_MODEL_NAME", ""),
            advertise_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or None,
            progress=ProgressConfig(idle_interval=float(env.get("KVFLOW_NIXL_IDLE_INTERVAL",
                                                                default.progress.idle_interval))),
        )


def layout_for_host(host: KVHost, shape: str | None, num_layers: int = 2) -> KVLayout:
    """The registered KV buffer: a named model's shape, or ``num_layers`` layers of the engine's block bytes."""
    if shape:
        return KVLayout.for_model(shape, host.num_blocks, host.block_size)
    per_token_region = host.bytes_per_block // (2 * num_layers * host.block_size)
    if per_token_region * 2 * num_layers * host.block_size != host.bytes_per_block or per_token_region % 2:
        raise ValueError(f"bytes_per_block {host.bytes_per_block} is not 2 × {num_layers} layers × "
                         f"{host.block_size} tokens × an even number of bytes")
    return KVLayout(host.num_blocks, host.block_size, num_layers, 1, per_token_region // 2, 2)


@dataclass(frozen=True, slots=True)
class _Running:
    """What ``start`` builds and ``stop`` takes down."""

    agent: NixlAgent
    server: SideChannelServer
    exports: Exports
    peers: Peers
    pulls: Pulls


class NixlTransfer:
    """``KVTransfer`` over NIXL; see the package docstring."""

    def __init__(self, config: TransferConfig, options: NixlOptions | None = None, *,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.options = options or NixlOptions.from_env()
        self.clock: Clock = clock or MonotonicClock()
        self.engine_id = config.engine_id
        self.metrics = self._new_metrics(self.options.model_name)
        interval = max(config.pin_timeout_s / HEARTBEATS_PER_LEASE, HEARTBEAT_MIN_INTERVAL_S)
        self.heartbeats = Heartbeats(self.clock, interval, self._heartbeat)
        self._host: KVHost | None = None
        self._running: _Running | None = None
        self._registry: CollectorRegistry | None = None

    @property
    def side_channel_port(self) -> int:
        return self.config.side_channel_port if self.config.side_channel_port is not None else self.config.port

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeats.interval_s

    @property
    def agent(self) -> NixlAgent:
        return self._started().agent

    @property
    def exports(self) -> Exports:
        return self._started().exports

    @property
    def peers(self) -> Peers:
        return self._started().peers

    # -- lifecycle ------------------------------------------------------------------------------

    def attach(self, host: KVHost) -> None:
        self._host = host
        model_name = getattr(getattr(host, "metrics", None), "model_name", None)
        if model_name and not self.options.model_name:  # label our metrics like the engine's
            self.metrics = self._new_metrics(str(model_name))

    async def start(self) -> None:
        if self._host is None:
            raise RuntimeError("NixlTransfer.start before attach")
        layout = layout_for_host(self._host, self.options.shape)
        # A fresh agent name per start: a restarted pod must not be mistaken for its old self.
        agent = NixlAgent(f"{self.engine_id}-{uuid.uuid4().hex[:8]}", layout, self.options.progress,
                          on_notifs=self._on_notifs)
        await agent.start()
        compat = compatibility_hash(layout, self.options.model_name)
        meta = AgentMetadata(self.engine_id, agent.metadata, agent.region_bases, 0, layout.num_blocks,
                             [layout.block_len] * layout.num_regions, LAYOUT, layout.block_size)
        server = SideChannelServer(self.config.host, self.side_channel_port, encode_payload(meta, compat),
                                   on_handshake=lambda: agent.hold_busy(HANDSHAKE_BUSY_S))
        await server.start()
        exports = Exports(agent, self.clock, self.config.pin_timeout_s, self.metrics, self._unpin)
        peers = Peers(agent, compat, self.options.handshake_timeout, self.metrics)
        pulls = Pulls(agent, peers, self.metrics, transfer_timeout=self.options.transfer_timeout,
                      verify=self.options.verify, tp_size=self.config.tp_size)
        self._running = _Running(agent, server, exports, peers, pulls)
        exports.pins.start()
        self.heartbeats.start()
        self._expose_metrics()

    async def stop(self) -> None:
        await self.heartbeats.stop()
        running, self._running = self._running, None
        if running is not None:
            await running.pulls.close()
            await running.peers.close()
            await running.exports.pins.stop()
            await running.server.close()
            await running.agent.stop()
        if self._registry is not None:
            self._registry.unregister(self.metrics)
            self._registry = None

    # -- prefill side -----------------------------------------------------------------------------

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> KvTransferParams:
        self.exports.export(request_id, block_ids, token_ids)
        return self.config.exported_at(self.options.advertise_host or self.config.host, self.side_channel_port)

    def release(self, request_id: str) -> None:
        self.exports.release(request_id)

    # -- decode side ------------------------------------------------------------------------------

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        return await self._started().pulls.pull(params, local_block_ids, token_ids)

    def track(self, request_id: str, params: KvTransferParams) -> None:
        """Name the request in heartbeats to its prefill engine until ``untrack``. Params without
        a usable address are not tracked (vLLM's rule too): their pull fails as ``bad_params``."""
        try:
            engine, remote_request_id = params.remote()
        except InvalidKvTransferParams:
            return
        self.heartbeats.track(request_id, engine, remote_request_id)

    def untrack(self, request_id: str) -> None:
        self.heartbeats.untrack(request_id)

    @property
    def tracked(self) -> dict[str, list[str]]:
        """Prefill engine id → the remote request ids its heartbeats name (sorted)."""
        return self.heartbeats.tracked

    async def _heartbeat(self, leases: EngineLeases) -> None:
        """One heartbeat to one engine. Failures are counted and logged, never raised: the next
        interval tries again, and blocks that expire meanwhile fail their pull's check."""
        try:
            running = self._started()
            new = running.peers.cached(leases.engine.engine_id) is None
            peer = await running.peers.get(leases.engine)
            if new:
                running.agent.hold_busy(WIREUP_BUSY_S)
            if not leases.request_ids:
                return  # all untracked while shaking hands
            await running.agent.send_notif(peer.agent_name, heartbeat_message(leases.request_ids))
        except Exception as exc:  # noqa: BLE001 - handshake and NIXL errors share no base class
            self.metrics.heartbeats_sent["failed"].inc()
            log.debug("heartbeat to %s failed: %s", leases.engine.engine_id, exc)
            return
        self.metrics.heartbeats_sent["ok"].inc()

    # -- plumbing -------------------------------------------------------------------------------

    def _started(self) -> _Running:
        if self._running is None:
            raise RuntimeError("NixlTransfer is not started")
        return self._running

    def _new_metrics(self, model_name: str) -> NixlMetrics:
        return NixlMetrics(model_name, pinned=lambda: len(self._running.exports.pins) if self._running else 0)

    def _on_notifs(self, notifs: Notifs) -> None:
        if self._running is not None:
            self._running.exports.on_notifications(notifs)

    def _unpin(self, request_id: str) -> None:
        if self._host is not None:
            self._host.unpin(request_id)

    def _expose_metrics(self) -> None:
        """Join the engine's ``/metrics`` registry, when the host has one (the simulator's engine does)."""
        registry = getattr(getattr(self._host, "metrics", None), "registry", None)
        if registry is not None and self._registry is None:
            registry.register(self.metrics)
            self._registry = registry
