"""The bytes vLLM's block-hash functions feed to SHA-256, written for a run of blocks at once.

vLLM hashes block ``i`` as ``sha256(serialise((parent, tuple(tokens_i), extra_keys)))``. With
no extra keys the serialised bytes have a fixed shape around one variable-width code per
token, so the codes of a whole run of blocks are written in one call, cut per block, and only
the SHA-256 chain, which needs each parent, stays a loop (``kvflow.hashing.chain_hashes``).
A block's bytes are ``head + parent + tail``, the tail being an opening, the block's token
codes and a closing.

``pickle.dumps(obj, protocol=5)`` (CPython's C pickler, ``Modules/_pickle.c``)::

    head: PROTO 5 | FRAME <length of the rest, 8 bytes LE> | SHORT_BINBYTES 32
    tail: MEMOIZE | MARK | <code>... | TUPLE | MEMOIZE | NONE | TUPLE3 | MEMOIZE | STOP
    code: BININT1 "K" <1 byte> for 0..255, BININT2 "M" <2 bytes LE> for 256..65535,
          else BININT "J" <4 bytes LE, two's complement> within int32

The pickler writes a FRAME only for a payload of at least 4 bytes (always, here), a tuple of
four or more items as MARK ... TUPLE (TUPLE1-3 below that, so smaller blocks are left to
pickle), and the same int codes at every protocol from 1: the codes of a run are cut from one
``pickle.dumps`` of the run's tokens (protocol 2: no frames to skip). Ints outside int32
(LONG1) are left to pickle.

``cbor2.dumps(obj, canonical=True)``::

    head: array(3) | bytes(32)
    tail: array(block_size) | <code>... | null
    code: the value itself for 0..23, else 0x18 <1 byte>, 0x19 <2 bytes BE> or 0x1a <4 bytes BE>

cbor2 encodes an int several times slower than pickle, so numpy writes the CBOR codes.
Negative or 2**32-and-over tokens are left to cbor2.

``Layout.blocks`` answers None whenever its input falls outside its layout, and the caller
serialises the plain way; tests compare both ways byte for byte (tests/core/test_blockbytes.py)
and against hashes real vLLM published.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True, slots=True)
class Layout:
    """One serialiser's bytes for ``(parent, tuple(tokens), None)``, as head and tail."""

    name: str
    min_token: int
    max_token: int
    min_block_size: int
    max_block_size: int
    codes: Callable[[tuple[int, ...], np.ndarray], bytes]
    """Every token's code, back to back (from the tokens, and the same as int64)."""
    code_bytes: Callable[[np.ndarray], np.ndarray]
    """Each token's code length, from the tokens as int64."""
    head: Callable[[int], bytes]
    """The bytes before the parent, given the tail's length."""
    tail_open: Callable[[int], bytes]
    """The bytes between the parent and the first code, given the block size."""
    tail_close: bytes

    def blocks(self, token_ids: Sequence[int], block_size: int, values: np.ndarray | None = None) -> Run | None:
        """Every full block's bytes, or None if the block size or a token is outside this
        layout (the caller then serialises the plain way). ``values``: ``token_ids`` as int64,
        if the caller has them."""
        if not self.min_block_size <= block_size <= self.max_block_size:
            return None
        n = len(token_ids) // block_size
        count = n * block_size
        if values is None:
            values = as_int64(token_ids[:count])
            if values is None:
                return None
        values = values[:count]
        if n == 0:
            return Run([], b"", [], [], b"", b"")
        if int(values.min()) < self.min_token or int(values.max()) > self.max_token:
            return None
        tokens = tuple(token_ids[:count])
        if type(tokens[0]) is not int or type(tokens[-1]) is not int:  # noqa: E721 (numpy ints pickle otherwise)
            tokens = tuple(values.tolist())
        codes = self.codes(tokens, values)
        code_lengths = self.code_bytes(values).reshape(n, block_size).sum(axis=1)
        ends = np.cumsum(code_lengths).tolist()
        if ends[-1] != len(codes):  # a code length this layout did not predict: never hash it
            return None
        opening, closing = self.tail_open(block_size), self.tail_close
        extra = len(opening) + len(closing)
        heads = {length: self.head(length + extra) for length in set(code_lengths.tolist())}
        return Run(list(map(heads.__getitem__, code_lengths.tolist())), codes, [0, *ends[:-1]], ends, opening, closing)


