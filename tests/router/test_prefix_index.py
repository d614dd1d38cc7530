"""Prefix indexes: longest contiguous cached prefix per endpoint, exact and approximate."""

from __future__ import annotations

import random

import pytest

from kvflow.hashing import hash_request_tokens, to_external
from kvflow.router.fingerprint import Fingerprinter, request_keys
from kvflow.protocol.kv_events import BlockStored
from kvflow.router.kv_events import apply
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex, longest_prefixes
from kvflow.endpoints import EndpointId

A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


@pytest.mark.parametrize(
    ("holders", "chain", "expected"),
    [
        ({}, [1, 2, 3], {}),
        ({1: {A}, 2: {A}, 3: {A}}, [1, 2, 3], {A: 3}),
        ({1: {A, B}, 2: {A}, 3: {A, B}}, [1, 2, 3], {A: 3, B: 1}),  # B's block 3 is not contiguous
        ({2: {A}}, [1, 2], {}),  # no first block, nothing usable
        ({1: {A, B, C}, 2: {B, C}, 3: {C}}, [1, 2, 3, 4], {A: 1, B: 2, C: 3}),
    ],
    ids=["empty", "full", "gap", "no-first-block", "staircase"],
)
def test_longest_prefixes(holders, chain, expected) -> None:  # type: ignore[no-untyped-def]
    asked: list[int] = []

    def lazy():  # type: ignore[no-untyped-def]
        for i, h in enumerate(chain):
            asked.append(i)
            yield h

    assert longest_prefixes({h: set(e) for h, e in holders.items()}, lazy()) == expected
    stop = max(expected.values(), default=0)
    assert max(asked, default=0) <= stop  # never hashes past the first block nobody holds


def test_precise_index_follows_events() -> None:
    index = PrefixIndex()
    index.add(A, [1, 2, 3])
    index.add(B, [1, 2])
    assert index.match([1, 2, 3]) == {A: 3, B: 2}
    index.remove(A, [2])
    assert index.match([1, 2, 3]) == {A: 1, B: 2}
    index.clear(B)
    assert index.match([1, 2, 3]) == {A: 1}
    assert len(index) == 2 and index.blocks_of(B) == 0


def test_approx_index_evicts_suffix_first() -> None:
    index = ApproxPrefixIndex(capacity_per_endpoint=4)
    index.add(A, [1, 2, 3])
    index.add(A, [7, 8, 9])  # capacity 4: the tail of the older request goes first
    assert index.match([1, 2, 3]) == {A: 1}
    assert index.match([7, 8, 9]) == {A: 3}
    index.set_capacity(A, 2)
    assert index.match([7, 8, 9]) == {A: 2}
    assert index.blocks_of(A) == 2


def test_prompts_sharing_a_prefix_share_its_fingerprints() -> None:
    f = Fingerprinter(16)
    tokens = list(range(100))
    expected = f.prompt(tokens).all()
    again = f.prompt(tokens[:64] + [999] * 36).all()
    assert again[:4] == expected[:4] and again[4] != expected[4]


def test_lora_changes_every_fingerprint() -> None:
    f = Fingerprinter(16)
    plain = f.prompt(list(range(32))).all()
    lora = f.prompt(list(range(32)), *request_keys("my-adapter", None)).all()
    assert not set(plain) & set(lora)


def flood(blocks: int) -> tuple[BlockStored, list[int]]:
    """One ``BlockStored`` of ``blocks`` blocks, and the fingerprints a router walks them with."""
    tokens = [i % 50_000 for i in range(16 * blocks)]
    hashes = tuple(to_external(h) for h in hash_request_tokens(tokens, 16))
    return BlockStored(hashes, None, 16, tuple(tokens)), tokens  # type: ignore[arg-type]


def test_a_pod_cannot_grow_the_precise_index_past_its_capacity() -> None:
    index = PrefixIndex(default_capacity=1000)  # until the pod's metrics report num_gpu_blocks
    event, tokens = flood(5000)
    apply(index, A, [event])  # a pod that floods, or lost its BlockRemoved
    keys = index.fingerprinter.prompt(tokens).all()
    assert index.blocks_of(A) == 1000 and index.match(keys[4000:]) == {A: 1000}
    index.set_capacity(A, 10)  # vllm:cache_config_info num_gpu_blocks: its oldest go
    assert index.blocks_of(A) == 10 and index.match(keys[4990:]) == {A: 10}
    assert len(index) == 10
    assert index.fingerprint_of(event.block_hashes[4989]) is None  # evicted blocks take their translation along
    assert index.fingerprint_of(event.block_hashes[4990]) == keys[4990]


