"""vLLM's KV-cache events on the wire: the one definition the simulator encodes and the router decodes.

vLLM 0.32 (``vllm/distributed/kv_events.py``) sends one ZMQ multipart message per engine step::

    [topic (utf-8), sequence (8-byte big-endian), msgpack(EventBatch)]

``EventBatch`` is a msgspec array ``[ts, [event, ...], data_parallel_rank]``; each event is a
msgspec *tagged map* ``{"type": "BlockStored", ...}`` whose fields with default values are
omitted. The wire structs below (``EventBatch``, ``WireBlockStored``, ``WireBlockRemoved``,
``WireAllBlocksCleared``, ``KVEventBatch``: vLLM's names, prefixed ``Wire`` where the decoded
event takes the name) reproduce that schema field for field (order, types, defaults, tags), so
msgspec encodes byte-identical payloads (``encode_batch``) and ``decode_structs`` reads a payload
as vLLM's own subscriber would.

A subscriber that must not trust its publisher reads payloads with ``decode_batch`` instead: it
yields the decoded events ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` (frozen
dataclasses whose class names are the tags; hashes as the int form
``kvflow.hashing.to_external`` gives, tuples, only the fields a consumer of the cache's contents
needs) and raises ``BadEvent`` for the whole batch when anything is out of range. It is lenient
where vLLM changed: events of older vLLM versions were ``array_like`` too (``["BlockStored",
hashes, parent, ...]``), hashes arrive as ints (the default) or as digests, unknown extra fields
are ignored and unknown event types skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.blockbytes import as_int64
from kvflow.hashing import ExternalBlockHash, external_int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
KV_CACHE_SPEC_KIND = "full_attention"
"""The ``kv_cache_spec_kind`` of a full-attention layer group (the only kind kvflow models)."""


# --- the wire schema, as vLLM 0.32 writes it ------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events; the tag is vLLM's class name."""


