"""Block hashing follows vLLM's definition: chained, full blocks only, seeded NONE_HASH."""

import hashlib
import pickle

import cbor2
import pytest

from kvflow.hashing import hash_request_tokens, none_hash, to_external


def vllm_sha256(obj):
    # vLLM's ``sha256``: SHA-256 over the highest-protocol pickle of the object.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_first_block_chains_from_the_hash_of_the_seed_string():
    tokens = list(range(16))
    [first] = hash_request_tokens(tokens, 16, seed="42")
    assert none_hash("42") == vllm_sha256("42")
    assert first == vllm_sha256((vllm_sha256("42"), tuple(tokens), None))


def test_each_block_chains_from_its_parent():
    tokens = list(range(48))
    h = hash_request_tokens(tokens, 16, seed="0")
    assert len(h) == 3
    assert h[2] == vllm_sha256((h[1], tuple(range(32, 48)), None))


@pytest.mark.parametrize(
    ("n_tokens", "block_size", "blocks"),
    [(0, 16, 0), (15, 16, 0), (16, 16, 1), (31, 16, 1), (8192, 16, 512), (100, 32, 3)],
    ids=["empty", "partial", "one", "one-and-partial", "8k", "bs32"],
)
def test_only_full_blocks_are_hashed(n_tokens, block_size, blocks):
    assert len(hash_request_tokens(list(range(n_tokens)), block_size)) == blocks


def test_shared_prefixes_share_hashes_and_diverge_after():
    a = hash_request_tokens([1] * 32 + [2] * 16, 16)
    b = hash_request_tokens([1] * 32 + [3] * 16, 16)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_seed_extra_keys_and_algo_change_every_hash():
    tokens = list(range(32))
    base = hash_request_tokens(tokens, 16, seed="0")
    assert hash_request_tokens(tokens, 16, seed="1")[0] != base[0]
    assert hash_request_tokens(tokens, 16, extra_keys=("lora-a",))[0] != base[0]
    cbor = hash_request_tokens(tokens, 16, algo="sha256_cbor")
    root = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    assert cbor[0] == hashlib.sha256(cbor2.dumps((root, tuple(range(16)), None), canonical=True)).digest()


def test_unknown_algo_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown prefix-caching hash algo 'md5'"):
        hash_request_tokens([1] * 16, 16, algo="md5")


def test_external_form_is_the_last_eight_bytes_big_endian():
    h = hash_request_tokens(list(range(16)), 16)[0]
    assert to_external(h) == int.from_bytes(h[24:], "big")
    assert to_external(h, as_int=False) == h
