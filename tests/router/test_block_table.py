"""BlockTable keeps the prefix indexes' entries in flat arrays; it must behave exactly like dicts of sets.

A few cases read the private slot table (``_Slots``) itself: its numpy and one-at-a-time
lookups, and a multiplier forced on it, have no public form to compare through."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvflow.endpoints import EndpointId
from kvflow.router import block_table
from kvflow.router.block_table import BlockTable
from kvflow.router.prefix_index import longest_prefixes

A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


class Model:
    """The specification: each endpoint's blocks, oldest first, in a plain list."""

    def __init__(self, refresh: bool, default_capacity: int | None = None) -> None:
        self.refresh = refresh
        self.default_capacity = default_capacity
        self.order: dict[EndpointId, list[int]] = {}
        self.capacity: dict[EndpointId, int] = {}

    def holders(self) -> dict[int, set[EndpointId]]:
        out: dict[int, set[EndpointId]] = {}
        for ep, hashes in self.order.items():
            for h in hashes:
                out.setdefault(h, set()).add(ep)
        return out

    def add(self, ep: EndpointId, hashes: list[int]) -> None:
        mine = self.order.setdefault(ep, [])
        for h in hashes:
            if h not in mine:
                mine.append(h)
            elif self.refresh:
                mine.remove(h)
                mine.append(h)
        self._evict(ep)

    def remove(self, ep: EndpointId, hashes: list[int]) -> None:
        mine = self.order.get(ep, [])
        for h in hashes:
            if h in mine:
                mine.remove(h)

    def set_capacity(self, ep: EndpointId, n: int) -> None:
        self.capacity[ep] = n
        self._evict(ep)

    def _evict(self, ep: EndpointId) -> None:
        limit = self.capacity.get(ep, self.default_capacity)
        mine = self.order.get(ep, [])
        while limit is not None and len(mine) > limit:
            mine.pop(0)


def assert_slots_hold_exactly_the_live_blocks(table: BlockTable, translation: dict[int, int] | None = None) -> None:
    """Every block someone holds is found by its key (and a translated block by its vLLM hash:
    ``translation``, hash -> key), and every slot in use names such a block, once: no deletion
    (a backward shift) broke a probe run."""
    live = set(table.holders)
    assert len(live) == len(table)
    assert all(table.holders_of(k) for k in live)
    keys, hash_slots = table.placement()
    named = [k for k in keys if k is not None]
    assert len(named) == len(table) and set(named) == live
    pairs = [pair for pair in hash_slots if pair is not None]
    assert len({h for h, _ in pairs}) == len(pairs) and {k for _, k in pairs} <= live
    assert dict(pairs) == (translation or {}) and all(table.translated(h) == k for h, k in pairs)


def lazily(chain: list[int], asked: list[int]) -> Iterator[int]:
    for i, h in enumerate(chain):
        asked.append(i)
        yield h


