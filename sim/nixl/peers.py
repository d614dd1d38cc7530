"""Decode side: handshakes with prefill engines over the side channel, and the peers they leave.

One handshake per prefill engine, cached and shared by every concurrent pull and heartbeat. A
cached peer found stale (a READ on it failed: the prefill pod restarted or went away) is dropped
once, however many pulls found it, and the next use shakes hands again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import zmq.asyncio

from kvflow.protocol.kv_transfer import PrefillEngine
from kvflow.sim.nixl.agent import NixlAgent
from kvflow.sim.nixl.metrics import NixlMetrics
from kvflow.sim.nixl.side_channel import AgentMetadata, HandshakeError, fetch_metadata


@dataclass(frozen=True, slots=True)
class Peer:
    agent_name: str
    """The remote agent as our NIXL agent knows it (a restarted pod is a new agent)."""
    meta: AgentMetadata


class Peers:
    def __init__(self, agent: NixlAgent, compat: str, timeout: float, metrics: NixlMetrics) -> None:
        self.agent = agent
        self.compat = compat
        """Our compatibility hash: a peer's must match."""
        self.timeout = timeout
        self.metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._peers: dict[str, Peer] = {}
        self._handshakes: dict[str, asyncio.Task[Peer]] = {}

    def cached(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    async def get(self, engine: PrefillEngine) -> Peer:
        """The cached peer for an engine, or one handshake shared by every caller meanwhile;
        ``HandshakeError`` if the side channel does not answer or serves something else."""
        peer = self._peers.get(engine.engine_id)
        if peer is not None:
            return peer
        task = self._handshakes.get(engine.engine_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._handshake(engine))
            self._handshakes[engine.engine_id] = task
            task.add_done_callback(partial(self._handshake_done, engine.engine_id))
        return await asyncio.shield(task)

    async def forget(self, engine_id: str, peer: Peer) -> bool:
        """Drop a cached peer (once, however many pulls found it stale); whether this call did."""
        if self._peers.get(engine_id) is not peer:
            return False
        del self._peers[engine_id]
        await self.agent.remove_remote(peer.agent_name)
        return True

    async def replace_stale(self, engine: PrefillEngine, peer: Peer) -> Peer | None:
        """Drop a peer whose READ failed and shake hands again: the new peer if it is a new agent."""
        if await self.forget(engine.engine_id, peer):
            self.metrics.rehandshakes.inc()
        fresh = await self.get(engine)
        return None if fresh.agent_name == peer.agent_name else fresh

    async def close(self) -> None:
        pending = list(self._handshakes.values())
        for task in pending:
            task.cancel()
        # a cancelled handshake closes its socket only when it next runs: before term(), or term() waits forever
        await asyncio.gather(*pending, return_exceptions=True)
        self._ctx.term()

    def _handshake_done(self, engine_id: str, _task: asyncio.Task[Peer]) -> None:
        self._handshakes.pop(engine_id, None)

    async def _handshake(self, engine: PrefillEngine) -> Peer:
        try:
            meta = await fetch_metadata(engine.host, engine.port, compat=self.compat, engine_id=engine.engine_id,
                                        timeout=self.timeout, ctx=self._ctx)
            name = await self.agent.add_remote(meta.agent_metadata, meta.kv_caches_base_addr, meta.num_blocks)
        except HandshakeError:
            self.metrics.handshakes["failed"].inc()
            raise
        except Exception as exc:
            self.metrics.handshakes["failed"].inc()
            raise HandshakeError(f"loading agent metadata of {engine.engine_id}: {exc}") from exc
        self.metrics.handshakes["ok"].inc()
        peer = Peer(name, meta)
        self._peers[engine.engine_id] = peer
        return peer
