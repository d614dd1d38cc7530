"""The block pool: null block, LRU free queue, prefix-cache hits, eviction events."""

from __future__ import annotations

import pytest

from kvflow.hashing import BlockHash, to_external
from kvflow.protocol.kv_events import WireAllBlocksCleared as AllBlocksCleared
from kvflow.protocol.kv_events import WireBlockRemoved as BlockRemoved
from kvflow.protocol.kv_events import WireBlockStored as BlockStored
from kvflow.sim.kvcache import BlockPool, NoFreeBlocks, StoreInfo

INFO = StoreInfo(block_size=2)


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "big"))


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free == 4
    assert pool.free_order() == [1, 2, 3, 4]
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.usage == 1.0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


@pytest.mark.parametrize(
    ("cached", "expected_free_order"),
    [
        ([], [3, 2, 1, 4]),  # uncached blocks go to the front, tail block first
        ([1, 2, 3], [4, 3, 2, 1]),  # cached blocks go to the back (LRU), tail block first
        ([1, 2], [3, 4, 2, 1]),  # a request's uncached partial block is reused before anything cached
    ],
)
def test_freed_blocks_are_queued_like_vllm_free_blocks(cached: list[int], expected_free_order: list[int]) -> None:
    pool = BlockPool(5)
    ids = pool.allocate(3)
    assert ids == [1, 2, 3]
    pool.cache_blocks(cached, [h(i) for i in cached], list(range(2 * len(cached))), first_index=0, parent=None,
                      info=INFO)
    pool.free(ids)
    assert pool.free_order() == expected_free_order


def test_usage_counts_blocks_in_use_over_all_but_the_null_block() -> None:
    pool = BlockPool(5)
    pool.allocate(1)
    assert pool.usage == 0.25


def test_cached_blocks_stay_hits_after_free_until_evicted_in_lru_order() -> None:
    pool = BlockPool(4)  # blocks 1..3
    ids = pool.allocate(2)
    pool.cache_blocks(ids, [h(10), h(11)], [7, 7, 8, 8], first_index=0, parent=None, info=INFO)
    pool.free(ids)
    assert pool.longest_hit([h(10), h(11), h(12)]) == [1, 2]
    pool.take_events()
    # free queue is [3, 2, 1]: the never-used block first, then 2 (the request's tail) is evicted
    assert pool.allocate(2) == [3, 2]
    assert pool.longest_hit([h(10), h(11)]) == [1]
    assert pool.take_events() == [BlockRemoved(block_hashes=[to_external(h(11))], medium="GPU", group_idx=0)]


def test_touch_takes_a_hit_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(1)
    pool.cache_blocks(ids, [h(1)], [5, 6], first_index=0, parent=None, info=INFO)
    pool.free(ids)
    pool.touch([1])
    assert pool.free_order() == [2, 3]
    assert pool.blocks[1].ref_cnt == 1
    pool.free([1])
    assert pool.free_order() == [2, 3, 1]


def test_cache_blocks_emits_one_block_stored_with_vllm_fields() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6]
    pool.cache_blocks(ids[1:], [h(2), h(3)], tokens, first_index=1, parent=h(1), info=INFO)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=[to_external(h(2)), to_external(h(3))], parent_block_hash=to_external(h(1)),
            token_ids=[3, 4, 5, 6], block_size=2, lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
        )
    ]
    assert pool.blocks[2].token_ids == (3, 4)


def test_reset_clears_hashes_only_when_every_block_is_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(1)
    pool.cache_blocks(ids, [h(1)], [1, 2], first_index=0, parent=None, info=INFO)
    pool.take_events()
    assert pool.reset() is False
    pool.free(ids)
    assert pool.reset() is True
    assert pool.longest_hit([h(1)]) == []
    assert pool.take_events() == [AllBlocksCleared()]


def test_events_can_be_disabled() -> None:
    pool = BlockPool(4, enable_events=False)
    ids = pool.allocate(1)
    pool.cache_blocks(ids, [h(1)], [1, 2], first_index=0, parent=None, info=INFO)
    assert pool.take_events() == []