@pytest.mark.parametrize("refresh", [False, True], ids=["fifo", "lru"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vector_min", [block_table._VECTOR_MIN, 2], ids=["as-shipped", "arrays-from-2"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_every_operation_agrees_with_dicts_of_sets(refresh: bool, seed: int, vector_min: int, native: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_table, "_LOG_SLACK", 4)  # compact the age logs often
    # the array path (many keys looked up at once: kvflow._native, else numpy) on short chains too
    monkeypatch.setattr(block_table, "_VECTOR_MIN", vector_min)
    if not native:
        monkeypatch.setattr(block_table, "native", None)
    elif block_table.native is None:
        pytest.skip("kvflow._native is not built")
    rng = random.Random(seed)
    table, model = BlockTable(refresh=refresh), Model(refresh)
    endpoints = [EndpointId(f"10.0.0.{i}:8000") for i in range(6)]
    universe = [rng.getrandbits(64) for _ in range(1500)] + [0, 2**64 - 1]  # 1,500 blocks: the slots grow twice
    for step in range(2500):
        ep, roll = rng.choice(endpoints), rng.random()
        hashes = [rng.choice(universe) for _ in range(rng.randrange(1, 40))]
        if roll < 0.5:
            table.add(ep, hashes)
            model.add(ep, hashes)
        elif roll < 0.75:
            table.remove(ep, hashes)
            model.remove(ep, hashes)
        elif roll < 0.8:
            table.clear(ep)
            model.order[ep] = []
        elif roll < 0.85:
            n = rng.randrange(1, 300)
            table.set_capacity(ep, n)
            model.set_capacity(ep, n)
        else:
            held = model.order.get(rng.choice(endpoints), [])
            chain = held[: rng.randrange(len(held) + 1)] + [rng.choice(universe) for _ in range(3)]
            want = longest_prefixes(model.holders(), chain)
            asked: list[int] = []
            assert table.match(chain) == table.match(lazily(chain, asked)) == want
            assert max(asked, default=0) <= max(want.values(), default=0)  # never read past the first unheld block
        assert [table.blocks_of(e) for e in endpoints] == [len(model.order.get(e, [])) for e in endpoints]
        if step % 250 == 0:
            assert {e: table.oldest_first(e) for e in endpoints} == {e: model.order.get(e, []) for e in endpoints}
            assert dict(table.holders) == model.holders() and len(table) == len(model.holders())
            assert_slots_hold_exactly_the_live_blocks(table)
    assert table.entries() == sum(len(v) for v in model.order.values())


def test_a_pod_storing_a_block_again_keeps_its_age_in_the_precise_index() -> None:
    table = BlockTable(refresh=False)
    table.add(A, [1, 2, 3])
    table.add(A, [4])
    table.add(A, [1])  # stored again: still the oldest
    table.set_capacity(A, 2)
    assert table.oldest_first(A) == [3, 4]


def test_a_block_used_again_becomes_the_youngest_in_the_approximate_index() -> None:
    table = BlockTable(refresh=True)
    table.add(A, [1, 2, 3])
    table.add(A, [1])
    table.set_capacity(A, 2)
    assert table.oldest_first(A) == [3, 1]


def test_an_endpoint_never_holds_more_than_its_capacity() -> None:
    table = BlockTable(refresh=False, default_capacity=4)
    table.add(A, range(1, 11))  # one batch larger than the cap keeps its newest blocks
    assert table.oldest_first(A) == [7, 8, 9, 10]
    table.set_capacity(B, 2)  # set before B stored anything
    table.add(B, [7, 8, 20])
    assert table.oldest_first(B) == [8, 20]
    assert table.holders_of(7) == {A} and table.holders_of(8) == {A, B}
    table.set_capacity(A, 1)
    assert table.oldest_first(A) == [10] and len(table) == 3  # 10, 8, 20


def test_a_bad_hash_is_refused_before_anything_changes() -> None:
    table = BlockTable(refresh=False)
    table.add(A, [1, 2])
    for bad in (-1, 2**64, 1.0, "7", True, None):
        with pytest.raises(ValueError, match="not an unsigned 64-bit int"):
            table.add(A, [3, bad])
        with pytest.raises(ValueError):
            table.remove(A, [1, bad])
    assert table.oldest_first(A) == [1, 2]


def test_zero_and_the_largest_hash_are_ordinary_blocks() -> None:
    table = BlockTable(refresh=False)
    table.add(A, [0, 2**64 - 1])
    assert table.match([0, 2**64 - 1, 5]) == {A: 2}
    table.remove(A, [0])
    assert table.match([0]) == {} and dict(table.holders) == {2**64 - 1: {A}}


def test_pods_that_come_and_go_do_not_grow_the_table() -> None:
    table = BlockTable(refresh=False)
    for i in range(300):
        pod = EndpointId(f"pod-{i}:8000")
        table.add(pod, [i, i + 1])
        table.clear(pod)
    table.add(A, [5])
    assert table.entries() == 1 and table.nbytes() < 200_000


def test_hashes_a_pod_chooses_to_collide_do_not_pile_into_one_probe_run() -> None:
    table = BlockTable(refresh=False)
    table.add(A, [i << 40 for i in range(20_000)])  # equal in their low 40 bits
    assert table.longest_probe() < 64
    assert table.match([i << 40 for i in range(10)]) == {A: 10}


@pytest.mark.parametrize("translate", [False, True])
def test_a_multiplier_that_piles_keys_into_one_run_is_redrawn(translate: bool) -> None:
    table = BlockTable(refresh=False, translate=translate)
    index = table._vindex if translate else table._index
    index.mul = 1  # every key below 2**54 homes to slot 0 of 1,024
    keys = list(range(1, 301))
    table.add(A, [k << 20 for k in keys], keys if translate else None)
    assert index.mul != 1 and index.longest_probe() <= index.probe_bound() < 64
    assert table.match([k << 20 for k in keys]) == {A: 300}
    if translate:
        assert [table.translated(k) for k in keys] == [k << 20 for k in keys]
    assert_slots_hold_exactly_the_live_blocks(table, {k: k << 20 for k in keys} if translate else None)


@pytest.mark.parametrize("seed", range(3))
def test_vllm_hashes_translate_while_anyone_holds_the_block(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The precise index's translation: vLLM's hash -> the block's key, exactly while some
    endpoint holds the block, whatever mix of stores, removals by hash, clears and evictions."""
    monkeypatch.setattr(block_table, "_LOG_SLACK", 4)
    rng = random.Random(seed)
    table, model = BlockTable(refresh=False, translate=True), Model(refresh=False)
    endpoints = [EndpointId(f"10.0.0.{i}:8000") for i in range(5)]
    keys = [rng.getrandbits(64) for _ in range(1200)]  # 1,200 blocks: both slot tables grow
    vllm = {k: rng.getrandbits(64) for k in keys}
    for step in range(2000):
        ep, roll = rng.choice(endpoints), rng.random()
        chosen = [rng.choice(keys) for _ in range(rng.randrange(1, 30))]
        if roll < 0.55:
            table.add(ep, chosen, [vllm[k] for k in chosen])
            model.add(ep, chosen)
        elif roll < 0.85:
            held = model.holders()
            removed = table.remove_hashes(ep, [vllm[k] for k in chosen] + [rng.getrandbits(64)])
            assert removed == [k for k in chosen if k in held]  # the blocks anyone held: translated
            model.remove(ep, chosen)
        elif roll < 0.9:
            table.clear(ep)
            model.order[ep] = []
        else:
            n = rng.randrange(1, 200)
            table.set_capacity(ep, n)
            model.set_capacity(ep, n)
        if step % 50 == 0:
            held = model.holders()
            assert {k: table.translated(vllm[k]) for k in keys} == {k: k if k in held else None for k in keys}
            assert_slots_hold_exactly_the_live_blocks(table, {vllm[k]: k for k in held})
    assert table.longest_probe() < 64


def test_another_hash_for_a_block_is_an_alias_and_a_taken_hash_stays_with_its_block() -> None:
    table = BlockTable(refresh=False, translate=True)
    table.add(A, [1, 2], [101, 102])
    table.add(B, [1], [201])  # the same block as another pod hashes it (another seed)
    table.add(C, [3], [101])  # a hash that already names block 1: the first writer keeps it
    assert [table.translated(h) for h in (101, 102, 201)] == [1, 2, 1]
    assert table.remove_hashes(C, [101]) == [1] and table.holders_of(3) == {C}  # C did not hold 1
    table.clear(A)
    assert table.translated(201) == 1  # B still holds block 1
    table.clear(B)
    assert [table.translated(h) for h in (101, 102, 201)] == [None, None, None]
    table.add(C, [3], [101])  # free now: block 3 (stored without its hash before) takes it
    assert table.translated(101) == 3


def test_looking_up_many_keys_at_once_agrees_with_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk's numpy lookup reads a window of each probe run; longer runs go one by one."""
    import numpy as np

    monkeypatch.setattr(block_table, "_WINDOW_STEPS", np.arange(2))  # many runs longer than the window
    rng = random.Random(5)
    table = BlockTable(refresh=False)
    keys = [rng.getrandbits(64) for _ in range(1500)]
    table.add(A, keys)  # 1,500 keys in 4,096 slots: some probe runs are longer than the window
    table.add(B, [i << 40 for i in range(300)])  # and keys equal in their low bits
    asked = keys + [i << 40 for i in range(300)] + [rng.getrandbits(64) for _ in range(500)]
    index = table._index
    assert index.find_many(np.array(asked, np.uint64)).tolist() == [index.find(h) for h in asked]
    # the slot each key is in, or the free one its run ends at
    assert index.probe_many(np.array(asked, np.uint64)).tolist() == [index.probe(h) for h in asked]
    assert index.longest_probe() > 2  # the one-by-one path was taken too


@pytest.mark.parametrize("seed", range(3))
def test_a_store_probed_all_at_once_places_every_record_where_one_at_a_time_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store probes its keys before it places any (in C, or for many keys with numpy; else it
    starts from their homes); a key whose free slot a block of the same store took since (or a
    key stored twice) is probed again."""
    rng = random.Random(seed)
    universe = [rng.getrandbits(64) for _ in range(900)] + [i << 40 for i in range(100)]
    stores = [(rng.choice([A, B, C]), [rng.choice(universe) for _ in range(rng.randrange(1, 300))])
              for _ in range(60)]
    placed = []
    native = block_table.native
    for loops, vector_min in ((native, 64), (None, 2), (None, 10**9)):  # C, numpy, one at a time
        monkeypatch.setattr(block_table, "native", loops)
        monkeypatch.setattr(block_table, "_VECTOR_MIN", vector_min)
        monkeypatch.setattr(block_table.secrets, "randbits", random.Random(seed).getrandbits)  # the same multipliers
        table = BlockTable(refresh=True, translate=True)
        for ep, keys in stores:
            table.add(ep, keys, [k ^ 0x5A5A for k in keys])
            table.remove(ep, keys[: len(keys) // 4])
        placed.append(table.placement())
    assert placed[0] == placed[1] == placed[2]
