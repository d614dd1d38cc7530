"""vLLM block hashes for a request, computed lazily and memoised across requests.

Hashing a block the way vLLM does costs a pickle and a SHA-256 (1.5-3 µs here), so an
8k-token prompt (512 blocks of 16) would spend the whole 1 ms decision budget hashing. Two
things make it cheap:

* **a prefix-fingerprint memo.** numpy computes, for every block boundary at once, a 64-bit
  fingerprint of the whole prefix up to it (a per-block mix of the 16 token ids, multiplied by
  a per-position constant and XOR-accumulated): ~0.1 µs a block instead of a SHA-256. The memo
  maps fingerprint → vLLM hash, so requests sharing a system prompt reuse its hashes. A
  fingerprint collision (odds ~2^-64 per pair) could only mis-score a pod, never change what
  a pod serves.
* **laziness.** Hashes are computed as far as someone asks: the prefix walk stops at the first
  block no endpoint holds, so an uncached suffix is never SHA-hashed during the decision.

Hashes are kept in their external form (the int vLLM publishes in KV events), so both prefix
indexes key on plain ints.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kvflow.hashing import BlockHash, hash_block_tokens, hash_fn, none_hash, to_external

_MAX_POSITIONS = 1 << 16  # blocks; a 1M-token prompt at block size 16


@lru_cache(maxsize=8)
def _odd_constants(n: int, stream: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers: fingerprints must be stable for the life of the process."""
    rng = np.random.default_rng((0x6B76666C6F77, stream))
    return rng.integers(1, 2**63, size=n, dtype=np.uint64) | np.uint64(1)


