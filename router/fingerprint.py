"""The router's own block keys: a 64-bit fingerprint of every block-aligned prefix of a prompt.

vLLM keys a cached block on a SHA-256 chain over pickled tokens (``kvflow.hashing``), about a
microsecond and a half a block from Python. The router does not need vLLM's hashes to know
which pod holds a prefix: vLLM's ``BlockStored`` events carry each stored block's tokens, its
per-block extra keys and its parent's hash, so the router computes, for every block a pod
reports, the same fingerprint it computes for a request's prompt, and keys its indexes on that
(NVIDIA Dynamo's KV router does the same). The request path never runs SHA-256.

A block's fingerprint chains its parent's, as vLLM's hash does::

    m_i  = splitmix64(sum_j tokens_i[j] * C[j] + keymix(key_i))      # the block alone
    fp_i = fp_{i-1} * K + m_i  (mod 2**64),   fp_{-1} = R            # the prefix up to it

``C`` (one odd constant per position in a block), ``K`` (odd) and ``R`` are drawn per
``Fingerprinter`` from a random secret, and ``keymix`` is a BLAKE2b keyed with it: a client
who does not know them cannot aim a collision at another tenant's prefix (a collision would
only mis-score a pod, never change what a pod serves). Because ``K`` is odd it is invertible
mod 2**64, so a whole prompt's chain is computed at once with numpy::

    fp_i = K**i * (K*R + sum_{j<=i} m_j * K**-j)

while an event's blocks chain on from their parent's fingerprint, whatever their depth. Where
``kvflow._native`` is built, a list of ints is fingerprinted in one pass in C instead, block
after block (``fp_i = fp_{i-1} * K + m_i``), reading the tokens where they are: the numpy form is
the fallback and the specification (``tests/router/test_native.py``).

``key_i`` is a block's extra keys exactly as vLLM's events carry them (``to_event_extra_keys``:
untagged, LoRA name, then ``(mm_identifier, offset)`` pairs, then the cache salt on block 0,
then prompt-embedding digests), with the event's ``lora_name`` beside them, so a salted or
LoRA request's blocks get the fingerprints the pod's events give the same blocks. vLLM's
multimodal identifiers cannot be computed from a request; a multimodal request's blocks are
keyed on the router's own digests of its media instead, which no event carries: such a prompt
never matches what the pods report (identical multimodal requests still match each other in
the indexes the router fills itself).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator, Sequence
from operator import mul
from typing import Any

import msgspec
import numpy as np

from kvflow.blockbytes import as_int64
from kvflow.errors import InvalidRequestError

try:
    from kvflow import _native as native
except ImportError:  # installed without a C compiler: numpy computes the same fingerprints
    native = None  # type: ignore[assignment]

MASK = (1 << 64) - 1
_SMALL = 6
"""Prompts and events of at most this many blocks are fingerprinted in plain Python: numpy's
fixed cost per call (a dozen array operations, each with its own setup) outweighs a few blocks'
work."""
BlockKey = tuple[Any, ...] | None
"""The keys one block is fingerprinted with beyond its tokens: ``(lora_name, extra_keys)`` as
a ``BlockStored`` event gives them, or None for a block with neither."""
_encode = msgspec.msgpack.Encoder().encode


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps, as intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def request_keys(lora: str | None, cache_salt: str | None, media: Sequence[str] = ()) -> tuple[BlockKey, BlockKey]:
    """(block 0's key, every later block's key) for a request, shaped as vLLM's events shape them.

    ``media``: the router's digests of the request's images/audio/video. vLLM keys only the
    blocks that cover an item, on identifiers the router cannot compute, and the router does not
    know where an item's tokens sit, so the digests key every block, in a shape no event has.
    """
    first = [lora] if lora else []
    if cache_salt:
        first.append(cache_salt)
    later = (lora, (lora,)) if lora else None
    head = (lora, tuple(first)) if first else None
    if media:
        digests = ("media", *media)
        return (lora, tuple(first) or None, digests), (lora, later[1] if later else None, digests)
    return head, later


def event_keys(lora_name: str | None, extra_keys: Sequence[Any] | None, n: int) -> list[BlockKey] | None:
    """Each of an event's ``n`` blocks' keys, or None when no block has any.

    An event without ``extra_keys`` (vLLM before 0.11 sent none) is read as vLLM 0.32 would
    have written it: the LoRA name on every block, no cache salt.
    """
    if extra_keys is None:
        return [(lora_name, (lora_name,))] * n if lora_name else None
    if not lora_name and all(k is None for k in extra_keys):
        return None
    return [None if k is None and not lora_name else (lora_name, k) for k in extra_keys]


class Fingerprinter:
    """Prefix fingerprints of one block size, with constants of its own (one per router)."""

    def __init__(self, block_size: int, *, secret: bytes | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(self._secret, person=b"kvflow-fp").digest(), "big"))
        self._token_mix = rng.integers(0, 1 << 63, block_size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._token_mix_list: list[int] = self._token_mix.tolist()
        self._token_mix_bytes = self._token_mix.tobytes()
        self._k = int(rng.integers(0, 1 << 63, dtype=np.uint64)) * 2 + 1
        self.root = int(rng.integers(0, 1 << 63, dtype=np.uint64)) << 1 | 1
        """The parent of block 0: what a ``BlockStored`` without a parent chains on."""
        self._k_inverse = pow(self._k, -1, 1 << 64)
        self._powers = np.ones(0, np.uint64)
        self._inverse_powers = np.ones(0, np.uint64)
        self._key_mixes: dict[bytes, int] = {}

    @property
    def multiplier(self) -> int:
        """``K``, the odd multiplier each block's fingerprint chains on by:
        ``fp_i = fp_{i-1} * K + m_i`` (mod 2**64)."""
        return self._k

    @property
    def token_mix(self) -> bytes:
        """``C``, one odd uint64 per position in a block, as native-order bytes (the form
        ``kvflow._native.fingerprints`` reads): a block's ``m_i`` mixes ``sum_j tokens[j] * C[j]``."""
        return self._token_mix_bytes

    # -- keys --------------------------------------------------------------------------------

    def key_mix(self, key: BlockKey) -> int:
        """A block key's 64-bit contribution (0 for None): a BLAKE2b keyed with the secret."""
        if key is None:
            return 0
        raw = _encode(key)
        found = self._key_mixes.get(raw)
        if found is None:
            found = int.from_bytes(hashlib.blake2b(raw, key=self._secret[:32], digest_size=8).digest(), "big")
            if len(raw) <= 256:  # a pod's long keys are not kept: the memo stays under a megabyte
                if len(self._key_mixes) >= 4096:  # a few adapters and salts are live at a time
                    self._key_mixes.clear()
                self._key_mixes[raw] = found
        return found

    # -- fingerprints ------------------------------------------------------------------------

    def block_mixes(self, values: np.ndarray, keys: Sequence[BlockKey] | None = None) -> np.ndarray:
        """``m_i`` of each full block of ``values`` (int64 tokens), keys per block or None."""
        n = len(values) // self.block_size
        blocks = values[: n * self.block_size].view(np.uint64).reshape(n, self.block_size)
        sums = (blocks * self._token_mix).sum(axis=1, dtype=np.uint64)
        if keys is not None:
            sums += np.array([self.key_mix(k) for k in keys[:n]], np.uint64)
        return _splitmix64(sums)

    def chain(self, parent: int, mixes: np.ndarray) -> np.ndarray:
        """The fingerprints of blocks with these ``m_i``, chained on ``parent``'s fingerprint."""
        n = len(mixes)
        if n > len(self._powers):
            self._grow(n)
        acc = np.cumsum(mixes * self._inverse_powers[:n], dtype=np.uint64)
        acc += np.uint64((parent * self._k) & MASK)
        return acc * self._powers[:n]

    def stored(self, parent: int, token_ids: Sequence[int], keys: Sequence[BlockKey] | None) -> list[int]:
        """The fingerprints of an event's blocks (``token_ids``: theirs, block after block),
        chained on ``parent``'s. Most events report a block or two (a decoding request filled
        one): without ``kvflow._native`` (or with keys), those are computed in plain Python,
        which numpy's fixed costs would outweigh."""
        n = len(token_ids) // self.block_size
        if keys is None and (chained := self._in_c(token_ids, parent, 0, 0)) is not None:
            return chained.tolist()  # type: ignore[no-any-return]
        if n > _SMALL:
            values = as_int64(token_ids)
            if values is None:
                raise ValueError("token ids must be int64")
            return self.chain(parent, self.block_mixes(values, keys)).tolist()  # type: ignore[no-any-return]
        return self._chain_small(parent, token_ids, keys, n)

    def _chain_small(self, parent: int, token_ids: Sequence[int], keys: Sequence[BlockKey] | None, n: int) -> list[int]:
        """``block_mixes`` and ``chain`` for ``n`` blocks, one block at a time in plain Python."""
        size, token_mix, k = self.block_size, self._token_mix_list, self._k
        out, fp = [], parent
        for i in range(n):
            x = sum(map(mul, token_ids[i * size : (i + 1) * size], token_mix))
            if keys is not None:
                x += self.key_mix(keys[i])
            x &= MASK
            x ^= x >> 30
            x = (x * 0xBF58476D1CE4E5B9) & MASK
            x ^= x >> 27
            x = (x * 0x94D049BB133111EB) & MASK
            fp = (fp * k + (x ^ (x >> 31))) & MASK
            out.append(fp)
        return out

    def fingerprints(
        self, values: np.ndarray, first: BlockKey = None, later: BlockKey = None, parent: int | None = None
    ) -> np.ndarray:
        """Every full block's prefix fingerprint of a prompt (int64 tokens): ``first`` keys
        block 0, ``later`` the others."""
        n = len(values) // self.block_size
        keys = None if first is None and later is None else [first, *([later] * (n - 1))] if n else []
        parent = self.root if parent is None else parent
        if n <= _SMALL:
            return np.array(self._chain_small(parent, values[: n * self.block_size].tolist(), keys, n), np.uint64)
        return self.chain(parent, self.block_mixes(values, keys))

    def prompt_array(self, token_ids: Sequence[int], first: BlockKey = None, later: BlockKey = None) -> np.ndarray | None:
        """``fingerprints`` of a prompt's token ids as they came (a list, as tokenizers give
        them), or None if one is not an int64: a list of ints in one pass in C when
        ``kvflow._native`` is built, anything else converted to an array for numpy."""
        chained = self._in_c(token_ids, self.root, self.key_mix(first), self.key_mix(later))
        if chained is not None:
            return chained
        values = as_int64(token_ids)  # a token that is not a plain int: by its value, or None
        return None if values is None else self.fingerprints(values, first, later)

    def _in_c(self, token_ids: Sequence[int], parent: int, first_mix: int, later_mix: int) -> np.ndarray | None:
        """The fingerprints of a list of plain ints in one pass in C, chained on ``parent``; None
        where ``kvflow._native`` is not built, or a token is not a plain int64 (numpy decides)."""
        if native is None or type(token_ids) is not list:
            return None
        raw = native.fingerprints(token_ids, self._token_mix_bytes, self._k, parent, first_mix, later_mix)
        return None if raw is None else np.frombuffer(raw, np.uint64)

    def prompt(self, token_ids: Sequence[int], first: BlockKey = None, later: BlockKey = None) -> PromptFingerprints:
        """A request's fingerprints, computed when first read."""
        return PromptFingerprints(self, token_ids, first, later)

    def _grow(self, n: int) -> None:
        size = 1 << max(10, (n - 1).bit_length())  # a few sizes, not one per prompt length
        self._powers = _powers_of(self._k, size)
        self._inverse_powers = _powers_of(self._k_inverse, size)


