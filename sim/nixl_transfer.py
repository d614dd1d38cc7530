"""``--kv-transfer nixl``: P/D KV transfers of real bytes between simulator pods over NIXL (UCX).

Prefill side (``export``): the request's prompt blocks get deterministic content derived from
its token ids (see ``nixl_layout``), stay pinned, and the answer names this pod's engine id and
side-channel address — the ``kv_transfer_params`` vLLM's NixlConnector returns. The blocks are
freed when the decode pod's notification ``"<remote_request_id>:<tp_size>"`` arrives (vLLM's
format), or when the pin times out (``--kv-pin-timeout``; vLLM 0.32 calls it a lease).

Decode side (``pull``): handshake over the side channel once per prefill engine (cached, and
de-duplicated between concurrent pulls), READ the blocks with prepared descriptor lists, verify
every block's content, then notify the prefill pod with a separate notification once the READ is
done, as vLLM 0.32 does — not attached to the READ, since such a READ completes only when the
prefill pod's worker progresses, which would tie decode latency to the prefill pod's polling.

Leases are renewed by heartbeats, as in vLLM 0.32, because a decode request may wait for free
blocks far longer than the pin timeout. From ``track`` (the engine added a ``do_remote_prefill``
request) to ``untrack`` (its pull finished either way, or it was aborted) the decode side names
the request in a heartbeat: every ``pin_timeout_s / 6`` one NIXL notification
``b"HB:<remote_request_id>,<remote_request_id>,…"`` per prefill engine, shaking hands first if the
engine is new. The prefill side moves each named pin's expiry to
``max(expiry, now + 2/3 × pin_timeout_s)`` and ignores ids it does not hold; a heartbeat never
frees blocks. Nothing tracked, the heartbeat task waits on an event: an idle pod runs no timer.

Failures fall back to local prefill (``PullResult.ok`` false) and are counted by reason:

    bad_params           kv_transfer_params lack a field, or name blocks the prompt does not have
    prefill_unreachable  the side channel did not answer (pod gone, port closed) or is incompatible
    transfer_timeout     the READ did not complete within ``transfer_timeout``
    transfer_error       the READ failed twice: once on the cached peer, once after re-handshaking
    content_mismatch     a pulled block differs from what prefill wrote (e.g. expired and reused)

A READ error on a cached peer usually means the prefill pod restarted (stale agent metadata):
the peer is dropped, the handshake redone and, if it names a new agent, the READ retried once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvflow.sim.kv_transfer import KVHost, PullResult, TransferConfig, flat_block_ids
from kvflow.sim.nixl_agent import (
    NixlAgent,
    Notifs,
    ProgressConfig,
    ReadResult,
    TransferFailed,
    Verify,
)
from kvflow.sim.nixl_layout import (
    KVLayout,
    block_digests,
    mismatched_blocks,
    write_blocks,
)
from kvflow.sim.nixl_metrics import NixlMetrics
from kvflow.sim.nixl_side_channel import (
    LAYOUT,
    AgentMetadata,
    HandshakeError,
    SideChannelServer,
    compatibility_hash,
    encode_payload,
    fetch_metadata,
)

log = logging.getLogger(__name__)

HANDSHAKE_BUSY_S = 10.0
"""How long a pod progresses promptly after answering a handshake (its peer is connecting)."""
WIREUP_BUSY_S = 1.0
"""How long a decode pod progresses promptly after a heartbeat found no connection to its engine:
UCX wires a connection up only as both sides progress, and with no READ of ours polling, the idle
tick (200 ms) would hold the first heartbeats back for half a second."""
EXPIRED_MEMORY = 4096
NOTIF_RETRY_DELAYS = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
REQUIRED_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
HEARTBEAT_PREFIX = "HB:"
HEARTBEAT_MIN_INTERVAL_S = 0.01
"""A floor under ``pin_timeout_s / 6``: a tiny pin timeout must not make the heartbeat task spin."""


@dataclass(frozen=True, slots=True)
class NixlOptions:
    shape: str | None = None
    """A named model shape (``nixl_layout.MODEL_SHAPES``); None: shaped from the engine's bytes per block."""
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
class RemoteEngine:
    """A prefill engine and its side channel: what a handshake needs."""

    engine_id: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Which remote blocks go into which local ones (pure: checked before any I/O)."""

    engine_id: str
    host: str
    port: int
    remote_request_id: str
    local_ids: list[int]
    remote_ids: list[int]
    first_block: int
    """Index, within the prompt, of the first block pulled (blocks before it were cached locally)."""

    @property
    def remote(self) -> RemoteEngine:
        return RemoteEngine(self.engine_id, self.host, self.port)


def remote_of(params: Mapping[str, Any]) -> tuple[RemoteEngine, str]:
    """The prefill engine ``kv_transfer_params`` name, and the request's id there; ``ValueError``
    if a field is missing or bad."""
    missing = [key for key in REQUIRED_PARAMS if params.get(key) in (None, "")]
    if missing:
        raise ValueError(f"kv_transfer_params lack {', '.join(missing)}")
    engine_id, host, request_id = (str(params[k]) for k in ("remote_engine_id", "remote_host", "remote_request_id"))
    try:
        port = int(params["remote_port"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv_transfer_params have a bad remote_port: {params['remote_port']!r}") from exc
    return RemoteEngine(engine_id, host, port), request_id


def plan_pull(params: Mapping[str, Any], local_block_ids: Sequence[int], num_prompt_tokens: int,
              block_size: int) -> PullPlan:
    """Line the decode pod's uncached blocks up with the prefill pod's; ``ValueError`` if impossible.

    The local blocks are the prompt's last ``len(local)`` blocks (earlier ones hit the prefix
    cache), so they pair with the remote blocks at the same prompt positions.
    """
    engine, request_id = remote_of(params)
    remote = flat_block_ids(params.get("remote_block_ids"))
    prompt_blocks = -(-num_prompt_tokens // block_size)
    first = prompt_blocks - len(local_block_ids)
    if first < 0 or prompt_blocks > len(remote):
        raise ValueError(f"{len(local_block_ids)} local and {len(remote)} remote blocks for a "
                         f"{prompt_blocks}-block prompt")
    return PullPlan(engine.engine_id, engine.host, engine.port, request_id, list(local_block_ids),
                    remote[first:prompt_blocks], first)


def heartbeat_message(remote_request_ids: Iterable[str]) -> bytes:
    """vLLM 0.32's lease renewal, ``b"HB:" + ",".join(ids)`` (sorted here: repeatable bytes)."""
    return (HEARTBEAT_PREFIX + ",".join(sorted(remote_request_ids))).encode()


