"""One request as the simulated engine sees it: tokens, blocks, hashes, timing, status.

Mutable on purpose (the scheduler advances it every step), but only the scheduler writes it;
the HTTP layer reads ``text``/``output_ids``/``finish_reason`` after a wake-up.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.blockbytes import as_int64
from kvflow.hashing import FAST_MIN_BLOCKS, BlockHash, block_extra_keys, chain_hashes, none_hash


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    adapter_id: int


@dataclass(frozen=True, slots=True)
class HashConfig:
    block_size: int
    seed: str
    algo: str


class BlockHasher:
    """Chained block hashes over a growing token list, with vLLM's per-block extra keys.

    Extra keys are tagged in the hash — ``("lora", name, path)`` on every block and
    ``("cache_salt", salt)`` on the first block only — as ``generate_block_hash_extra_keys`` does.
    """

    __slots__ = ("_cfg", "_lora", "_salt", "hashes")

    def __init__(self, cfg: HashConfig, lora: LoraAdapter | None, cache_salt: str | None) -> None:
        self._cfg = cfg
        self._lora = lora
        self._salt = cache_salt
        self.hashes: list[BlockHash] = []

    def extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        lora = (self._lora.name, self._lora.path) if self._lora is not None else None
        return block_extra_keys(block_index, lora=lora, cache_salt=self._salt)

    def event_extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        """The untagged form KV events publish: the key's second element."""
        keys = self.extra_keys(block_index)
        return None if keys is None else tuple(k[1] for k in keys)

    def update(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids``, computing those not known yet.

        A prompt's many new blocks are hashed from their bytes laid out at once
        (``chain_hashes``' ``values``: one conversion of the tokens and one pass, cheaper per block
        than a call each); the one block a decode fills now and then, the plain way."""
        cfg, hashes = self._cfg, self.hashes
        parent = hashes[-1] if hashes else none_hash(cfg.seed, cfg.algo)
        new = len(token_ids) // cfg.block_size - len(hashes)
        fast = new >= FAST_MIN_BLOCKS and self._lora is None  # a LoRA keys every block: the plain way
        values = as_int64(token_ids) if fast else None
        hashes.extend(
            chain_hashes(token_ids, cfg.block_size, parent, algo=cfg.algo, start=len(hashes),
                         extra_keys=self.extra_keys(1), first_extra_keys=self.extra_keys(0), values=values)
        )
        return hashes


Notify = Callable[[], None]


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    hasher: BlockHasher
    rng: random.Random
    arrival: float
    stop: tuple[str, ...] = ()
    lora: LoraAdapter | None = None
    kv_transfer_params: dict[str, Any] | None = None
    notify: Notify | None = None
    forced_output: list[int] | None = None
    """Output token ids to emit instead of sampling (conformance replays of real captures)."""
    report_full_cache: bool = False
    """vLLM's ``kv_cache_report_mode: full``: re-announce prefix-cache hits as BlockStored."""

    all_token_ids: list[int] = field(init=False)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: Status = Status.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0
    """Blocks whose hashes the pool already knows (hits plus blocks this request cached)."""
    cached_tokens: int = 0
    """Prompt tokens served from the local prefix cache at first scheduling (CPU tier included)."""
    offloaded_tokens: int = 0
    """Of ``cached_tokens``, those loaded back from the CPU offload tier."""
    reloading: int = 0
    """Tokens the CPU tier will load for this request when it is next admitted (then charged to that step)."""
    remote_pull_done: bool = False
    pull_ok: bool | None = None
    pull_seconds: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | None = None
    num_preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    kv_transfer_out: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def wants_remote_decode(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def wants_remote_prefill(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
