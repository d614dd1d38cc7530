"""Decode side: pull a request's blocks from its prefill pod over NIXL.

``plan_pull`` (pure) lines the decode pod's uncached blocks up with the prefill pod's. ``Pulls``
then gets the prefill engine's peer (``Peers``: one handshake, cached), READs the blocks with
prepared descriptor lists, has the NIXL thread verify every block's content against the prompt,
and sends the prefill pod a done notification once the READ is done, as vLLM 0.32 does: not
attached to the READ, since such a READ completes only when the prefill pod's worker progresses,
which would tie decode latency to the prefill pod's polling.

Failures fall back to local prefill (``PullResult.ok`` false) and are counted by reason:

    bad_params           kv_transfer_params lack a field, or name blocks the prompt does not have
    prefill_unreachable  the side channel did not answer (pod gone, port closed) or is incompatible
    transfer_timeout     the READ did not complete within ``transfer_timeout``
    transfer_error       the READ failed twice: once on the cached peer, once after re-handshaking
    content_mismatch     a pulled block differs from what prefill wrote (e.g. expired and reused)

A READ error on a cached peer usually means the prefill pod restarted (stale agent metadata):
the peer is dropped, the handshake redone and, if it names a new agent, the READ retried once.
A pull's duration is measured (``perf_counter``): it is how long real I/O took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvflow.protocol.kv_transfer import InvalidKvTransferParams, KvTransferParams, PrefillEngine
from kvflow.sim.kv_transfer import PullResult
from kvflow.sim.nixl.agent import NixlAgent, ReadResult, TransferFailed, Verify
from kvflow.sim.nixl.layout import block_digests, mismatched_blocks
from kvflow.sim.nixl.metrics import NixlMetrics
from kvflow.sim.nixl.notifications import done_message
from kvflow.sim.nixl.peers import Peer, Peers
from kvflow.sim.nixl.side_channel import HandshakeError

log = logging.getLogger(__name__)

NOTIF_RETRY_DELAYS = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Waits before resending a done notification: right after a handshake UCX may still be wiring
the connection up (real time: they wait for sockets, not for the simulation)."""


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
    def engine(self) -> PrefillEngine:
        return PrefillEngine(self.engine_id, self.host, self.port)


def plan_pull(params: KvTransferParams, local_block_ids: Sequence[int], num_prompt_tokens: int,
              block_size: int) -> PullPlan:
    """Line the decode pod's uncached blocks up with the prefill pod's; ``InvalidKvTransferParams``
    if impossible.

    The local blocks are the prompt's last ``len(local)`` blocks (earlier ones hit the prefix
    cache), so they pair with the remote blocks at the same prompt positions.
    """
    engine, request_id = params.remote()
    remote = params.block_ids
    prompt_blocks = -(-num_prompt_tokens // block_size)
    first = prompt_blocks - len(local_block_ids)
    if first < 0 or prompt_blocks > len(remote):
        raise InvalidKvTransferParams(f"{len(local_block_ids)} local and {len(remote)} remote blocks for a "
                                      f"{prompt_blocks}-block prompt")
    return PullPlan(engine.engine_id, engine.host, engine.port, request_id, list(local_block_ids),
                    list(remote[first:prompt_blocks]), first)


class Pulls:
    def __init__(self, agent: NixlAgent, peers: Peers, metrics: NixlMetrics, *, transfer_timeout: float,
                 verify: bool, tp_size: int) -> None:
        self.agent = agent
        self.peers = peers
        self.metrics = metrics
        self.transfer_timeout = transfer_timeout
        self.verify = verify
        self.tp_size = tp_size
        self._notifs: set[asyncio.Task[None]] = set()

    async def pull(self, params: KvTransferParams, local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        start = time.perf_counter()
        try:
            plan = plan_pull(params, local_block_ids, len(token_ids), self.agent.layout.block_size)
        except InvalidKvTransferParams as exc:
            return self._fallback("bad_params", str(exc), time.perf_counter() - start)
        try:
            peer = await self.peers.get(plan.engine)
            result = await self._read(plan, peer, self._verifier(plan, token_ids))
        except HandshakeError as exc:
            return self._fallback("prefill_unreachable", str(exc), time.perf_counter() - start)
        except TransferFailed as exc:
            self.metrics.failed_transfers.inc()
            reason = "transfer_timeout" if exc.reason == "timeout" else "transfer_error"
            return self._fallback(reason, str(exc), time.perf_counter() - start)
        if not self._verified(plan, result):
            await self.peers.forget(plan.engine_id, peer)  # expired blocks, or a peer that is not what it was
            return self._fallback("content_mismatch", "pulled blocks differ from prefill's",
                                  time.perf_counter() - start)
        self._observe(result)
        self._notify(peer, plan.remote_request_id)
        return PullResult(True, time.perf_counter() - start, result.nbytes, "")

    async def close(self) -> None:
        """Stop sending notifications (the prefill pod frees the blocks when their lease ends)."""
        pending = list(self._notifs)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _read(self, plan: PullPlan, peer: Peer, verify: Verify | None) -> ReadResult:
        if not plan.local_ids:
            return ReadResult(0.0, 0.0, 0, 0)  # everything hit the local prefix cache
        try:
            return await self.agent.read(peer.agent_name, plan.local_ids, plan.remote_ids,
                                         timeout=self.transfer_timeout, verify=verify)
        except TransferFailed as exc:
            if exc.reason == "timeout":
                raise
            fresh = await self.peers.replace_stale(plan.engine, peer)
            if fresh is None:
                raise
            return await self.agent.read(fresh.agent_name, plan.local_ids, plan.remote_ids,
                                         timeout=self.transfer_timeout, verify=verify)

    def _verifier(self, plan: PullPlan, token_ids: list[int]) -> Verify | None:
        """What the NIXL thread runs on the landed blocks: compare them with the prompt's stamps."""
        if not self.verify:
            return None
        count = plan.first_block + len(plan.local_ids)
        digests = block_digests(token_ids, self.agent.layout.block_size, count)[plan.first_block:]  # here, once
        return partial(mismatched_blocks, self.agent.regions, plan.local_ids, digests)

    def _verified(self, plan: PullPlan, result: ReadResult) -> bool:
        if result.mismatched is None:  # not verified (disabled, or nothing was read)
            return True
        self.metrics.blocks_verified.inc(len(plan.local_ids) - len(result.mismatched))
        self.metrics.blocks_mismatched.inc(len(result.mismatched))
        return not result.mismatched

    def _notify(self, peer: Peer, remote_request_id: str) -> None:
        """Tell the prefill pod its blocks are free, in the background (best effort)."""
        message = done_message(remote_request_id, self.tp_size)
        task = asyncio.get_running_loop().create_task(self._send_notif(peer.agent_name, message))
        self._notifs.add(task)
        task.add_done_callback(self._notifs.discard)

    async def _send_notif(self, agent_name: str, message: bytes) -> None:
        for delay in (*NOTIF_RETRY_DELAYS, None):
            try:
                await self.agent.send_notif(agent_name, message)
                return
            except Exception as exc:  # noqa: BLE001 - NIXL errors share no base class
                if delay is None:  # the prefill pod frees the blocks when their lease ends
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
