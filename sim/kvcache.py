"""A paged KV cache with prefix caching, modelled on vLLM v1's ``BlockPool``.

* Blocks have stable ids ``0..num_blocks-1``. Block 0 is vLLM's *null block*: never handed out,
  so ``num_blocks - 1`` blocks hold KV and usage is ``1 - free / (num_blocks - 1)``.
* Free blocks sit in an LRU queue. A freed block keeps its hash (it stays a prefix-cache hit)
  until allocation takes it from the queue's head, which evicts it (``BlockRemoved``).
  A request frees its blocks tail first, so its last blocks are evicted before its first ones,
  and blocks without a hash go to the queue's front (reused before any cached block) — the
  order vLLM uses, which keeps shared prefixes alive longest.
* A hit on a free cached block takes it off the queue again (``touch``).
* Caching a full block records its hash and queues a ``BlockStored`` event; the engine drains
  the events once per step and publishes them as one batch.
* With CPU offloading (``CpuTier``, vLLM's OffloadingConnector on the native CPU backend), every
  block a step fills is also written to a CPU pool with its own LRU, and a prompt whose GPU hit
  ends early continues its hit there (docs/simulator.md, "CPU KV offloading").

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.hashing import BlockHash, to_external
from kvflow.protocol.kv_events import (
    KV_CACHE_SPEC_KIND,
    MEDIUM_CPU,
    MEDIUM_GPU,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
)

NULL_BLOCK_ID = 0


class NoFreeBlocks(Exception):
    """Raised by ``allocate`` when the pool cannot supply the requested blocks."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    """The tokens whose KV the block holds, once full (drives the transfer payload)."""


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """What a ``BlockStored`` event says about the request that filled the blocks."""

    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """The untagged per-block extra keys (LoRA name, cache salt) for the first block."""
    later_extra_keys: tuple[Any, ...] | None = None
    """The same for later blocks (a cache salt only applies to the first block)."""


@dataclass(slots=True)
class CpuTier:
    """vLLM 0.32's CPU offload pool: ``LRUOffloadingManager`` over ``CPUBackend``, scheduler side.

    * ``store`` (the connector's ``prepare_store`` + ``complete_store``): the hashes not yet held
      are written; when the pool is short, the least recently used blocks are evicted first
      (``BlockRemoved``, medium CPU), then the written ones announced (``BlockStored``, medium
      CPU, no parent, no tokens, no LoRA: what the connector's ``take_events`` sends). A batch
      larger than the whole pool is not stored at all (vLLM's ``prepare_store`` returns None).
    * ``touch``: the hashes become the most recently used, the first one most of all (vLLM
      touches in reverse), so a prompt's tail is evicted before its head.
    * ``lookup``: how many of the hashes, from the first, the pool holds.

    Loads are instant here (the engine charges their time to the step), so no block is ever
    pinned by a load in flight and every block can be evicted.
    """

    num_blocks: int
    block_size: int
    enable_events: bool = True
    _lru: OrderedDict[BlockHash, None] = field(init=False, default_factory=OrderedDict)
    _events: list[Any] = field(init=False, default_factory=list)
    stored_blocks: int = field(init=False, default=0)
    """Blocks written GPU -> CPU so far (the ``GPU_to_CPU`` transfer counter)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("a CPU offload pool needs at least one block")

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def lru_order(self) -> list[BlockHash]:
        """Held hashes, next to be evicted first."""
        return list(self._lru)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)

    def store(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Write the hashes not yet held; returns them (none when they cannot fit)."""
        new = [h for h in dict.fromkeys(hashes) if h not in self._lru]
        if len(new) > self.num_blocks:
            return []
        evict = max(0, len(self._lru) + len(new) - self.num_blocks)
        evicted = [self._lru.popitem(last=False)[0] for _ in range(evict)]
        if evicted and self.enable_events:
            self._events.append(WireBlockRemoved(block_hashes=[to_external(h) for h in evicted], medium=MEDIUM_CPU))
        for h in new:
            self._lru[h] = None
        self.stored_blocks += len(new)
        if new and self.enable_events:
            self._events.append(WireBlockStored(
                block_hashes=[to_external(h) for h in new], parent_block_hash=None, token_ids=[],
                block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None))
        return new

    def clear(self) -> None:
        self._lru.clear()

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    enable_events: bool = True
    offload: CpuTier | None = None
    """The CPU tier behind this pool, when offloading is on."""
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[BlockHash, dict[int, None]] = field(init=False, default_factory=dict)
    _events: list[Any] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is the null block)")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(1, self.num_blocks))

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def free_order(self) -> list[int]:
        """Free block ids, next to be allocated (and evicted) first."""
        return list(self._free)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        ids = self._cached.get(block_hash)
        return next(iter(ids)) if ids else None

    def longest_hit(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (no reference taken)."""
        hit: list[int] = []
        for h in hashes:
            block_id = self.cached_block(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # -- reference counting ----------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the LRU queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block of a request (given in request order).

        Blocks reaching zero are queued tail block first. Cached blocks go to the back of the
        queue (LRU eviction); blocks without a hash can never be hit, so they go to the front
        and are reused first — vLLM's ``free_blocks``.
        """
        uncached: list[int] = []
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block_id)
                else:
                    self._free[block_id] = None
        for block_id in reversed(uncached):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    # -- prefix caching --------------------------------------------------------------------
    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        *,
        first_index: int,
        parent: BlockHash | None,
        info: StoreInfo,
    ) -> None:
        """Record the hashes of newly full blocks ``first_index..`` of a request; one event."""
        if not block_ids:
            return
        bs = info.block_size
        for i, (block_id, h) in enumerate(zip(block_ids, hashes, strict=True)):
            block = self.blocks[block_id]
            start = (first_index + i) * bs
            block.block_hash = h
            block.token_ids = tuple(token_ids[start : start + bs])
            self._cached.setdefault(h, {})[block_id] = None
        if self.enable_events:
            self._events.append(_stored(hashes, token_ids, first_index, parent, info))

    def announce(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], token_ids: Sequence[int],
                 info: StoreInfo) -> None:
        """Re-announce prefix-cache hits (vLLM's ``kv_cache_report_mode: full``)."""
        if self.enable_events and block_ids:
            self._events.append(_stored(hashes[: len(block_ids)], token_ids, 0, None, info))

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache); only when nothing is in use."""
        if self.num_free != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        if self.offload is not None:  # one reset empties both tiers: a benchmark's runs start cold
            self.offload.clear()
        if self.enable_events:
            self._events.append(WireAllBlocksCleared())
        return True

    def take_events(self) -> list[Any]:
        """The step's GPU events, then the CPU tier's (vLLM appends the connector's events after
        the block pool's)."""
        events, self._events = self._events, []
        if self.offload is not None:
            events += self.offload.take_events()
        return events

    def _evict(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        ids = self._cached.get(h)
        if ids is not None and block.block_id in ids:
            del ids[block.block_id]
            if not ids:
                del self._cached[h]
            if self.enable_events:
                self._events.append(WireBlockRemoved(block_hashes=[to_external(h)], medium=MEDIUM_GPU, group_idx=0))
        block.block_hash = None
        block.token_ids = ()


def _stored(hashes: Sequence[BlockHash], token_ids: Sequence[int], first_index: int, parent: BlockHash | None,
            info: StoreInfo) -> WireBlockStored:
    bs = info.block_size
    start, end = first_index * bs, (first_index + len(hashes)) * bs
    return WireBlockStored(
        block_hashes=[to_external(h) for h in hashes],
        parent_block_hash=to_external(parent) if parent is not None else None,
        token_ids=list(token_ids[start:end]),
        block_size=bs,
        lora_id=info.lora_id,
        medium=MEDIUM_GPU,
        lora_name=info.lora_name,
        extra_keys=[info.extra_keys if first_index + i == 0 else info.later_extra_keys for i in range(len(hashes))],
        group_idx=0,
        kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
    )