class WireBlockStored(WireKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    """Deprecated by vLLM in favour of ``lora_name``; still written."""
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """Per block, the untagged extra keys of its hash (LoRA name, multimodal ``(identifier,
    offset)`` pairs, cache salt, prompt-embedding digests), or None."""
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class WireBlockRemoved(WireKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(WireKVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_STRUCTS = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: list[Any], *, ts: float | None = None, dp_rank: int = 0) -> bytes:
    """One batch's payload, as vLLM encodes it; ``ts`` defaults to now."""
    return _ENCODER.encode(EventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=dp_rank))


def decode_structs(payload: bytes) -> KVEventBatch:
    """The batch as vLLM's own structs (strict: what vLLM's subscribers accept, no range checks)."""
    return _STRUCTS.decode(payload)


# --- the validating decoder ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A decoded ``BlockStored`` (only what a consumer of the cache's contents needs)."""

    block_hashes: tuple[int, ...]
    parent: int | None
    block_size: int | None = None
    token_ids: tuple[int, ...] = ()
    """The stored blocks' tokens, block after block."""
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Each block's extra keys as vLLM publishes them (untagged), or None."""
    medium: str | None = None
    """The tier that stored the blocks: None for the GPU (``"GPU"`` or unsaid), else vLLM's
    name of an offload medium (``"CPU"``: the OffloadingConnector's CPU pool)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A decoded ``BlockRemoved``."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    """As ``BlockStored.medium``: None for the GPU."""


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """A decoded ``AllBlocksCleared``."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


MAX_HASHES_PER_EVENT = 1 << 16
"""More blocks than any one request stores (a million-token prompt at block size 16)."""
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKENS_PER_EVENT = 1 << 21
"""Twice the longest prompt the router accepts."""
MAX_KEY_LENGTH = 1024
"""Characters (or bytes) in a LoRA name or one extra key; extra keys per block: 64."""


class BadEvent(ValueError):
    """A KV event that breaks the protocol: its whole batch is dropped."""


def _ext(h: Any) -> int:
    """A published block hash → the int form; BadEvent for anything else."""
    if isinstance(h, (bytes, bytearray)):
        if not 0 < len(h) <= 64:
            raise BadEvent(f"block hash of {len(h)} bytes")
        return external_int(h)
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 64:
        raise BadEvent(f"block hash {h!r:.40} is not a 64-bit unsigned int or a digest")
    return h


def _hashes(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_HASHES_PER_EVENT:
        raise BadEvent("block_hashes is not a list of at most 65536 hashes")
    return _checked(raw)


def _checked(raw: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
    if set(map(type, raw)) == _INT and min(raw) >= 0 and max(raw) < 1 << 64:
        return tuple(raw)  # vLLM's default form, checked in C (set, min, max) instead of per hash
    return tuple(_ext(h) for h in raw)


_INT = {int}


def _positions(struct: type[msgspec.Struct]) -> dict[str, int]:
    """Field → index after the tag, for the array-tagged events of older vLLM versions (whose
    fields came in the order the structs above still keep)."""
    return {name: i for i, name in enumerate(struct.__struct_fields__)}


_POSITIONS = {"BlockStored": _positions(WireBlockStored), "BlockRemoved": _positions(WireBlockRemoved)}


def _tokens(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_TOKENS_PER_EVENT or as_int64(raw) is None:
        raise BadEvent("token_ids is not a list of at most 2**21 int64 token ids")
    return tuple(raw)


def _name(raw: Any) -> str | None:
    if raw is not None and (not isinstance(raw, str) or len(raw) > MAX_KEY_LENGTH):
        raise BadEvent(f"lora_name {raw!r:.40}")
    return raw


def _medium(raw: Any) -> str | None:
    """vLLM's ``medium``: None (the GPU, also when unsaid) or an offload tier's name, upper case."""
    if raw is None:
        return None
    if not isinstance(raw, str) or len(raw) > 64:
        raise BadEvent(f"medium {raw!r:.40}")
    medium = raw.upper()
    return None if medium == MEDIUM_GPU else medium


def _scalar_key(k: Any) -> bool:
    if isinstance(k, (str, bytes)):
        return len(k) <= MAX_KEY_LENGTH
    return k is None or (isinstance(k, int) and not isinstance(k, bool) and -(1 << 63) <= k < 1 << 64)


def _key(k: Any) -> bool:
    if isinstance(k, (list, tuple)):
        return len(k) <= 4 and all(map(_scalar_key, k))
    return _scalar_key(k)


def _extra_keys(raw: Any, blocks: int) -> tuple[Any, ...] | None:
    """Per block: None, or up to 64 keys, each a string, bytes, an int, or a pair of them
    (multimodal ``(identifier, offset)``)."""
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) != blocks:
        raise BadEvent("extra_keys is not a list with one entry per block")
    out: list[Any] = []
    for keys in raw:
        if keys is not None:
            if not isinstance(keys, (list, tuple)) or len(keys) > 64:
                raise BadEvent("a block's extra_keys is not a list of at most 64 keys")
            if not all(map(_key, keys)):
                raise BadEvent("an extra key is not a string, bytes, an int or a short list of them")
            keys = tuple(tuple(k) if isinstance(k, list) else k for k in keys)
        out.append(keys)
    return tuple(out)


def _fields(raw: Any) -> tuple[Any, Any]:
    """(tag, field getter) for a map-tagged or array-tagged event."""
    if isinstance(raw, dict):
        return raw.get("type"), raw.get
    if isinstance(raw, (list, tuple)) and raw:
        tag, rest = raw[0], raw[1:]
        positions = _POSITIONS.get(tag, {}) if isinstance(tag, str) else {}

        def get(name: str, default: Any = None) -> Any:
            i = positions.get(name, len(rest))
            return rest[i] if i < len(rest) else default

        return tag, get
    return None, None


_REMOVED_HASHES = 1 + _POSITIONS["BlockRemoved"]["block_hashes"]
"""Where an array-tagged ``BlockRemoved`` carries its hashes."""
_REMOVED_MEDIUM = 1 + _POSITIONS["BlockRemoved"]["medium"]
_GPU_MEDIA = (None, MEDIUM_GPU)


_OTHER = object()


def _removed_hashes(raw: Any) -> Any:
    """A GPU ``BlockRemoved``'s hashes as sent, unchecked (None if it has none), or ``_OTHER``
    for any other event (a removal from an offload tier, and an array-tagged removal too short
    to hold its hashes, included: the generic path)."""
    if type(raw) is dict:  # vLLM's tagged map
        if raw.get("type") == "BlockRemoved" and raw.get("medium") in _GPU_MEDIA:
            return raw.get("block_hashes")
        return _OTHER
    if type(raw) is list and len(raw) > _REMOVED_HASHES and raw[0] == "BlockRemoved":  # older vLLM's array
        if len(raw) <= _REMOVED_MEDIUM or raw[_REMOVED_MEDIUM] in _GPU_MEDIA:
            return raw[_REMOVED_HASHES]
    return _OTHER


def decode_event(raw: Any) -> KvEvent | None:
    """One event as msgpack decoded it (untyped) → its decoded form; None for an unknown type."""
    if (removed := _removed_hashes(raw)) is not _OTHER:
        # vLLM's most frequent event (one per evicted block), without the generic field getter
        return BlockRemoved(_hashes(removed))
    tag, get = _fields(raw)
    if tag == "BlockStored":
        parent = get("parent_block_hash")
        size = get("block_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE):
            raise BadEvent(f"block_size {size!r:.40}")
        hashes = _hashes(get("block_hashes"))
        return BlockStored(
            hashes, None if parent is None else _ext(parent), size, _tokens(get("token_ids")),
            _name(get("lora_name")), _extra_keys(get("extra_keys"), len(hashes)), _medium(get("medium")),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(get("block_hashes")), _medium(get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> list[KvEvent]:
    """One published payload → its events; unknown event types are skipped.

    Nothing a pod sends is trusted: a payload that is not vLLM's shape, or any event field out of
    range (a hash that is not a 64-bit int or a digest, a negative block size...), is a
    ``BadEvent`` for the whole batch, so a consumer never applies half of one.
    """
    return [e for e in map(decode_event, _raw_events(payload)) if e is not None]


def decode_runs(payload: bytes) -> tuple[list[KvEvent], dict[str, int]]:
    """``decode_batch`` with every run of consecutive ``BlockRemoved`` events as one, and how
    many events of each type the batch held.

    vLLM sends one ``BlockRemoved`` per evicted block, hundreds in a step that evicts; removals
    commute, so a consumer that applies a run at once loses nothing, and its hashes are checked
    together, one check per run instead of one per event (``kvflow bench router --table ingest``
    measures it). The same checks, the same ``BadEvent``s.
    """
    events: list[KvEvent] = []
    counts: dict[str, int] = {}
    run: list[Any] = []  # the hashes of the BlockRemoved events since the last other event
    removed = 0
    for raw in _raw_events(payload):
        hashes = _removed_hashes(raw)
        if type(hashes) is list and len(hashes) <= MAX_HASHES_PER_EVENT:
            run += hashes
            removed += 1
            continue
        event = decode_event(raw)  # anything else, a malformed BlockRemoved included (it raises)
        if event is None:
            continue
        if run:
            events.append(BlockRemoved(_checked(run)))
            run = []
        events.append(event)
        name = type(event).__name__
        counts[name] = counts.get(name, 0) + 1
    if run:
        events.append(BlockRemoved(_checked(run)))
    if removed:
        counts["BlockRemoved"] = counts.get("BlockRemoved", 0) + removed
    return events, counts


def _raw_events(payload: bytes) -> list[Any] | tuple[Any, ...]:
    """A payload's events as msgpack decoded them (untyped)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadEvent(f"not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise BadEvent("KV event batch is not [ts, events, ...]")
    return batch[1]
