"""``kv_transfer_params``: the fields vLLM 0.32's NixlConnector puts in OpenAI bodies for P/D.

Three messages carry them (docs/vllm-protocols.md §5, real ones in ``tests/golden/vllm_pd.json``):

1. router → prefill pod, ``remote_decode_request()``: "compute the prompt and keep its KV for a
   remote decode". The six keys vLLM's own proxies send; vLLM reads only ``do_remote_decode``.
2. prefill pod → router, in its answer: where the blocks are. ``KvTransferParams.to_wire()``
   writes the keys in the order vLLM's ``request_finished`` does (``pull_scheduler.py``):
   ``do_remote_prefill``, ``remote_block_ids`` (one list per KV-cache group), the engine id,
   the request's id there, the side channel's host and port (not HTTP), the parallel sizes,
   ``remote_num_tokens``, …, and ``remote_prefill_cached_tokens`` where vLLM's scheduler adds it.
3. router → decode pod: message 2, verbatim (a field a newer vLLM adds reaches the decode pod).

``KvTransferParams.from_wire`` parses any JSON value. A field of the wrong type raises
``InvalidKvTransferParams`` (a ``ValueError``); a missing one does not, since vLLM reads every
field with ``get``; keys this version does not know are kept in ``extra`` and written back.
Whether params say enough to pull from is a separate question: ``remote()`` (the prefill
engine, the request's id there, the side channel) and ``parse_prefill_answer`` (that, plus
blocks: what a decode pod needs, ``pull_scheduler.py:135-143``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REMOTE_DECODE_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
                      "remote_host", "remote_port")
"""Message 1's keys, in the order vLLM's proxies write them."""
ADDRESS_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
"""What a decode pod needs to find the blocks, besides their ids."""

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV-cache group (a plain attention model has one group)."""


class InvalidKvTransferParams(ValueError):
    """``kv_transfer_params`` a P/D step cannot use: a field of the wrong type, or one missing."""


@dataclass(frozen=True, slots=True)
class PrefillEngine:
    """A prefill engine and where a decode pod reaches it."""

    engine_id: str
    host: str
    port: int
    """The prefill pod's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), not its HTTP port."""


@dataclass(frozen=True, slots=True)
class KvTransferParams:
    """Every field vLLM 0.32's NixlConnector reads or writes, in its answer's order."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: BlockIds | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str | None = None
    """``"pull"`` (the decode pod READs) or ``"push"`` (the prefill pod WRITEs)."""
    remote_prefill_cached_tokens: int | None = None
    """Prompt tokens the prefill pod found in its own prefix cache (vLLM's scheduler adds it)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this version does not know, kept as they came."""

    @classmethod
    def from_wire(cls, value: object) -> KvTransferParams:
        """Parse a JSON value; ``InvalidKvTransferParams`` names the first field of the wrong type."""
        if not isinstance(value, Mapping):
            raise InvalidKvTransferParams(f"kv_transfer_params must be an object, not {type(value).__name__}")
        known, extra = {}, {}
        for key, raw in value.items():
            parse = _PARSERS.get(key)
            if parse is None:
                extra[key] = raw
            elif raw is not None:
                known[key] = parse(key, raw)
        return cls(**known, extra=extra)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object vLLM writes (message 2), then the ``extra`` keys."""
        out = {name: getattr(self, name) for name in _PARSERS}
        if self.remote_block_ids is not None:
            out["remote_block_ids"] = [list(group) for group in self.remote_block_ids]
        if self.remote_prefill_cached_tokens is None:  # vLLM's scheduler adds it only with prefill stats
            del out["remote_prefill_cached_tokens"]
        return {**out, **self.extra}

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The first KV-cache group's blocks (the simulator's only group); empty if none."""
        return self.remote_block_ids[0] if self.remote_block_ids else ()

    def remote(self) -> tuple[PrefillEngine, str]:
        """Where to pull from: the prefill engine, and the request's id there (its blocks are
        pinned under it); ``InvalidKvTransferParams`` if a field of the address is missing."""
        missing = [key for key in ADDRESS_KEYS if getattr(self, key) in (None, "")]
        if missing:
            raise InvalidKvTransferParams(f"kv_transfer_params lack {', '.join(missing)}")
        assert self.remote_engine_id and self.remote_host and self.remote_request_id and self.remote_port is not None
        return PrefillEngine(self.remote_engine_id, self.remote_host, self.remote_port), self.remote_request_id


def remote_decode_request() -> dict[str, Any]:
    """Message 1, as vLLM's proxies send it (``do_remote_decode`` true, the rest false or null)."""
    wire = KvTransferParams(do_remote_decode=True).to_wire()
    return {key: wire[key] for key in REMOTE_DECODE_KEYS}


def parse_prefill_answer(value: object) -> KvTransferParams:
    """A prefill pod's params, checked to be what a decode pod can pull with: ``do_remote_prefill``,
    blocks, and a complete address. ``InvalidKvTransferParams`` says what is wrong."""
    params = KvTransferParams.from_wire(value)
    if not params.do_remote_prefill:
        raise InvalidKvTransferParams("kv_transfer_params do not offer a remote prefill (do_remote_prefill)")
    if not params.block_ids:
        raise InvalidKvTransferParams("kv_transfer_params name no remote_block_ids")
    params.remote()
    return params


# -- field parsers: (key, JSON value) -> the field's value, or InvalidKvTransferParams ---------------------


def _wrong(key: str, value: object, expected: str) -> InvalidKvTransferParams:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."  # a client's value may be any size
    return InvalidKvTransferParams(f"kv_transfer_params have a bad {key}: {shown} (expected {expected})")


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _wrong(key, value, "true or false")
    return value


def _str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise _wrong(key, value, "a string")
    return value


def _int_at_least(low: int, high: int | None = None) -> Callable[[str, object], int]:
    def parse(key: str, value: object) -> int:
        if type(value) is not int or value < low or (high is not None and value > high):
            raise _wrong(key, value, f"an integer from {low}" + (f" to {high}" if high is not None else " up"))
        return value
    return parse


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(key, value, "a number")
    return value


def _block_ids(key: str, value: object) -> BlockIds:
    """One list per KV-cache group, as vLLM writes it; a flat list is read as one group."""
    if not isinstance(value, list | tuple):
        raise _wrong(key, value, "a list of block ids per KV-cache group")
    if not value:
        return ()
    groups = value if all(isinstance(group, list | tuple) for group in value) else [value]
    block = _int_at_least(0)
    try:
        return tuple(tuple(block(key, b) for b in group) for group in groups)
    except InvalidKvTransferParams:
        raise _wrong(key, value, "a list of block ids per KV-cache group") from None


_PARSERS: dict[str, Callable[[str, object], Any]] = {  # every field but extra, in the dataclass's order
    "do_remote_prefill": _bool,
    "do_remote_decode": _bool,
    "remote_block_ids": _block_ids,
    "remote_engine_id": _str,
    "remote_request_id": _str,
    "remote_host": _str,
    "remote_port": _int_at_least(0, 65535),
    "tp_size": _int_at_least(1),
    "dcp_size": _int_at_least(1),
    "pp_size": _int_at_least(1),
    "remote_num_tokens": _int_at_least(0),
    "remote_blocks_expiry_time": _number,
    "transfer_mode": _str,
    "remote_prefill_cached_tokens": _int_at_least(0),
}
