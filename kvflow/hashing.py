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

``chain_hashes`` is the one implementation of the chain: the simulator and
``hash_request_tokens`` walk it. Given the tokens as int64 too, a run of blocks without extra
keys is not serialised with ``pickle.dumps``/``cbor2.dumps`` block by block: those bytes have a
fixed shape (``kvflow.blockbytes``), so every block's bytes are written in one call for the run
and only the SHA-256 chain stays a loop — byte for byte the same (tests/core/test_blockbytes.py
compares them with the libraries'), and a little faster.

The simulator publishes these hashes in its KV events, as vLLM does; tests/golden holds events
captured from a real vLLM 0.32.0 that pin them (tests/test_realvllm_golden.py). The router does
not key on them: it fingerprints blocks itself (``kvflow/router/fingerprint.py``), from the
tokens and extra keys the events carry, and keeps vLLM's hashes only to read later events
(``external_int`` turns a digest-form hash into the int form).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from operator import index
from typing import Any, Literal, NewType

import cbor2
import numpy as np

from kvflow import blockbytes

BlockHash = NewType("BlockHash", bytes)
"""The full 32-byte hash vLLM keeps internally."""

ExternalBlockHash = int | bytes
"""The form a hash takes in published KV events."""

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor")
DEFAULT_SEED = "0"  # kvflow starts every vLLM with PYTHONHASHSEED=0 (kvflow/local/realvllm.py)
VLLM_UNSET_SEED = "vllm-none-hash"  # vLLM's seed for sha256/sha256_cbor when PYTHONHASHSEED is unset
DEFAULT_ALGO: HashAlgo = "sha256"

HashFn = Callable[[Any], bytes]

_sha256 = hashlib.sha256
_pickle_dumps = pickle.dumps
_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256_pickle(obj: Any) -> bytes:
    # Module-level aliases: the plain path calls this once per block.
    return _sha256(_pickle_dumps(obj, protocol=_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}

# The byte layouts chain_hashes writes without the serialiser. pickle's layout is protocol 5's;
# should HIGHEST_PROTOCOL ever change, the fast path turns itself off rather than diverge.
_LAYOUTS: dict[str, blockbytes.Layout] = {"sha256_cbor": blockbytes.CBOR}
if _PROTOCOL == 5:
    _LAYOUTS["sha256"] = blockbytes.PICKLE5


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
    """One block the plain way: vLLM's hash function over ``(parent, tuple(tokens), extra_keys)``.

    Token ids are taken by integer value (``operator.index``), as vLLM holds them: a numpy
    integer or a bool hashes as the int it stands for, a float is a TypeError.
    """
    # BlockHash(...) is the identity at run time; calling it costs a tenth of the hash.
    return fn((parent, tuple(map(index, token_ids)), extra_keys))  # type: ignore[return-value]


FAST_MIN_BLOCKS = 4
"""Runs shorter than this are hashed the plain way: numpy's fixed cost exceeds the saving."""


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    *,
    algo: str = DEFAULT_ALGO,
    start: int = 0,
    stop: int | None = None,
    extra_keys: tuple[Any, ...] | None = None,
    first_extra_keys: tuple[Any, ...] | None = None,
    values: np.ndarray | None = None,
) -> Iterator[BlockHash]:
    """vLLM's block-hash chain, lazily: the hash of block ``start`` (chained on ``parent``),
    then of each following full block chained on the one before, up to ``stop`` (exclusive)
    or the last full block.

    ``extra_keys`` key every block; ``first_extra_keys``, when given, key block 0 instead (the
    cache salt goes on block 0 only). A block is hashed when the iterator reaches it.

    ``values`` is ``token_ids`` as int64, for a caller that has them anyway: then the bytes of runs of blocks are laid out together
    (``kvflow.blockbytes``) as the iterator reaches each run — the first block alone (a prefix
    walk that finds nothing cached stops there), then 63, then 8 times more each time. Without
    them every block is serialised the plain way: converting the tokens costs about what the
    layout saves.
    """
    fn = hash_fn(algo)
    n = len(token_ids) // block_size
    stop = n if stop is None else min(stop, n)
    first = extra_keys if first_extra_keys is None else first_extra_keys
    i = start
    if i == 0 and stop > 0 and first != extra_keys:
        parent = hash_block_tokens(fn, parent, token_ids[:block_size], first)
        yield parent
        i = 1
    layout = _LAYOUTS.get(algo) if extra_keys is None and values is not None else None
    run = 1
    while i < stop:
        end = min(stop, i + run)
        parts = None
        if layout is not None and end - i >= FAST_MIN_BLOCKS:
            a, b = i * block_size, end * block_size
            parts = layout.blocks(token_ids[a:b], block_size, values[a:b])  # type: ignore[index]
        if parts is None:  # a short run, extra keys, or tokens outside the layout: the plain way
            for j in range(i, end):
                parent = hash_block_tokens(fn, parent, token_ids[j * block_size : (j + 1) * block_size], extra_keys)
                yield parent
        else:
            codes, opening, closing = parts.codes, parts.opening, parts.closing
            for head, a, b in zip(parts.heads, parts.starts, parts.ends):
                parent = _sha256(head + parent + opening + codes[a:b] + closing).digest()  # type: ignore[assignment]
                yield parent
        i = end
        run = 63 if run == 1 else 8 * run


def block_extra_keys(
    block_index: int, *, lora: tuple[str, str] | None = None, cache_salt: str | None = None
) -> tuple[Any, ...] | None:
    """The tagged extra keys vLLM hashes into one block (``generate_block_hash_extra_keys``).

    ``lora`` is ``(lora_name, lora_path)``: vLLM keys on the adapter's path too. The cache
    salt keys block 0 only.
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
    if extra_keys is None:
        extra_keys, first = block_extra_keys(1, lora=lora), block_extra_keys(0, lora=lora, cache_salt=cache_salt)
    else:
        first = extra_keys
    chain = chain_hashes(
        token_ids,
        block_size,
        none_hash(seed, algo),
        algo=algo,
        stop=max_blocks,
        extra_keys=extra_keys,
        first_extra_keys=first,
    )
    return list(chain)


def external_int(block_hash: bytes | bytearray) -> int:
    """The int form vLLM publishes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the
    digest's last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


unpack_external = struct.Struct(">24xQ").unpack
"""``unpack_external(h)[0] == external_int(h)`` for a 32-byte ``h``, in one C call (a
Python-level call costs twice the conversion)."""


def to_external(block_hash: BlockHash, *, as_int: bool = True) -> ExternalBlockHash:
    """The form vLLM publishes in KV events: ``external_int`` by default, else the raw bytes."""
    return external_int(block_hash) if as_int else bytes(block_hash)
