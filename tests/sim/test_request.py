"""A simulated request's block hashes are vLLM's, however many blocks each update adds."""

from __future__ import annotations

import random

import pytest

from kvflow.hashing import hash_request_tokens
from kvflow.sim.request import BlockHasher, HashConfig, LoraAdapter

from .helpers import SEED

BLOCK = 16


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize(
    ("lora", "salt"), [(None, None), (None, "tenant-7"), (LoraAdapter("sql", "/adapters/sql", 1), None)]
)
def test_a_prompts_hashes_then_a_decodes_one_block_at_a_time_are_the_chain_vllm_computes(
    algo: str, lora: LoraAdapter | None, salt: str | None
) -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(32000) for _ in range(BLOCK * 300 + 5)]  # a prompt of 300 blocks and a bit
    hasher = BlockHasher(HashConfig(BLOCK, SEED, algo), lora, salt)
    hasher.update(tokens[: BLOCK * 3])  # a short prefix first: the plain way
    hasher.update(tokens)  # 297 new blocks at once: laid out together
    for _block in range(2):  # decoding fills one block at a time
        tokens += [rng.randrange(32000) for _ in range(BLOCK)]
        hasher.update(tokens)
    expected = hash_request_tokens(tokens, BLOCK, seed=SEED, algo=algo,
                                   lora=None if lora is None else (lora.name, lora.path), cache_salt=salt)
    assert len(expected) == 302
    assert hasher.hashes == expected
