"""Tier-aware routing: which tier holds each pod's blocks, and what a CPU hit costs.

vLLM's OffloadingConnector announces its CPU pool with ``BlockStored``/``BlockRemoved`` events of
medium ``CPU`` that carry only vLLM's hashes (no tokens, no parent). The router keeps them apart
from the GPU index: a CPU removal leaves the GPU copy, a GPU removal leaves the CPU copy, the
tier continues a prefix past the GPU match, and the TTFT estimate prices the tokens it reloads
at ``reloadWork`` of a prefilled token: between a GPU hit and a miss.
"""

from __future__ import annotations

import msgspec
import pytest

from kvflow.endpoints import Endpoint
from kvflow.protocol.kv_events import (
    BlockRemoved,
    BlockStored,
    AllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    decode_runs,
    encode_batch,
)
from kvflow.router.framework import Cycle
from kvflow.router.kv_events import apply
from kvflow.router.model import EndpointView, EngineMetrics, LoadCounter, SchedulingRequest
from kvflow.router.plugins import PluginContext, build
from kvflow.router.plugins.prefix_cache import offloaded_matches
from kvflow.router.prefix_index import CpuTierIndex, PrefixIndex

A = "10.0.0.1:8000"
TOKENS = tuple(range(100, 164))  # 4 blocks of 16
HASHES = (11, 12, 13, 14)


def gpu_stored(n: int = 4) -> BlockStored:
    return BlockStored(HASHES[:n], None, 16, TOKENS[: 16 * n])


def cpu_stored(*hashes: int) -> BlockStored:
    return BlockStored(hashes, None, 16, (), medium="CPU")


def indexed() -> tuple[PrefixIndex, list[int]]:
    index = PrefixIndex()
    assert apply(index, A, [gpu_stored(), cpu_stored(*HASHES)]) == 0
    return index, index.fingerprinter.prompt(list(TOKENS)).all()


def test_the_decoder_keeps_each_events_medium_and_merges_removals_of_one_tier_only() -> None:
    payload = encode_batch([
        WireBlockRemoved(block_hashes=[1], medium="GPU"), WireBlockRemoved(block_hashes=[2], medium="GPU"),
        WireBlockRemoved(block_hashes=[3], medium="CPU"), WireBlockRemoved(block_hashes=[4], medium=None),
        WireBlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium="cpu", lora_name=None),
    ])
    events, counts = decode_runs(payload)
    assert events == [BlockRemoved((1, 2)), BlockRemoved((3,), "CPU"), BlockRemoved((4,)),
                      BlockStored((5,), None, 16, (), medium="CPU")]
    assert counts == {"BlockRemoved": 4, "BlockStored": 1}


def test_a_cpu_store_is_known_by_the_gpu_fingerprint_of_its_hash() -> None:
    index, fps = indexed()
    assert [index.cpu.holds(A, fp) for fp in fps] == [True] * 4
    assert index.cpu.blocks_of(A) == 4 and index.blocks_of(A) == 4


def test_a_gpu_eviction_leaves_the_cpu_copy_and_a_cpu_eviction_the_gpu_copy() -> None:
    index, fps = indexed()
    apply(index, A, [BlockRemoved((13, 14))])
    assert index.match(fps) == {A: 2}
    assert index.cpu.continued(fps, index.match(fps), [A]) == {A: 2}  # blocks 3 and 4 come back from CPU
    apply(index, A, [BlockRemoved((12,), "CPU")])
    assert index.match(fps) == {A: 2}  # the GPU still holds block 2
    assert index.cpu.continued(fps, {}, [A]) == {A: 1}  # from the first block: 1, then a gap


def test_a_cpu_store_of_a_block_the_gpu_never_reported_is_skipped() -> None:
    index = PrefixIndex()
    assert apply(index, A, [cpu_stored(99)]) == 1
    assert index.cpu.blocks_of(A) == 0


def test_clearing_a_pods_cache_clears_both_tiers() -> None:
    index, fps = indexed()
    apply(index, A, [AllBlocksCleared()])
    assert index.match(fps) == {} and index.cpu.blocks_of(A) == 0


def test_the_cpu_tier_is_capped_oldest_first() -> None:
    tier = CpuTierIndex(max_blocks=2)
    tier.store(A, [1, 2, 3], [11, 12, 13])
    assert [tier.holds(A, fp) for fp in (1, 2, 3)] == [False, True, True]
    assert tier.remove_hashes(A, [11, 12]) == [2]


# -- the TTFT estimate ---------------------------------------------------------------------

PROMPT = list(range(1000, 1512))  # 32 blocks of 16
STEP = 256