def test_pods_together_cannot_grow_the_precise_index_past_its_cap() -> None:
    """Before their metrics tell their capacity, many pods could each store a million blocks:
    the index as a whole is capped too, and the pod that stores pays with its own oldest."""
    index = PrefixIndex(max_entries=1500)
    index.add(A, range(1, 1001))
    index.add(B, range(2001, 3001))
    assert (index.blocks_of(A), index.blocks_of(B)) == (1000, 500)
    assert index.match(range(1, 1001)) == {A: 1000} and index.match(range(2501, 3001)) == {B: 500}


def test_a_compact_index_weighs_tens_of_bytes_per_entry() -> None:
    index = PrefixIndex()
    rng = random.Random(0)
    for pod in range(20):
        index.add(EndpointId(f"10.0.0.{pod}:8000"), [rng.getrandbits(64) for _ in range(5000)])
    assert index.nbytes() / 100_000 < 64


def test_the_walk_stops_once_no_endpoint_still_matches() -> None:
    asked: list[int] = []

    def lazy():  # type: ignore[no-untyped-def]
        for i, h in enumerate([1, 2, 3, 4]):
            asked.append(i)
            yield h

    holders = {1: {A}, 2: {B}, 3: {B}, 4: {B}}  # B holds later blocks, but not the first
    assert longest_prefixes(holders, lazy()) == {A: 1} and asked == [0, 1]
    table = PrefixIndex()
    for h, eps in holders.items():
        for ep in eps:
            table.add(ep, [h])
    asked.clear()
    assert table.match(lazy()) == {A: 1} and asked == [0, 1]


def test_a_guess_carries_the_prefix_the_events_give_on_until_it_expires() -> None:
    from kvflow.router.prefix_index import SpeculativeIndex

    guess = SpeculativeIndex(ttl=2.0)
    chain = [11, 12, 13, 14, 15, 16]
    guess.add(A, chain[2:], now=0.0)  # sent to A, which was known to hold the first two blocks
    guess.add(B, chain[:3], now=1.0)  # sent to B, which held nothing
    matched = {A: 2, C: 4}  # what the events say: A's first two, C's first four
    guess.extend(matched, chain)
    assert matched == {A: 6, B: 3, C: 4}  # C has no guesses: its match stands
    guess.discard(A, chain[2:4])  # events spoke of A's blocks 3 and 4 (stored: the index has them now)
    matched = {A: 4}
    guess.extend(matched, chain)
    assert matched == {A: 6, B: 3}
    guess.expire(2.0)  # A's guess, made at 0, ends at 2; B's lasts until 3
    matched = {A: 4}
    guess.extend(matched, chain)
    assert matched == {A: 4, B: 3} and len(guess) == 3
    guess.expire(3.0)
    assert not guess and len(guess) == 0


def test_a_removal_ends_a_guess_only_once_its_request_is_prefilled() -> None:
    from kvflow.router.prefix_index import SpeculativeIndex

    guess = SpeculativeIndex(ttl=2.0)
    waiting = guess.add(A, [11, 12, 13], now=0.0)
    other = guess.add(A, [14], now=0.0)
    assert waiting is not None and other is not None
    guess.removed(A, [12, 13, 14])  # an older copy evicted: both requests still wait to compute theirs
    assert len(guess) == 4
    guess.prefilled(A, waiting)
    guess.removed(A, [12, 13, 14])  # now 12 and 13 are gone; 14's request still waits
    assert len(guess) == 2
    guess.discard(A, [14])  # a store event: the index knows it now
    guess.expire(2.0)  # the waiting guess ends with its time
    assert len(guess) == 0
    later = guess.add(A, [14], now=3.0)
    assert later is not None
    guess.prefilled(A, later)
    guess.removed(A, [14])  # the expired request no longer waits there: nothing keeps block 14
    assert len(guess) == 0


def test_a_guess_does_not_bridge_a_gap_in_what_the_pod_holds() -> None:
    from kvflow.router.prefix_index import SpeculativeIndex

    guess = SpeculativeIndex(ttl=2.0)
    guess.add(A, [13, 14], now=0.0)
    matched: dict[EndpointId, int] = {A: 1}  # A holds block 11 only: 12 is missing
    guess.extend(matched, [11, 12, 13, 14])
    assert matched == {A: 1}
