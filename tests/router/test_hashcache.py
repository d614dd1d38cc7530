"""A request's block hashes: vLLM's chain, memoised across requests, computed only as far as read."""

from __future__ import annotations

import random

import pytest

from kvflow.endpoints import EndpointId
from kvflow.errors import InvalidRequestError
from kvflow.hashing import hash_request_tokens, to_external
from kvflow.router.hashcache import BlockHashCache
from kvflow.router.prefix_index import PrefixIndex

A = EndpointId("a:1")


def vllm_chain(tokens: list[int], **kw: object) -> list[int]:
    return [int(to_external(h)) for h in hash_request_tokens(tokens, 16, **kw)]  # type: ignore[arg-type]


def test_a_prompt_over_a_million_tokens_hashes_like_any_other() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(128256) for _ in range((1 << 20) + 16 * 5 + 3)]
    hashes = BlockHashCache(16).for_request(tokens).all()
    assert len(hashes) == (1 << 16) + 5
    assert hashes == vllm_chain(tokens)


def test_a_walk_hashes_no_further_than_the_first_block_nobody_holds() -> None:
    tokens = list(range(16 * 5000))
    cache = BlockHashCache(16)
    index = PrefixIndex()
    index.add(A, vllm_chain(tokens[: 16 * 3]))
    assert index.match(cache.for_request(tokens)) == {A: 3}
    assert cache.misses == 4  # three held blocks and the first one nobody holds
    again = cache.for_request(tokens)
    assert index.match(again) == {A: 3} and (cache.misses, cache.hits) == (4, 4)  # the memo served them


def test_readers_of_one_chain_interleave_safely() -> None:
    tokens = list(range(16 * 40))
    hashes = BlockHashCache(16).for_request(tokens)
    first, second = iter(hashes), iter(hashes)
    got_first = [next(first) for _ in range(5)]
    got_second = [next(second) for _ in range(12)]
    got_first += list(first)
    assert got_first == vllm_chain(tokens) and got_second == vllm_chain(tokens)[:12]
    assert list(hashes.iter_from(30)) == vllm_chain(tokens)[30:]
    fresh = BlockHashCache(16).for_request(tokens)
    assert list(fresh.iter_from(30)) == vllm_chain(tokens)[30:]  # from past what was computed


def test_what_is_known_is_the_memoised_prefix() -> None:
    cache = BlockHashCache(16)
    shared = list(range(16 * 8))
    cache.for_request(shared).all()
    later = cache.for_request(shared + [7] * 16 * 4)
    assert later.known() == vllm_chain(shared)  # nothing hashed for it yet
    assert later.all() == vllm_chain(shared + [7] * 64)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_lora_and_cache_salt_key_the_memo_too(salt: str | None) -> None:
    tokens = list(range(16 * 6))
    lora = (("lora", "ad", "/ad"),)
    first = lora + ((("cache_salt", salt),) if salt else ())
    cache = BlockHashCache(16)
    plain = cache.for_request(tokens).all()
    keyed = cache.for_request(tokens, lora, first).all()
    assert keyed == vllm_chain(tokens, lora=("ad", "/ad"), cache_salt=salt)
    assert not set(plain) & set(keyed)
    assert cache.for_request(tokens, lora, first).all() == keyed  # memoised under its keys


def test_token_ids_that_are_not_integers_are_a_bad_request() -> None:
    with pytest.raises(InvalidRequestError, match="integers"):
        BlockHashCache(16).for_request([1.5] * 32).all()