def heartbeat_ids(message: str) -> list[str] | None:
    """The request ids a heartbeat names; None if ``message`` is not a heartbeat but a transfer-done
    notification ``"<remote_request_id>:<tp_size>"`` (``HB:…`` must never be split at its colon)."""
    if not message.startswith(HEARTBEAT_PREFIX):
        return None
    return [request_id for request_id in message[len(HEARTBEAT_PREFIX):].split(",") if request_id]


@dataclass(slots=True)
class _Leases:
    """Decode side: the tracked requests waiting on one prefill engine, whose leases heartbeats renew."""

    remote: RemoteEngine
    request_ids: Counter[str] = field(default_factory=Counter)
    """Remote request id → local requests naming it (a client may send the same params twice)."""


@dataclass(slots=True)
class _Peer:
    agent_name: str
    meta: AgentMetadata


class NixlTransfer:
    """``KVTransfer`` over NIXL; see the module docstring."""

    def __init__(self, config: TransferConfig, options: NixlOptions | None = None) -> None:
        self.config = config
        self.options = options or NixlOptions.from_env()
        self.engine_id = config.engine_id
        self.metrics = NixlMetrics(self.options.model_name, pinned=lambda: len(self._pins))
        self._registry: CollectorRegistry | None = None
        self.agent: NixlAgent | None = None
        self._host: KVHost | None = None
        self._server: SideChannelServer | None = None
        self._client_ctx: zmq.asyncio.Context | None = None
        self._pins: dict[str, asyncio.TimerHandle] = {}
        self._expired: deque[str] = deque(maxlen=EXPIRED_MEMORY)  # to count notifications that come late
        self._peers: dict[str, _Peer] = {}
        self._handshakes: dict[str, asyncio.Task[_Peer]] = {}
        self._notifs: set[asyncio.Task[None]] = set()
        self._tracked: dict[str, tuple[str, str]] = {}  # local request id -> (engine id, remote request id)
        self._leases: dict[str, _Leases] = {}  # by prefill engine id
        self._tracking = asyncio.Event()  # set while anything is tracked: the heartbeat task runs
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._beats: dict[str, asyncio.Task[None]] = {}  # a heartbeat in flight, by engine id

    @property
    def side_channel_port(self) -> int:
        return self.config.side_channel_port if self.config.side_channel_port is not None else self.config.port

    # -- lifecycle ------------------------------------------------------------------------------

    def attach(self, host: KVHost) -> None:
        self._host = host
        model_name = getattr(getattr(host, "metrics", None), "model_name", None)
        if model_name and not self.options.model_name:  # label our metrics like the engine's
            self.metrics = NixlMetrics(str(model_name), pinned=lambda: len(self._pins))

    async def start(self) -> None:
        if self._host is None:
            raise RuntimeError("NixlTransfer.start before attach")
        layout = layout_for_host(self._host, self.options.shape)
        # A fresh agent name per start: a restarted pod must not be mistaken for its old self.
        agent = NixlAgent(f"{self.engine_id}-{uuid.uuid4().hex[:8]}", layout, self.options.progress,
                          on_notifs=self._on_notifs)
        await agent.start()
        self.agent = agent
        meta = AgentMetadata(self.engine_id, agent.metadata, agent.region_bases, 0, layout.num_blocks,
                             [layout.block_len] * layout.num_regions, LAYOUT, layout.block_size)
        payload = encode_payload(meta, self._compat)
        self._server = SideChannelServer(self.config.host, self.side_channel_port, payload,
                                         on_handshake=lambda: agent.hold_busy(HANDSHAKE_BUSY_S))
        await self._server.start()
        self._client_ctx = zmq.asyncio.Context()
        self._expose_metrics()
        self._heartbeat_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name=f"nixl-heartbeats-{self.engine_id}")

    def _expose_metrics(self) -> None:
        """Join the engine's ``/metrics`` registry, when the host has one (the simulator's engine does)."""
        registry = getattr(getattr(self._host, "metrics", None), "registry", None)
        if registry is not None and self._registry is None:
            registry.register(self.metrics)
            self._registry = registry

    async def stop(self) -> None:
        await self._stop_heartbeats()
        pending = [*self._handshakes.values(), *self._notifs]
        for task in pending:
            task.cancel()
        # a cancelled handshake closes its socket only when it next runs: before term(), or term() waits forever
        await asyncio.gather(*pending, return_exceptions=True)
        for timer in self._pins.values():
            timer.cancel()
        self._pins.clear()
        if self._server is not None:
            await self._server.close()
        if self._client_ctx is not None:
            self._client_ctx.term()
        if self.agent is not None:
            await self.agent.stop()
        if self._registry is not None:
            self._registry.unregister(self.metrics)
            self._registry = None

    @property
    def _compat(self) -> str:
        assert self.agent is not None
        return compatibility_hash(self.agent.layout, self.options.model_name)

    # -- prefill side -----------------------------------------------------------------------------

    def export(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
        agent = self._running_agent()
        digests = block_digests(token_ids, agent.layout.block_size)
        n = min(len(block_ids), len(digests))  # fewer blocks than the prompt: the pull will say so
        write_blocks(agent.regions, block_ids[:n], digests[:n])
        stale = self._pins.pop(request_id, None)  # a re-used request id must not keep an old timer
        if stale is not None:
            stale.cancel()
        loop = asyncio.get_running_loop()
        self._pins[request_id] = loop.call_later(self.config.pin_timeout_s, self._release, request_id, "expired")
        agent.busy_holds = len(self._pins)  # blocks are about to be read: free them promptly when told
        return {
            "remote_engine_id": self.engine_id,
            "remote_host": self.options.advertise_host or self.config.host,
            "remote_port": self.side_channel_port,
            "tp_size": self.config.tp_size,
        }

    def release(self, request_id: str) -> None:
        self._release(request_id, "engine")

    def _release(self, request_id: str, cause: str) -> None:
        timer = self._pins.pop(request_id, None)
        if timer is None:
            return
        timer.cancel()
        if self.agent is not None:
            self.agent.busy_holds = len(self._pins)
        self.metrics.released[cause].inc()
        if cause == "expired":
            self.metrics.expired.inc()
            self._expired.append(request_id)
        if self._host is not None:
            self._host.unpin(request_id)

    def _on_notifs(self, notifs: Notifs) -> None:
        for messages in notifs.values():
            for message in messages:
                text = message.decode(errors="replace")
                request_ids = heartbeat_ids(text)
                if request_ids is None:
                    self._on_done(text)
                else:
                    self._extend_leases(request_ids)

    def _on_done(self, message: str) -> None:
        """``"<remote_request_id>:<tp_size>"``: a decode pod has read the blocks."""
        request_id, _, _tp = message.rpartition(":")
        if request_id in self._pins:
            self._release(request_id, "notified")
        elif request_id in self._expired:
            self.metrics.late_notifications.inc()
        else:
            log.info("notification for unknown request %r", request_id)

    def _extend_leases(self, request_ids: list[str]) -> None:
        """A heartbeat: each named pin now expires at the later of its deadline and now + 2/3 of
        the pin timeout (vLLM's ``lease_extension``). Ids not pinned here (already freed, expired,
        never exported) are ignored: the decode side learns of those from its pull."""
        self.metrics.heartbeats_received.inc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.pin_timeout_s * 2 / 3
        for request_id in request_ids:
            timer = self._pins.get(request_id)
            if timer is None or timer.when() >= deadline:
                continue
            timer.cancel()
            self._pins[request_id] = loop.call_at(deadline, self._release, request_id, "expired")
            self.metrics.leases_extended.inc()

    # -- decode side: leases ------------------------------------------------------------------

    @property
    def heartbeat_interval(self) -> float:
        """vLLM 0.32's ``kv_lease_duration // 6`` (5 s at the default 30 s pin timeout)."""
        return max(self.config.pin_timeout_s / 6, HEARTBEAT_MIN_INTERVAL_S)

    def track(self, request_id: str, params: dict[str, Any]) -> None:
        """Name the request in heartbeats to its prefill engine until ``untrack``. Params without
        a usable address are not tracked (vLLM's rule too): their pull fails as ``bad_params``."""
        try:
            remote, remote_id = remote_of(params)
        except ValueError:
            return
        self.untrack(request_id)  # re-added under the same id: only its latest params count
        leases = self._leases.get(remote.engine_id)
        if leases is None:
            leases = self._leases[remote.engine_id] = _Leases(remote)
        leases.request_ids[remote_id] += 1
        self._tracked[request_id] = (remote.engine_id, remote_id)
        self._tracking.set()

    def untrack(self, request_id: str) -> None:
        key = self._tracked.pop(request_id, None)
        if key is None:
            return
        engine_id, remote_id = key
        leases = self._leases[engine_id]
        leases.request_ids[remote_id] -= 1
        if leases.request_ids[remote_id] <= 0:
            del leases.request_ids[remote_id]
        if not leases.request_ids:
            del self._leases[engine_id]  # no key left behind for an engine that went away
        if not self._leases:
            self._tracking.clear()

    @property
    def tracked(self) -> dict[str, list[str]]:
        """Prefill engine id → the remote request ids its heartbeats name (sorted)."""
        return {engine_id: sorted(leases.request_ids) for engine_id, leases in self._leases.items()}

    async def _heartbeat_loop(self) -> None:
        """While anything is tracked, one round of heartbeats per interval; parked otherwise. The
        first round follows the first ``track`` at once (vLLM: the next step after an idle spell)."""
        while True:
            await self._tracking.wait()
            self._send_heartbeats()
            await asyncio.sleep(self.heartbeat_interval)

    def _send_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        for engine_id, leases in self._leases.items():
            if engine_id in self._beats:
                continue  # the last one still waits for its handshake (vLLM skips that engine too)
            task = loop.create_task(self._heartbeat(leases))
            self._beats[engine_id] = task
            task.add_done_callback(partial(self._heartbeat_done, engine_id))

    def _heartbeat_done(self, engine_id: str, _task: asyncio.Task[None]) -> None:
        self._beats.pop(engine_id, None)

    async def _heartbeat(self, leases: _Leases) -> None:
        """One ``HB:`` notification to one engine. Failures are counted and logged, never raised:
        the next interval tries again, and blocks that expire meanwhile fail their pull's check."""
        try:
            new = leases.remote.engine_id not in self._peers
            peer = await self._peer(leases.remote)
            if new:
                self._running_agent().hold_busy(WIREUP_BUSY_S)
            if not leases.request_ids:
                return  # all untracked while shaking hands
            await self._running_agent().send_notif(peer.agent_name, heartbeat_message(leases.request_ids))
        except Exception as exc:  # noqa: BLE001 - handshake and NIXL errors share no base class
            self.metrics.heartbeats_sent["failed"].inc()
            log.debug("heartbeat to %s failed: %s", leases.remote.engine_id, exc)
            return
        self.metrics.heartbeats_sent["ok"].inc()

    async def _stop_heartbeats(self) -> None:
        tasks = [task for task in (self._heartbeat_task, *self._beats.values()) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._heartbeat_task = None
        self._tracked.clear()
        self._leases.clear()
        self._tracking.clear()

    # -- decode side ------------------------------------------------------------------------------

    async def pull(self, params: dict[str, Any], local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        loop = asyncio.get_running_loop()
        start = loop.time()
        agent = self._running_agent()
        try:
            plan = plan_pull(params, local_block_ids, len(token_ids), agent.layout.block_size)
        except ValueError as exc:
            return self._fallback("bad_params", str(exc), loop.time() - start)
        try:
            peer = await self._peer(plan.remote)
            result = await self._read(plan, peer, self._verifier(plan, token_ids))
        except HandshakeError as exc:
            return self._fallback("prefill_unreachable", str(exc), loop.time() - start)
        except TransferFailed as exc:
            self.metrics.failed_transfers.inc()
            reason = "transfer_timeout" if exc.reason == "timeout" else "transfer_error"
            return self._fallback(reason, str(exc), loop.time() - start)
        if not self._verified(plan, result):
            await self._forget(plan.engine_id, peer)  # expired blocks, or a peer that is not what it was
            return self._fallback("content_mismatch", "pulled blocks differ from prefill's", loop.time() - start)
        self._observe(result)
        self._notify(peer, plan.remote_request_id)
        return PullResult(True, loop.time() - start, result.nbytes, "")

    async def _read(self, plan: PullPlan, peer: _Peer, verify: Verify | None) -> ReadResult:
        agent = self._running_agent()
        if not plan.local_ids:
            return ReadResult(0.0, 0.0, 0, 0)  # everything hit the local prefix cache
        try:
            return await agent.read(peer.agent_name, plan.local_ids, plan.remote_ids,
                                    timeout=self.options.transfer_timeout, verify=verify)
        except TransferFailed as exc:
            if exc.reason == "timeout":
                raise
            fresh = await self._replace_stale(plan, peer)
            if fresh is None:
                raise
            return await agent.read(fresh.agent_name, plan.local_ids, plan.remote_ids,
                                    timeout=self.options.transfer_timeout, verify=verify)

    async def _replace_stale(self, plan: PullPlan, peer: _Peer) -> _Peer | None:
        """Drop a peer whose READ failed; re-handshake; the new peer if it is a new agent."""
        if await self._forget(plan.engine_id, peer):
            self.metrics.rehandshakes.inc()
        fresh = await self._peer(plan.remote)
        return None if fresh.agent_name == peer.agent_name else fresh

    async def _forget(self, engine_id: str, peer: _Peer) -> bool:
        """Drop a cached peer (once, however many pulls found it stale); whether this call did."""
        if self._peers.get(engine_id) is not peer:
            return False
        del self._peers[engine_id]
        await self._running_agent().remove_remote(peer.agent_name)
        return True

    async def _peer(self, remote: RemoteEngine) -> _Peer:
        """The cached peer for an engine, or one handshake shared by all concurrent pulls and heartbeats."""
        peer = self._peers.get(remote.engine_id)
        if peer is not None:
            return peer
        task = self._handshakes.get(remote.engine_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._handshake(remote))
            self._handshakes[remote.engine_id] = task
            task.add_done_callback(partial(self._handshake_done, remote.engine_id))
        return await asyncio.shield(task)

    def _handshake_done(self, engine_id: str, _task: asyncio.Task[_Peer]) -> None:
        self._handshakes.pop(engine_id, None)

    async def _handshake(self, remote: RemoteEngine) -> _Peer:
        agent = self._running_agent()
        assert self._client_ctx is not None
        try:
            meta = await fetch_metadata(remote.host, remote.port, compat=self._compat, engine_id=remote.engine_id,
                                        timeout=self.options.handshake_timeout, ctx=self._client_ctx)
            name = await agent.add_remote(meta.agent_metadata, meta.kv_caches_base_addr, meta.num_blocks)
        except HandshakeError:
            self.metrics.handshakes["failed"].inc()
            raise
        except Exception as exc:
            self.metrics.handshakes["failed"].inc()
            raise HandshakeError(f"loading agent metadata of {remote.engine_id}: {exc}") from exc
        self.metrics.handshakes["ok"].inc()
        peer = _Peer(name, meta)
        self._peers[remote.engine_id] = peer
        return peer

    def _verifier(self, plan: PullPlan, token_ids: list[int]) -> Verify | None:
        """What the NIXL thread runs on the landed blocks: compare them with the prompt's stamps."""
        if not self.options.verify:
            return None
        agent = self._running_agent()
        count = plan.first_block + len(plan.local_ids)
        digests = block_digests(token_ids, agent.layout.block_size, count)[plan.first_block:]  # computed here, once
        return partial(mismatched_blocks, agent.regions, plan.local_ids, digests)

    def _verified(self, plan: PullPlan, result: ReadResult) -> bool:
        if result.mismatched is None:  # not verified (disabled, or nothing was read)
            return True
        self.metrics.blocks_verified.inc(len(plan.local_ids) - len(result.mismatched))
        self.metrics.blocks_mismatched.inc(len(result.mismatched))
        return not result.mismatched

    def _notify(self, peer: _Peer, remote_request_id: str) -> None:
        """Tell the prefill pod its blocks are free, in the background (best effort)."""
        message = f"{remote_request_id}:{self.config.tp_size}".encode()
        task = asyncio.get_running_loop().create_task(self._send_notif(peer.agent_name, message))
        self._notifs.add(task)
        task.add_done_callback(self._notifs.discard)

    async def _send_notif(self, agent_name: str, message: bytes) -> None:
        # Right after a handshake UCX may still be wiring the connection up, and NIXL then has
        # no backend to carry a notification: retry for a while before giving up on it.
        for delay in (*NOTIF_RETRY_DELAYS, None):
            try:
                await self._running_agent().send_notif(agent_name, message)
                return
            except Exception as exc:  # noqa: BLE001 - NIXL errors share no base class
                if delay is None:  # the prefill pod frees the blocks when their pin expires
                    self.metrics.failed_notifications.inc()
                    log.warning("notification %r to %s failed: %s", message, agent_name, exc)
                    return
            await asyncio.sleep(delay)

    def _observe(self, result: ReadResult) -> None:
        if result.nbytes == 0:
            return
        self.metrics.xfer_time.observe(result.seconds)
        self.metrics.post_time.observe(result.post_seconds)
        self.metrics.bytes.observe(result.nbytes)
        self.metrics.descriptors.observe(result.descriptors)

    def _fallback(self, reason: str, detail: str, seconds: float) -> PullResult:
        self.metrics.fallbacks[reason].inc()
        log.info("NIXL pull falls back to local prefill (%s): %s", reason, detail)
        return PullResult(False, seconds, 0, f"{reason}: {detail}")

    def _running_agent(self) -> NixlAgent:
        if self.agent is None:
            raise RuntimeError("NixlTransfer is not started")
        return self.agent