def _powers_of(x: int, n: int) -> np.ndarray:
    """``x**0 .. x**(n-1)`` mod 2**64."""
    out = np.full(n, x, np.uint64)
    out[0] = 1
    return np.multiply.accumulate(out, dtype=np.uint64)


_NO_BLOCKS = np.zeros(0, np.uint64)
_NO_BLOCKS.flags.writeable = False


class PromptFingerprints:
    """One request's block fingerprints (``Cycle.hashes``): computed on first read, then an
    array the indexes look up all at once. Iterating gives them as ints, block 0 first."""

    __slots__ = ("_fingerprinter", "_tokens", "_first", "_later", "_array", "_list", "num_blocks")

    def __init__(
        self, fingerprinter: Fingerprinter, token_ids: Sequence[int], first: BlockKey, later: BlockKey
    ) -> None:
        self._fingerprinter = fingerprinter
        self._tokens = token_ids
        self._first = first
        self._later = later
        self._array: np.ndarray | None = None
        self._list: list[int] | None = None
        self.num_blocks = len(token_ids) // fingerprinter.block_size

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self.all())

    @property
    def array(self) -> np.ndarray:
        """The fingerprints as uint64 (InvalidRequestError if a token id is not an int64); a
        prompt shorter than a block has none, and its tokens are not read."""
        if self._array is None:
            if not self.num_blocks:
                self._array = _NO_BLOCKS
                return self._array
            array = self._fingerprinter.prompt_array(self._tokens, self._first, self._later)
            if array is None:
                raise InvalidRequestError("prompt token ids must be integers in the int64 range", param="prompt")
            self._array = array
        return self._array

    @property
    def token_ids(self) -> Sequence[int]:
        return self._tokens

    def all(self) -> list[int]:
        """The fingerprints as ints (what the indexes store)."""
        if self._list is None:
            self._list = self.array.tolist()
        return self._list

    def digest(self) -> str:
        """What the blocks are keyed on (full blocks' tokens, LoRA, salt, media), as a short
        digest that does not depend on this router's secret: two routers, or two processes,
        agree on it for the same request (the debug log, parity tests)."""
        n = self.num_blocks * self._fingerprinter.block_size
        text = ",".join(map(str, self._tokens[:n])) + f"|{self._first!r}|{self._later!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]
