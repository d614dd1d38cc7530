"""Prefix-cache block hashing, computed exactly as vLLM's v1 KV-cache manager does.

vLLM (``vllm/v1/core/kv_cache_utils.py``) hashes a request's tokens in full blocks of
``block_size`` tokens. Each block's hash chains its parent's::

    hash(block_i) = H((hash(block_{i-1}) or NONE_HASH, tuple(block_i_token_ids), extra_keys_i))

where ``H`` is the ``--prefix-caching-hash-algo`` function (default ``sha256``: SHA-256 over
``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)``; ``sha256_cbor``: SHA-256 over canonical CBOR)
and ``NONE_HASH = H(seed)`` where the seed is the ``PYTHONHASHSEED`` *string* if set, else
``"vllm-none-hash"`` for the sha256 algorithms. ``extra_keys_i`` is ``None`` or a tuple of
tagged keys in this order: ``("lora", name, path)`` on every block of a LoRA request, then
``("cache_salt", salt)`` on block 0 only. A partial trailing block is never hashed. KV events
publish each hash in its external form: by default the last 8 bytes as a big-endian unsigned
int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), else the raw 32 bytes.

The simulator and the router share this module, so a hash the router computes for a prompt
equals the hash a pod publishes in its KV events for the same tokens; tests/golden holds
events captured from a real vLLM 0.32.0 that pin this (tests/test_realvllm_golden.py).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal, NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
"""The full 32-byte hash vLLM keeps internally."""

ExternalBlockHash = int | bytes
"""The form a hash takes in published KV events."""

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor")
DEFAULT_SEED = "0"  # kvflow starts every vLLM with PYTHONHASHSEED=0 (kvflow.realvllm)
VLLM_UNSET_SEED = "vllm-none-hash"  # vLLM's seed for sha256/sha256_cbor when PYTHONHASHSEED is unset
DEFAULT_ALGO: HashAlgo = "sha256"

HashFn = Callable[[Any], bytes]


_sha256 = hashlib.sha256
_pickle_dumps = pickle.dumps
_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256_pickle(obj: Any) -> bytes:
    # Module-level aliases: an 8k-token prompt calls this 512 times per cold decision.
    return _sha256(_pickle_dumps(obj, protocol=_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


def hash_fn(algo: str) -> HashFn:
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}; expected one of {HASH_ALGOS}") from None


@lru_cache(maxsize=64)
def none_hash(seed: str, algo: str = DEFAULT_ALGO) -> BlockHash:
    """The parent of the first block: the hash of the PYTHONHASHSEED string."""
    return BlockHash(hash_fn(algo)(seed))


def hash_block_tokens(
    fn: HashFn,
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    # BlockHash(...) is the identity at run time; calling it costs a tenth of the hash.
    return fn((parent, tuple(token_ids), extra_keys))  # type: ignore[return-value]


def block_extra_keys(
    block_index: int, *, lora: tuple[str, str] | None = None, cache_salt: str | None = None
) -> tuple[Any, ...] | None:
    """The tagged extra keys vLLM hashes into one block (``generate_block_hash_extra_keys``).

    ``lora`` is ``(lora_name, lora_path)``: vLLM keys on the adapter's path too, so the router
    must know the path the pod loaded the adapter from. The cache salt keys block 0 only.
    """
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    algo: str = DEFAULT_ALGO,
    extra_keys: tuple[Any, ...] | None = None,
    max_blocks: int | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (at most ``max_blocks``).

    ``lora`` and ``cache_salt`` build the per-block keys exactly as vLLM does (see
    ``block_extra_keys``). ``extra_keys`` is a raw override applied to every block, for callers
    that already hold vLLM's tagged tuple; it cannot be combined with ``lora``/``cache_salt``.
    """
    if extra_keys is not None and (lora is not None or cache_salt):
        raise ValueError("pass either extra_keys or lora/cache_salt, not both")
    fn = hash_fn(algo)
    parent = none_hash(seed, algo)
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    hashes: list[BlockHash] = []
    first: tuple[Any, ...] | None
    rest: tuple[Any, ...] | None
    if extra_keys is not None:
        first = rest = extra_keys
    else:
        first, rest = block_extra_keys(0, lora=lora, cache_salt=cache_salt), block_extra_keys(1, lora=lora)
    for i in range(n_blocks):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = fn((parent, block, rest if i else first))  # type: ignore[assignment]
        hashes.append(parent)
    return hashes


def to_external(block_hash: BlockHash, *, as_int: bool = True) -> ExternalBlockHash:
    """The form vLLM publishes in KV events: the last 8 bytes as a big-endian int by default."""
    return int.from_bytes(block_hash[-8:], "big") if as_int else bytes(block_hash)