class Run(NamedTuple):
    """A run of blocks' bytes: block ``i`` is ``heads[i] + parent + opening +
    codes[starts[i]:ends[i]] + closing`` (the tail is cut where it is hashed: building the
    tails as a list first costs more)."""

    heads: list[bytes]
    codes: bytes
    starts: list[int]
    ends: list[int]
    opening: bytes
    closing: bytes


def as_int64(token_ids: Sequence[int] | np.ndarray) -> np.ndarray | None:
    """Token ids as int64 by integer value (as ``operator.index`` takes them), or None if one
    is not an integer or does not fit."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind == "i":
            return token_ids.astype(np.int64, copy=False)
        if token_ids.dtype.kind in "ub" and (token_ids.size == 0 or int(token_ids.max()) < 1 << 63):
            return token_ids.astype(np.int64)
        return None
    try:
        # struct packs a list of ints faster than np.array or array.array convert it
        return np.frombuffer(struct.pack(f"{len(token_ids)}q", *token_ids), np.int64)
    except (struct.error, TypeError, OverflowError):
        return None


def _pickle_codes(tokens: tuple[int, ...], values: np.ndarray) -> bytes:
    # PROTO 2 | MARK | <codes> | TUPLE | BINPUT 0 | STOP
    return pickle.dumps(tokens, protocol=2)[3:-4]


def _pickle_code_bytes(values: np.ndarray) -> np.ndarray:
    """2, 3 or 5, as ``save_long`` picks BININT1/BININT2/BININT (negatives take BININT)."""
    wide = (values > 0xFFFF) | (values < 0)
    return 2 + ((values > 0xFF) | wide).view(np.int8) + 2 * wide.view(np.int8)


def _pickle_head(tail_length: int) -> bytes:
    # The frame holds everything after its header: SHORT_BINBYTES, its length byte, the parent, the tail.
    return b"\x80\x05\x95" + (2 + 32 + tail_length).to_bytes(8, "little") + b"C\x20"


PICKLE5 = Layout(
    name="pickle protocol 5",
    min_token=-(1 << 31),
    max_token=(1 << 31) - 1,
    min_block_size=4,  # 1-3 items pickle as TUPLE1-3, without MARK
    max_block_size=4096,  # one FRAME: the pickler starts a new one past 64 KiB
    codes=_pickle_codes,
    code_bytes=_pickle_code_bytes,
    head=_pickle_head,
    tail_open=lambda _block_size: b"\x94(",
    tail_close=b"t\x94N\x87\x94.",
)


def _cbor_code_bytes(values: np.ndarray) -> np.ndarray:
    """Major type 0 in its shortest form: 1, 2, 3 or 5 bytes."""
    return 1 + (values >= 24).view(np.int8) + (values > 0xFF).view(np.int8) + 2 * (values > 0xFFFF).view(np.int8)


def _cbor_codes(tokens: tuple[int, ...], values: np.ndarray) -> bytes:
    """One row per token — the initial byte, then the argument big-endian — packed by a mask."""
    v = values.astype(np.uint64)
    argument_bytes = _cbor_code_bytes(values) - 1
    rows = np.empty((len(v), 5), np.uint8)
    rows[:, 0] = np.select([v < 24, v <= 0xFF, v <= 0xFFFF], [values, 0x18, 0x19], 0x1A)
    # Shift the argument to the front of a big-endian uint32, so its bytes lead the row.
    shifted = (v << (8 * (4 - argument_bytes)).astype(np.uint64)).astype(">u4")
    rows[:, 1:] = shifted.view(np.uint8).reshape(-1, 4)
    return rows[np.arange(5) <= argument_bytes[:, None]].tobytes()


def _cbor_array_header(length: int) -> bytes:
    if length < 24:
        return bytes([0x80 | length])
    if length <= 0xFF:
        return bytes([0x98, length])
    return b"\x99" + length.to_bytes(2, "big")


CBOR = Layout(
    name="canonical CBOR",
    min_token=0,
    max_token=(1 << 32) - 1,
    min_block_size=1,
    max_block_size=0xFFFF,
    codes=_cbor_codes,
    code_bytes=_cbor_code_bytes,
    head=lambda _tail_length: b"\x83\x58\x20",
    tail_open=_cbor_array_header,
    tail_close=b"\xf6",
)
