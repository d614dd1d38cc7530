"""The KV buffer layout, descriptor indexing, block content and pull planning (pure, no NIXL)."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.protocol.kv_transfer import KvTransferParams
from kvflow.sim.nixl import layout as nixl_layout
from kvflow.sim.nixl.layout import (
    KVLayout,
    as_regions,
    block_digests,
    block_runs,
    descriptor_ids,
    descriptors,
    mismatched_blocks,
    region_bases,
    write_blocks,
)
from kvflow.sim.nixl.pulls import plan_pull


def test_a_real_model_shape_gives_vllm_block_sizes() -> None:
    layout = KVLayout.for_model("llama-3.1-8b", num_blocks=10)
    assert layout.num_regions == 64  # 32 layers, K and V apart
    assert layout.block_len == 8 * 128 * 2 * 16  # heads × dim × bf16 × tokens = 32 KiB
    assert layout.bytes_per_block == 2 * 1024 * 1024
    assert layout.total_bytes == 10 * 2 * 1024 * 1024


def test_the_test_default_is_small() -> None:
    assert KVLayout(num_blocks=4).bytes_per_block == 4 * 2 * 32 * 2 * 16  # 8 KiB


def test_block_len_must_hold_whole_digests() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        KVLayout(num_blocks=4, block_size=1, num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=2)


def test_descriptors_are_region_major_rows_of_addr_len_device() -> None:
    layout = KVLayout(num_blocks=3, num_layers=1)  # 2 regions × 3 blocks of 2 KiB
    rows = descriptors(region_bases(1000, layout), layout.block_len, layout.num_blocks)
    bl = layout.block_len
    assert rows.tolist() == [[1000 + i * bl, bl, 0] for i in range(6)]


def test_descriptor_ids_pick_a_block_in_every_region_like_vllm() -> None:
    ids = descriptor_ids(num_regions=3, num_blocks=10, block_ids=[4, 7])
    assert (ids.dtype, ids.tolist()) == (np.int32, [4, 7, 14, 17, 24, 27])


def test_descriptor_ids_refuse_to_overflow_nixls_int32_indices() -> None:
    with pytest.raises(ValueError, match="overflow"):
        descriptor_ids(num_regions=64, num_blocks=1 << 26, block_ids=[0])


@pytest.mark.parametrize(
    ("ids", "max_len", "runs"),
    [
        pytest.param([3, 4, 5, 9, 10, 2], 8, [(0, 3), (3, 5), (5, 6)], id="breaks-where-ids-jump"),
        pytest.param([0, 1, 2, 3, 4], 2, [(0, 2), (2, 4), (4, 5)], id="long-runs-split"),
        pytest.param([5, 4], 8, [(0, 1), (1, 2)], id="descending-is-not-a-run"),
        pytest.param([7], 1, [(0, 1)], id="one-block"),
    ],
)
def test_block_runs(ids: list[int], max_len: int, runs: list[tuple[int, int]]) -> None:
    assert block_runs(np.asarray(ids), max_len) == runs


def test_digests_depend_on_the_whole_prefix_and_cover_a_partial_last_block() -> None:
    a = block_digests(list(range(40)), block_size=16)
    b = block_digests([99, *range(1, 40)], block_size=16)
    assert len(a) == 3  # 16 + 16 + 8 tokens
    assert all(x != y for x, y in zip(a, b, strict=True))  # the first token changes every block
    assert block_digests(list(range(40)), 16, num_blocks=2) == a[:2]


def test_written_blocks_verify_and_a_changed_region_is_caught() -> None:
    layout = KVLayout(num_blocks=6)
    regions = as_regions(np.zeros(layout.total_bytes, np.uint8), layout)
    digests = block_digests(list(range(32)), 16)
    write_blocks(regions, [5, 2], digests)
    assert mismatched_blocks(regions, [5, 2], digests) == []
    assert mismatched_blocks(regions, [2, 5], digests) == [2, 5]  # swapped blocks
    regions[3, 2, 0, 0] ^= 1  # one word of the last region of block 2
    assert mismatched_blocks(regions, [5, 2], digests) == [2]


@pytest.mark.parametrize(
    ("region", "group", "word"),
    [
        pytest.param(0, 0, 0, id="first-word"),
        pytest.param(1, 17, 2, id="mid-block"),
        pytest.param(3, -1, 3, id="last-word"),
    ],
)
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 5 * 8192], ids=["one-chunk", "chunks-of-5-blocks"])
def test_every_word_of_a_run_of_blocks_is_checked(region: int, group: int, word: int, chunk_bytes: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_layout, "VERIFY_CHUNK_BYTES", chunk_bytes)
    layout = KVLayout(num_blocks=40)
    regions = as_regions(np.zeros(layout.total_bytes, np.uint8), layout)
    ids = [*range(3, 37), 1]  # a long run of 8 KiB blocks, and a stray
    digests = block_digests(list(range(16 * len(ids))), 16)
    write_blocks(regions, ids, digests)
    assert mismatched_blocks(regions, ids, digests) == []
    for block in (3, 20, 36, 1):
        regions[region, block, group, word] ^= 1 << 63
    assert mismatched_blocks(regions, ids, digests) == [3, 20, 36, 1]


def test_verification_wants_a_digest_per_block() -> None:
    layout = KVLayout(num_blocks=4)
    regions = as_regions(np.zeros(layout.total_bytes, np.uint8), layout)
    with pytest.raises(ValueError, match="2 blocks for 1 digests"):
        mismatched_blocks(regions, [0, 1], block_digests(list(range(16)), 16))
    assert mismatched_blocks(regions, [], []) == []


def test_every_region_of_a_block_holds_a_different_stamp() -> None:
    layout = KVLayout(num_blocks=2)
    regions = as_regions(np.zeros(layout.total_bytes, np.uint8), layout)
    write_blocks(regions, [1], block_digests([1, 2, 3], 16))
    assert len({regions[r, 1, 0].tobytes() for r in range(layout.num_regions)}) == layout.num_regions
    assert not regions[:, 0].any()  # block 0 untouched


PARAMS = {"remote_engine_id": "p0", "remote_host": "127.0.0.2", "remote_port": 20001,
          "remote_request_id": "r1", "remote_block_ids": [[10, 11, 12, 13]]}


@pytest.mark.parametrize(
    ("local", "prompt_tokens", "remote_ids", "first"),
    [
        pytest.param([1, 2, 3], 40, [10, 11, 12], 0, id="no-prefix-hit"),
        pytest.param([3], 40, [12], 2, id="two-blocks-cached-locally"),
        pytest.param([1, 2, 3], 48, [10, 11, 12], 0, id="prefill-kept-a-block-for-its-output-token"),
        pytest.param([], 32, [], 2, id="all-cached"),
    ],
)
def test_plan_pairs_local_blocks_with_the_same_prompt_positions(
        local: list[int], prompt_tokens: int, remote_ids: list[int], first: int) -> None:
    plan = plan_pull(KvTransferParams.from_wire(PARAMS), local, prompt_tokens, block_size=16)
    assert (plan.local_ids, plan.remote_ids, plan.first_block) == (local, remote_ids, first)
    assert (plan.engine_id, plan.host, plan.port, plan.remote_request_id) == ("p0", "127.0.0.2", 20001, "r1")


@pytest.mark.parametrize(
    ("params", "local", "prompt_tokens", "match"),
    [
        pytest.param({**PARAMS, "remote_host": None, "remote_port": None}, [1], 16, "lack remote_host, remote_port", id="no-port"),
        pytest.param({k: v for k, v in PARAMS.items() if k != "remote_request_id"}, [1], 16, "remote_request_id",
                     id="no-request-id"),
        pytest.param(PARAMS, [1, 2, 3, 4, 5], 80, "5 local and 4 remote", id="prompt-longer-than-remote"),
        pytest.param(PARAMS, [1, 2, 3], 16, "3 local", id="more-local-blocks-than-prompt"),
    ],
)
def test_plan_rejects_params_that_cannot_be_pulled(params: dict, local: list[int], prompt_tokens: int,
                                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_pull(KvTransferParams.from_wire(params), local, prompt_tokens, block_size=16)
