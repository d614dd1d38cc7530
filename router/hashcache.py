"""vLLM block hashes for a request, computed lazily and memoised across requests.

Hashing a block the way vLLM does is a SHA-256 over pickled bytes; ``kvflow.hashing``'s
``chain_hashes`` lays out a run of blocks' bytes at once, but an 8k-token prompt (512 blocks
of 16) still costs a few hundred microseconds to hash. Two things keep that off most
decisions:

* **a prefix-fingerprint memo.** numpy computes, for every block boundary at once, a 64-bit
  fingerprint of the whole prefix up to it (a per-block mix of the block's token ids,
  multiplied by a per-position constant and XOR-accumulated): ~0.1 µs a block instead of a
  SHA-256. The memo maps fingerprint -> vLLM hash, so requests sharing a system prompt reuse
  its hashes. A fingerprint collision (odds ~2^-64 per pair) could only mis-score a pod,
  never change what a pod serves.
* **laziness.** Hashes are computed as far as someone asks: the prefix walk stops at the first
  block no endpoint holds, so an uncached suffix is never SHA-hashed during the decision.

Hashes are kept in their external form (the int vLLM publishes in KV events), so the prefix
indexes key on plain ints.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kvflow.blockbytes import as_int64
from kvflow.errors import InvalidRequestError
from kvflow.hashing import BlockHash, chain_hashes, none_hash, unpack_external


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps, as intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=4)
def _odd_constants(n: int, stream: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers ``0..n-1``: constant for the life of the process, and any
    ``n``'s are a prefix of a larger ``n``'s, so a prompt of any length gets them."""
    seed = np.uint64(0x6B76666C6F77 + (stream << 48))
    return _splitmix64(np.arange(n, dtype=np.uint64) + seed) | np.uint64(1)


def _position_constants(n: int) -> np.ndarray:
    size = 1 << max(10, (n - 1).bit_length())  # a few sizes cached, not one per prompt length
    return _odd_constants(size, 1)[:n]


class BlockHashCache:
    """Memo of block hashes shared by every request of a pool (one hash algo, seed, block size)."""

    def __init__(self, block_size: int, *, seed: str = "0", algo: str = "sha256", capacity: int = 500_000) -> None:
        self.block_size = block_size
        self.seed = seed
        self.algo = algo
        self.capacity = capacity
        self._root = none_hash(seed, algo)
        self._token_mix = _odd_constants(block_size, 0)
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
        return RequestHashes(self, token_ids, extra_keys, first_extra_keys)

    def fingerprints(self, tokens: np.ndarray) -> list[int]:
        """A 64-bit fingerprint of each full-block prefix of ``tokens`` (int64)."""
        n = len(tokens) // self.block_size
        if n == 0:
            return []
        blocks = (tokens[: n * self.block_size].astype(np.uint64).reshape(n, self.block_size) * self._token_mix).sum(
            axis=1, dtype=np.uint64
        )
        blocks = _splitmix64(blocks)  # non-linear in the block's tokens
        return np.bitwise_xor.accumulate(blocks * _position_constants(n)).tolist()  # type: ignore[no-any-return]


class RequestHashes:
    """One request's chain of external block hashes, computed as far as someone asks.

    The blocks the memo knows are taken at the first read (dict lookups, no hashing); past
    them every reader shares one ``kvflow.hashing.chain_hashes`` iterator, so each block is
    hashed once, when the first reader reaches it.
    """

    __slots__ = ("_cache", "_tokens", "_extra", "_first", "_hashes", "_digests", "_keys", "_chain", "num_blocks")

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
        self._first = extra if first is None else first
        self._hashes: list[int] = []
        self._digests: list[BlockHash] = []
        """Full hashes of the blocks hashed here, not yet memoised."""
        self._keys: Sequence[Any] | None = None
        self._chain: Iterator[BlockHash] | None = None
        self.num_blocks = len(token_ids) // cache.block_size

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def known(self) -> list[int]:
        """The hashes computed so far (the memoised ones at least), computing no more."""
        if self._keys is None:
            self._take_memoised()
        return self._hashes

    def iter_from(self, i: int) -> Iterator[int]:
        """The chain from block ``i``, hashed as far as it is read."""
        hashes = self.known()
        if len(hashes) == self.num_blocks:
            return iter(hashes[i:] if i else hashes)  # all known: a plain list iterator
        return self._read(i)

    def all(self) -> list[int]:
        """Every block's hash (the prefix indexes learning where a request went)."""
        if len(self._hashes) < self.num_blocks:
            for _ in self:
                pass
        return self._hashes

    def _take_memoised(self) -> None:
        """The leading blocks the memo knows; the chain iterator for the rest."""
        cache, hashes, n = self._cache, self._hashes, self.num_blocks
        values = as_int64(self._tokens)
        if values is None:
            raise InvalidRequestError("prompt token ids must be integers in the int64 range", param="prompt")
        fingerprints = cache.fingerprints(values)
        extra, first = self._extra, self._first
        keys: Sequence[Any] = fingerprints
        if extra is not None or first is not None:
            keys = [(fp, first if i == 0 else extra) for i, fp in enumerate(fingerprints)]
        self._keys = keys
        memo, parent = cache._memo, cache._root
        for key in keys:
            found = memo.get(key)
            if found is None:
                break
            parent, h = found
            hashes.append(h)
        cache.hits += len(hashes)
        if len(hashes) == n:
            return
        if len(memo) + n - len(hashes) > cache.capacity:
            # Dropping everything is cheaper than LRU bookkeeping on every hit, and a shared
            # prompt is back in the memo after one request.
            memo.clear()
        self._chain = chain_hashes(
            self._tokens,
            cache.block_size,
            parent,
            algo=cache.algo,
            start=len(hashes),
            extra_keys=extra,
            first_extra_keys=first,
            values=values,
        )

    def _read(self, i: int) -> Iterator[int]:
        """The chain from block ``i``: computed ones at list speed, then the shared chain
        iterator. What was hashed is memoised when the reader stops (a walk stops early)."""
        hashes, digests, chain = self._hashes, self._digests, self._chain
        assert chain is not None
        if i < len(hashes):
            yield from itertools.islice(hashes, i, None)  # also yields what others append meanwhile
            i = len(hashes)
        try:
            for digest in chain:
                h = unpack_external(digest)[0]
                hashes.append(h)
                digests.append(digest)
                k = len(hashes) - 1
                if k != i:
                    if k < i:  # not yet at the block this reader starts from
                        continue
                    yield from hashes[i:k]  # another reader went further while this one paused
                yield h
                i = k + 1
        finally:
            self._memoise()

    def _memoise(self) -> None:
        hashes, digests, keys = self._hashes, self._digests, self._keys
        if digests and keys is not None:
            first = len(hashes) - len(digests)
            self._cache._memo.update(zip(keys[first : len(hashes)], zip(digests, hashes[first:])))
            self._cache.misses += len(digests)
            digests.clear()