class BlockHashCache:
    """Memo of block hashes shared by every request of a pool (one hash algo, seed, block size)."""

    def __init__(self, block_size: int, *, seed: str = "0", algo: str = "sha256", capacity: int = 500_000) -> None:
        self.block_size = block_size
        self.seed = seed
        self.algo = algo
        self.capacity = capacity
        self._fn = hash_fn(algo)
        self._root = none_hash(seed, algo)
        self._token_mix = _odd_constants(block_size, 0)
        self._position_mix = _odd_constants(_MAX_POSITIONS, 1)
        self._memo: dict[Any, tuple[BlockHash, int]] = {}
        self.hits = 0
        self.misses = 0

    def for_request(
        self,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
        first_extra_keys: tuple[Any, ...] | None = None,
    ) -> RequestHashes:
        """``extra_keys`` key every block (LoRA); ``first_extra_keys`` block 0 only (LoRA + cache salt)."""
        first = first_extra_keys if first_extra_keys is not None else extra_keys
        return RequestHashes(self, token_ids, extra_keys, first)

    def fingerprints(self, token_ids: Sequence[int]) -> list[int]:
        """A 64-bit fingerprint of each full-block prefix of ``token_ids``."""
        n = min(len(token_ids) // self.block_size, _MAX_POSITIONS)
        if n == 0:
            return []
        if isinstance(token_ids, np.ndarray):
            tokens = token_ids.astype(np.uint64, copy=False)
        else:
            # struct packs a list of ints ~3x faster than array.array or np.array convert it
            count = n * self.block_size
            tokens = np.frombuffer(struct.pack(f"{count}q", *token_ids[:count]), dtype=np.uint64)
        blocks = (tokens[: n * self.block_size].reshape(n, self.block_size) * self._token_mix).sum(
            axis=1, dtype=np.uint64
        )
        # splitmix64's finaliser: makes a block's mix non-linear in its tokens
        blocks ^= blocks >> np.uint64(30)
        blocks *= np.uint64(0xBF58476D1CE4E5B9)
        blocks ^= blocks >> np.uint64(27)
        blocks *= np.uint64(0x94D049BB133111EB)
        blocks ^= blocks >> np.uint64(31)
        return np.bitwise_xor.accumulate(blocks * self._position_mix[:n]).tolist()  # type: ignore[no-any-return]

    def _store(
        self, key: Any, parent: BlockHash, block: Sequence[int], extra: tuple[Any, ...] | None
    ) -> tuple[BlockHash, int]:
        self.misses += 1
        if len(self._memo) >= self.capacity:
            # Dropping everything is cheaper than LRU bookkeeping on every hit, and a shared
            # prompt is back in the memo after one request.
            self._memo.clear()
        full = hash_block_tokens(self._fn, parent, block, extra)
        value = (full, int(to_external(full)))
        self._memo[key] = value
        return value


class RequestHashes:
    """One request's chain of external block hashes, computed as far as someone asks."""

    __slots__ = ("_cache", "_tokens", "_extra", "_first", "_parent", "_hashes", "_fps", "num_blocks")

    def __init__(
        self,
        cache: BlockHashCache,
        token_ids: Sequence[int],
        extra: tuple[Any, ...] | None,
        first: tuple[Any, ...] | None = None,
    ) -> None:
        self._cache = cache
        self._tokens = token_ids
        self._extra = extra
        self._first = first
        self._parent = cache._root
        self._hashes: list[int] = []
        self._fps: list[int] | None = None
        self.num_blocks = len(token_ids) // cache.block_size

    def __len__(self) -> int:
        return self.num_blocks

    def get(self, i: int) -> int:
        hashes = self._hashes
        if i < len(hashes):
            return hashes[i]
        if i == len(hashes):
            self._extend()
        else:
            if i >= self.num_blocks:
                raise IndexError("block index past the last full block")
            self._hash_until(i + 1)
        return hashes[i]

    def __iter__(self) -> Iterator[int]:
        """The chain, lazily: memoised hashes in one tight loop, the rest SHA-hashed on demand."""
        self._take_memoised()  # block 0 with keys of its own is hashed there, if at all
        hashes = self._hashes
        yield from hashes
        i, n = len(hashes), self.num_blocks
        if i >= n:
            return
        # A cold prompt's walk hashes block after block: the per-block work is inlined.
        cache, fps, extra, tokens = self._cache, self._fps, self._extra, self._tokens
        assert fps is not None  # _take_memoised computed them
        memo, fn, bs = cache._memo, cache._fn, cache.block_size
        while i < n:
            if i == len(hashes):  # else another reader hashed further meanwhile
                key = fps[i] if extra is None else (fps[i], extra)
                found = memo.get(key)
                if found is None:
                    if len(memo) >= cache.capacity:
                        memo.clear()  # as in BlockHashCache._store
                    full = hash_block_tokens(fn, self._parent, tokens[i * bs : (i + 1) * bs], extra)
                    found = memo[key] = (full, int.from_bytes(full[-8:], "big"))
                    cache.misses += 1
                else:
                    cache.hits += 1
                self._parent = found[0]
                hashes.append(found[1])
            yield hashes[i]
            i += 1

    def _take_memoised(self) -> None:
        hashes = self._hashes
        if len(hashes) >= self.num_blocks:
            return
        if self._fps is None:
            self._fps = self._cache.fingerprints(self._tokens)
        memo = self._cache._memo
        extra = self._extra
        parent = self._parent
        start = len(hashes)
        if start == 0 and self._first != extra:
            self._extend()  # block 0 has keys of its own (cache salt)
            parent, start = self._parent, 1
        for fp in self._fps[start:]:
            found = memo.get(fp if extra is None else (fp, extra))
            if found is None:
                break
            parent, external = found
            hashes.append(external)
        self._parent = parent

    def all(self) -> list[int]:
        self._hash_until(self.num_blocks)
        return self._hashes

    def _hash_until(self, stop: int) -> None:
        """Blocks up to ``stop`` in one loop: a memo hit, else hashed (and memoised) vLLM's way.

        ``all()`` (the prefix indexes learning a routed request) walks every block, so the
        per-block work is inlined here rather than a call chain per block.
        """
        hashes = self._hashes
        if len(hashes) >= stop:
            return
        if not hashes and self._first != self._extra:
            self._extend()  # block 0 has keys of its own (cache salt)
        cache = self._cache
        if self._fps is None:
            self._fps = cache.fingerprints(self._tokens)
        fps, memo, extra, tokens, bs = self._fps, cache._memo, self._extra, self._tokens, cache.block_size
        fn, capacity, parent, append = cache._fn, cache.capacity, self._parent, hashes.append
        start = len(hashes)
        misses = 0
        for i in range(start, stop):
            key = fps[i] if extra is None else (fps[i], extra)
            found = memo.get(key)
            if found is None:
                if len(memo) >= capacity:
                    memo.clear()  # as in BlockHashCache._store
                full = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], extra)
                found = memo[key] = (full, int.from_bytes(full[-8:], "big"))
                misses += 1
            parent = found[0]
            append(found[1])
        self._parent = parent
        cache.misses += misses
        cache.hits += stop - start - misses

    def _extend(self) -> None:
        """Hash one more block (the prefix walk asks block by block, and may stop at any)."""
        hashes = self._hashes
        i = len(hashes)
        if i >= self.num_blocks:
            raise IndexError("block index past the last full block")
        cache = self._cache
        fps = self._fps
        if fps is None:
            fps = self._fps = cache.fingerprints(self._tokens)
        extra = self._first if i == 0 else self._extra
        key = fps[i] if extra is None else (fps[i], extra)
        found = cache._memo.get(key)
        if found is None:
            bs = cache.block_size
            found = cache._store(key, self._parent, self._tokens[i * bs : (i + 1) * bs], extra)
        else:
            cache.hits += 1
        self._parent = found[0]
        hashes.append(found[1])
