"""The hand-laid block bytes are exactly what pickle and cbor2 write, and the fast chain equals the plain one."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from pathlib import Path

import cbor2
import numpy as np
import pytest

from kvflow import blockbytes
from kvflow.hashing import (
    chain_hashes,
    external_int,
    hash_fn,
    none_hash,
    to_external,
    unpack_external,
)

PARENT = bytes(range(32))
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**24, 2**31 - 1]
NEGATIVE = [-1, -255, -256, -65536, -(2**31)]


def serialised(layout: blockbytes.Layout, block: list[int]) -> bytes:
    if layout is blockbytes.PICKLE5:
        return pickle.dumps((PARENT, tuple(block), None), protocol=5)
    return cbor2.dumps((PARENT, tuple(block), None), canonical=True)


def laid_out(layout: blockbytes.Layout, tokens: list[int], block_size: int) -> list[bytes]:
    run = layout.blocks(tokens, block_size)
    assert run is not None
    return [
        head + PARENT + run.opening + run.codes[a:b] + run.closing
        for head, a, b in zip(run.heads, run.starts, run.ends, strict=True)
    ]


def blocks_of(tokens: list[int], block_size: int) -> list[list[int]]:
    return [tokens[i : i + block_size] for i in range(0, len(tokens) - block_size + 1, block_size)]


@pytest.mark.parametrize("block_size", [4, 5, 16, 32, 128, 4096])
def test_pickle_layout_is_byte_for_byte_pickle_protocol_5(block_size: int) -> None:
    rng = random.Random(block_size)
    values = EDGES + NEGATIVE
    tokens = [rng.choice(values) if rng.random() < 0.3 else rng.randrange(-(2**31), 2**31) for _ in range(3 * block_size)]
    tokens += [rng.randrange(32000) for _ in range(block_size + 3)]  # and a partial block, ignored
    expected = [serialised(blockbytes.PICKLE5, b) for b in blocks_of(tokens, block_size)]
    assert laid_out(blockbytes.PICKLE5, tokens, block_size) == expected


@pytest.mark.parametrize("block_size", [1, 2, 16, 23, 24, 255, 256])
def test_cbor_layout_is_byte_for_byte_canonical_cbor(block_size: int) -> None:
    rng = random.Random(block_size)
    values = [v for v in EDGES if v >= 0] + [2**32 - 1, 2**16 - 1, 2**8]
    tokens = [rng.choice(values) if rng.random() < 0.3 else rng.randrange(2**32) for _ in range(3 * block_size)]
    expected = [serialised(blockbytes.CBOR, b) for b in blocks_of(tokens, block_size)]
    assert laid_out(blockbytes.CBOR, tokens, block_size) == expected


@pytest.mark.parametrize(
    ("layout", "tokens", "block_size"),
    [
        (blockbytes.PICKLE5, [2**31] + [1] * 15, 16),  # LONG1
        (blockbytes.PICKLE5, [-(2**31) - 1] + [1] * 15, 16),
        (blockbytes.PICKLE5, [1, 2, 3], 3),  # TUPLE3, no MARK
        (blockbytes.PICKLE5, [1] * 5000, 5000),  # past one FRAME's worth
        (blockbytes.PICKLE5, [1.0] + [1] * 15, 16),
        (blockbytes.CBOR, [-1] + [1] * 15, 16),
        (blockbytes.CBOR, [2**32] + [1] * 15, 16),
        (blockbytes.PICKLE5, [2**70] + [1] * 15, 16),
    ],
    ids=["int32+1", "int32-1", "block-3", "block-5000", "float", "cbor-negative", "cbor-2**32", "huge"],
)
def test_outside_the_layout_is_left_to_the_serialiser(layout: blockbytes.Layout, tokens: list, block_size: int) -> None:
    assert layout.blocks(tokens, block_size) is None


def plain_chain(tokens: list[int], block_size: int, algo: str, seed: str = "0", extra=None, first=None) -> list[bytes]:
    fn, parent, out = hash_fn(algo), none_hash(seed, algo), []
    for i, block in enumerate(blocks_of(tokens, block_size)):
        keys = (first if first is not None else extra) if i == 0 else extra
        parent = fn((parent, tuple(int(t) for t in block), keys))
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("n_tokens", [0, 15, 16, 64, 100 * 16 + 7, 8192])
def test_fast_chain_equals_the_plain_chain(algo: str, n_tokens: int) -> None:
    rng = random.Random(n_tokens)
    tokens = [rng.choice(EDGES) if rng.random() < 0.1 else rng.randrange(128256) for _ in range(n_tokens)]
    want = plain_chain(tokens, 16, algo)
    assert list(chain_hashes(tokens, 16, none_hash("0", algo), algo=algo)) == want  # the plain way
    values = np.array(tokens, dtype=np.int64)
    assert list(chain_hashes(tokens, 16, none_hash("0", algo), algo=algo, values=values)) == want  # laid out


def test_a_chain_resumes_from_any_block_and_stops_where_asked() -> None:
    tokens = list(range(40 * 16))
    values = np.array(tokens, dtype=np.int64)
    full = plain_chain(tokens, 16, "sha256")
    assert list(chain_hashes(tokens, 16, full[9], start=10, stop=30, values=values)) == full[10:30]
    assert list(chain_hashes(tokens, 16, none_hash("0"), stop=1, values=values)) == full[:1]


def test_extra_keys_and_salt_chain_the_plain_way() -> None:
    tokens = list(range(10 * 16))
    values = np.array(tokens, dtype=np.int64)
    lora = (("lora", "a", "/a"),)
    salted = (("lora", "a", "/a"), ("cache_salt", "s"))
    got = list(chain_hashes(tokens, 16, none_hash("0"), extra_keys=lora, first_extra_keys=salted))
    assert got == plain_chain(tokens, 16, "sha256", extra=lora, first=salted)
    salt_only = list(chain_hashes(tokens, 16, none_hash("0"), first_extra_keys=(("cache_salt", "s"),), values=values))
    assert salt_only == plain_chain(tokens, 16, "sha256", first=(("cache_salt", "s"),))
    assert salt_only[1:] != plain_chain(tokens, 16, "sha256")[1:]  # block 0 changed, so does the chain


def test_odd_tokens_hash_as_the_ints_they_stand_for() -> None:
    ints = [1, 0, 2**31, 5] * 8
    want = plain_chain(ints, 16, "sha256")
    assert list(chain_hashes([True, False, 2**31, 5] * 8, 16, none_hash("0"))) == want
    small = [1, 0, 7, 5] * 64  # inside the layout: bools anywhere still hash as 1 and 0
    laid = chain_hashes([True, False, 7, 5] * 64, 16, none_hash("0"), values=np.array(small, dtype=np.int64))
    assert list(laid) == plain_chain(small, 16, "sha256")
    assert list(chain_hashes([np.int64(t) for t in ints], 16, none_hash("0"))) == want
    with pytest.raises(TypeError):
        list(chain_hashes([1.5] * 16, 16, none_hash("0")))


def fast_chain(layout: blockbytes.Layout, tokens: list[int], block_size: int, parent: bytes) -> list[bytes]:
    """The chain with every block laid out by ``layout`` (chain_hashes hashes short runs plainly)."""
    run = layout.blocks(tokens, block_size)
    assert run is not None
    out = []
    for head, a, b in zip(run.heads, run.starts, run.ends, strict=True):
        parent = hashlib.sha256(head + parent + run.opening + run.codes[a:b] + run.closing).digest()
        out.append(parent)
    return out


def test_the_layouts_reproduce_hashes_real_vllm_published() -> None:
    runs = json.loads((Path(__file__).parents[1] / "golden" / "vllm_kv_events.json").read_text())["runs"]
    for run in runs:
        layout = blockbytes.PICKLE5 if run["hash_algo"] == "sha256" else blockbytes.CBOR
        size, root = run["block_size"], none_hash(run["none_hash_seed"], run["hash_algo"])
        published = {h for f in run["frames"] for e in f["decoded"][1] if e["type"] == "BlockStored" for h in e["block_hashes"]}
        requests = [r for r in run["requests"] if r.get("prompt_token_ids") and not r["cache_salt"]]
        assert requests
        for r in requests:
            hashes = fast_chain(layout, r["prompt_token_ids"] + r["output_token_ids"], size, root)
            assert hashes and {external_int(h) for h in hashes} <= published


def test_the_external_int_has_one_definition_in_two_forms() -> None:
    for i in range(50):
        digest = hashlib.sha256(bytes([i])).digest()
        assert unpack_external(digest)[0] == external_int(digest) == to_external(digest) == int.from_bytes(digest[24:], "big")
    assert external_int(b"\x01\x02") == 0x0102  # a short digest: all of it