def estimates(gpu: dict[int, int], cpu: dict[int, int], *, reload_work: float | None = None,
              n: int = 3) -> dict[int, float]:
    """Per pod index: the estimate (tokens of work) for PROMPT with ``gpu[i]`` leading blocks on
    pod i's GPU and the next ``cpu[i]`` on its CPU tier, every pod idle."""
    eps = [Endpoint(f"127.0.0.{i + 2}", 8000) for i in range(n)]
    precise = PrefixIndex()
    fps = precise.fingerprinter.prompt(PROMPT).all()
    for i, blocks in gpu.items():
        precise.add(eps[i].id, fps[:blocks])
    for i, blocks in cpu.items():
        start = gpu.get(i, 0)
        precise.cpu.store(eps[i].id, fps[start:start + blocks], list(range(start, start + blocks)))
    ctx = PluginContext(None, precise, None, {ep.id for ep in eps}, STEP)  # type: ignore[arg-type]
    params = {"copyWeight": 0.0, "evictWeight": 0.0} | ({} if reload_work is None else {"reloadWork": reload_work})
    scorer = build("ttft", "ttft-scorer", params, ctx)[1]
    views = []
    for ep in eps:
        counter = LoadCounter(default_rate=1.0)
        metrics = EngineMetrics(num_blocks=None, block_size=16)
        counter.observe(metrics)
        views.append(EndpointView(ep, metrics, counter=counter))
    cycle = Cycle(SchedulingRequest("r", "m", PROMPT), precise.fingerprinter.prompt(PROMPT), 0, 16, now=0.0)
    assert offloaded_matches(cycle, ctx, views) == {eps[i].id: b for i, b in cpu.items() if b}
    return dict(enumerate(scorer.estimates(cycle, views)))


def test_a_cpu_hit_is_priced_at_its_reload_cost_between_a_gpu_hit_and_a_miss() -> None:
    est = estimates({0: 30}, {1: 30})
    reload = 0.066 * 30 * 16
    assert est == pytest.approx({0: 32 + STEP, 1: 32 + reload + STEP, 2: 512 + STEP})
    assert est[0] < est[1] < est[2]


def test_a_cpu_tier_continues_a_shorter_gpu_hit() -> None:
    est = estimates({0: 10}, {0: 20}, reload_work=0.5)
    assert est[0] == pytest.approx(32 + 0.5 * 20 * 16 + STEP)


@pytest.mark.parametrize(("reload_work", "equals"), [(0.0, "gpu"), (1.0, "miss")], ids=["free", "full-price"])
def test_reload_work_spans_a_gpu_hit_to_a_miss(reload_work: float, equals: str) -> None:
    est = estimates({0: 30}, {1: 30}, reload_work=reload_work)
    assert est[1] == pytest.approx(est[0] if equals == "gpu" else 512 + STEP)


def test_the_vector_path_prices_cpu_hits_as_the_scalar_one() -> None:
    small = estimates({0: 30}, {1: 30, 2: 5})
    big = estimates({0: 30}, {1: 30, 2: 5}, n=80)  # 64 pods or more: numpy columns
    assert [big[i] for i in range(3)] == pytest.approx([small[i] for i in range(3)])
    assert big[3] == pytest.approx(512 + STEP)


def test_an_unknown_medium_is_refused_only_when_malformed() -> None:
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 7}]])
    with pytest.raises(ValueError, match="medium"):
        decode_runs(payload)


# -- what a request the tier serves leaves in its pod's queue --------------------------------


def test_a_request_the_cpu_tier_serves_queues_only_the_tokens_its_pod_computes() -> None:
    # vLLM loads a CPU hit back beside the engine's steps (load_kv_async): the requests sent
    # after it wait behind the tokens it computes, not behind the ones it reloads
    from kvflow.router import Router, load_config

    home, other = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    router = Router(load_config({"kvEvents": {"enabled": False}}), [home, other], clock=lambda: 0.0)
    prompt = list(range(2000, 2520))  # 32 full blocks and 8 tokens
    hashes = tuple(range(1, 33))
    events = [BlockStored(hashes, None, 16, tuple(prompt[:512])), BlockStored(hashes, None, 16, (), medium="CPU"),
              BlockRemoved(hashes[10:])]  # the GPU keeps the first 10 blocks, the CPU tier all 32
    assert apply(router.precise, home.id, events, router.speculative) == 0
    router.event_sources.update({home.id, other.id})

    flight = router.decide(SchedulingRequest("r", "m", prompt))
    flight.send(flight.result.targets[0])

    assert flight.result.targets[0] == home
    assert flight.result.cached_tokens == 10 * 16  # the GPU hit: what vLLM counts as cached
    counter = router.datastore.counter(home.id)
    assert counter is not None and counter.sent_work == len(prompt) - 32 * 16  # computed: 8 tokens
    assert counter.queued(0.0) == 8
