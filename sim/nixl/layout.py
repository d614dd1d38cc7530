"""The shape of a simulated pod's KV cache in memory, its NIXL descriptors, and its content.

Pure logic, no NIXL and no I/O, so it is tested without an agent.

The layout follows vLLM's NixlConnector with a HND cache and K and V in separate tensors: one
*region* per (layer, K|V), each region ``num_blocks`` blocks of ``block_len`` bytes, all regions
in one contiguous buffer. A block of the pool is therefore ``2 × layers`` descriptors, and the
descriptor of (region r, block b) has index ``r × num_blocks + b`` in a prepared list — the
indexing vLLM's ``_get_block_descs_ids`` uses, so a READ of n blocks is ``2 × layers × n``
descriptors, as on a GPU.

Content: prefill "computes" a block by writing a 32-byte digest of every token up to the block's
end (a block's KV depends on its whole prefix), xor-ed with the region index so that a layer mix-up
is caught too. Decode recomputes the digests from the token ids it was sent and compares.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_BYTES = 32
_WORDS = DIGEST_BYTES // 8


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A model's per-token KV shape and a pool size: what a pod registers with NIXL."""

    num_blocks: int
    block_size: int = 16
    """Tokens per block."""
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim,
               self.dtype_bytes) <= 0:
            raise ValueError(f"every KVLayout dimension must be positive: {self}")
        if self.block_len % DIGEST_BYTES:
            raise ValueError(f"block_len {self.block_len} must be a multiple of {DIGEST_BYTES} bytes")

    @classmethod
    def for_model(cls, name: str, num_blocks: int, block_size: int = 16) -> KVLayout:
        """A named real model's shape (``tiny`` is the small default for tests)."""
        layers, heads, dim, dtype = MODEL_SHAPES[name]
        return cls(num_blocks, block_size, layers, heads, dim, dtype)

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers

    @property
    def block_len(self) -> int:
        """Bytes of one block in one region (one layer's K or V): heads × dim × dtype × tokens."""
        return self.num_kv_heads * self.head_dim * self.dtype_bytes * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V — what a transfer moves per block."""
        return self.num_regions * self.block_len

    @property
    def region_len(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.num_regions * self.region_len


MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    # name: (layers, kv heads, head dim, dtype bytes)
    "tiny": (2, 2, 32, 2),
    "qwen2.5-0.5b": (24, 2, 64, 2),
    "llama-3.2-1b": (16, 8, 64, 2),
    "llama-3.1-8b": (32, 8, 128, 2),
}


def region_bases(base_addr: int, layout: KVLayout) -> list[int]:
    """The start address of each region of a contiguous buffer (vLLM's ``kv_caches_base_addr``)."""
    return [base_addr + r * layout.region_len for r in range(layout.num_regions)]


def descriptors(bases: Sequence[int], block_len: int, num_blocks: int, device_id: int = 0) -> np.ndarray:
    """Every (region, block) as NIXL's Nx3 ``(addr, len, device)`` rows, region-major."""
    offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_len)
    rows = np.empty((len(bases) * num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = (np.asarray(bases, dtype=np.uint64)[:, None] + offsets[None, :]).ravel()
    rows[:, 1] = block_len
    rows[:, 2] = device_id
    return rows


def descriptor_ids(num_regions: int, num_blocks: int, block_ids: Sequence[int]) -> np.ndarray:
    """Indices into ``descriptors`` of the given blocks in every region (int32, region-major)."""
    blocks = np.frombuffer(array("i", block_ids), dtype=np.int32)  # the fastest way in from a list
    if num_regions * num_blocks > np.iinfo(np.int32).max:
        raise ValueError(f"{num_regions} × {num_blocks} descriptors overflow NIXL's int32 indices")
    regions = np.arange(0, num_regions * num_blocks, num_blocks, dtype=np.int32)[:, None]
    return (regions + blocks[None, :]).ravel()


def block_digests(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[bytes]:
    """The content stamp of each block: a digest of all tokens up to the block's last one.

    ``num_blocks`` defaults to every block the tokens touch, the last one possibly partial.
    """
    count = -(-len(token_ids) // block_size) if num_blocks is None else num_blocks
    data = memoryview(np.asarray(token_ids, dtype=np.int64).tobytes())
    step = block_size * 8
    running = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digests = []
    for i in range(count):
        running.update(data[i * step:(i + 1) * step])
        digests.append(running.copy().digest())
    return digests


def as_regions(buffer: np.ndarray, layout: KVLayout) -> np.ndarray:
    """A uint64 view ``[region, block, word-group, word]`` of a pod's KV buffer."""
    return buffer.view(np.uint64).reshape(
        layout.num_regions, layout.num_blocks, layout.block_len // DIGEST_BYTES, _WORDS)


VERIFY_CHUNK_BYTES = 1 << 20
"""Blocks are compared this many bytes at a time, so that the comparison's scratch stays in cache."""


def _stamps(digest: bytes, num_regions: int) -> np.ndarray:
    words = np.frombuffer(digest, dtype=np.uint64)
    return words[None, :] ^ np.arange(num_regions, dtype=np.uint64)[:, None]


def write_blocks(regions: np.ndarray, block_ids: Sequence[int], digests: Sequence[bytes]) -> None:
    """Fill each block, in every region, with its stamp (prefill's stand-in for computing KV)."""
    for block_id, digest in zip(block_ids, digests, strict=True):
        regions[:, block_id] = _stamps(digest, regions.shape[0])[:, None, :]


def block_runs(block_ids: np.ndarray, max_len: int) -> list[tuple[int, int]]:
    """``(start, stop)`` positions in ``block_ids`` of runs of consecutive ids, each at most ``max_len`` long."""
    breaks = (np.flatnonzero(np.diff(block_ids) != 1) + 1).tolist()
    runs: list[tuple[int, int]] = []
    for start, stop in zip([0, *breaks], [*breaks, len(block_ids)], strict=True):
        runs.extend((i, min(i + max_len, stop)) for i in range(start, stop, max_len))
    return runs


def mismatched_blocks(regions: np.ndarray, block_ids: Sequence[int], digests: Sequence[bytes]) -> list[int]:
    """The blocks whose content differs from the expected stamps (empty when all match).

    Every word of every block is checked, in place (a run of consecutive blocks is one view of the
    buffer, nothing is copied): a block's first 32 bytes must be its stamp, and every word must
    equal the word 32 bytes before it — so the stamp is tiled over the whole block. Both compare
    long contiguous rows, which numpy does at memory speed.
    """
    if len(block_ids) != len(digests):
        raise ValueError(f"{len(block_ids)} blocks for {len(digests)} digests")
    if not block_ids:
        return []
    ids = np.asarray(block_ids, dtype=np.int64)
    num_regions, num_blocks = regions.shape[:2]
    rows = regions.reshape(num_regions, num_blocks, -1)  # [region, block, word]
    words = np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(len(ids), _WORDS)
    stamps = words[None] ^ np.arange(num_regions, dtype=np.uint64)[:, None, None]  # [region, block, word]
    per_chunk = max(1, VERIFY_CHUNK_BYTES // (num_regions * rows.shape[2] * 8))
    bad: list[int] = []
    for start, stop in block_runs(ids, per_chunk):
        first = int(ids[start])
        chunk = rows[:, first:first + stop - start]
        heads = chunk[..., :_WORDS] == stamps[:, start:stop]
        tiled = chunk[..., _WORDS:] == chunk[..., :-_WORDS]
        if heads.all() and tiled.all():  # the common case: one flat reduction each
            continue
        ok = (heads.all(axis=2) & tiled.all(axis=2)).all(axis=0)
        bad.extend(ids[start:stop][~ok].tolist())
    return bad
