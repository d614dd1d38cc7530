"""CPU KV offloading as vLLM 0.32's OffloadingConnector (native CPU backend) does it.

Pinned: which blocks are written to the CPU tier (every block a step fills, when it fills it),
which the CPU pool evicts (least recently used, a prompt's tail before its head), which a
request loads back (the blocks after its GPU hit, from the first, while the CPU holds them), what
that costs (the profile's PCIe bandwidth, charged to the step), and the events and counters
vLLM emits for it: ``BlockStored``/``BlockRemoved`` with medium ``CPU``, no parent, no tokens,
after the step's GPU events; external prefix-cache counters; ``prompt_tokens_cached_by_source``
``host``; ``vllm:cache_config_info``'s ``kv_offloading_size``.
"""

from __future__ import annotations

import hashlib

import pytest

from kvflow.hashing import BlockHash, to_external
from kvflow.protocol.kv_events import WireBlockRemoved, WireBlockStored
from kvflow.sim.cli import _metrics, num_cpu_blocks, parser
from kvflow.sim.kvcache import CpuTier
from kvflow.sim.profiles import get_profile
from kvflow.sim.request import Status
from kvflow.sim.scheduler import Scheduler

from .helpers import make_request, make_scheduler, run_until_idle

A = list(range(1, 11))  # 10 tokens: two full blocks of 4, then a partial one
B = list(range(21, 31))


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def ext(*names: str) -> list[int | bytes]:
    return [to_external(h(n)) for n in names]


def summary(events: list[object]) -> list[tuple[str, str | None, int]]:
    """(kind, medium, number of blocks) per event, in order."""
    out = []
    for e in events:
        assert isinstance(e, WireBlockStored | WireBlockRemoved)
        out.append((type(e).__name__.removeprefix("WireBlock"), e.medium, len(e.block_hashes)))
    return out


def offloading(**overrides: object) -> Scheduler:
    return make_scheduler(**{"num_blocks": 4, "num_cpu_blocks": 6, **overrides})


# -- the CPU pool --------------------------------------------------------------------------


def test_the_cpu_pool_evicts_the_least_recently_used_blocks_first() -> None:
    tier = CpuTier(num_blocks=3, block_size=4)
    assert tier.store([h("a"), h("b"), h("c")]) == [h("a"), h("b"), h("c")]
    tier.take_events()
    assert tier.store([h("d")]) == [h("d")]
    assert tier.lru_order() == [h("b"), h("c"), h("d")]
    assert tier.take_events() == [
        WireBlockRemoved(block_hashes=ext("a"), medium="CPU"),
        WireBlockStored(block_hashes=ext("d"), parent_block_hash=None, token_ids=[], block_size=4, lora_id=None,
                        medium="CPU", lora_name=None),
    ]


def test_a_touch_keeps_a_prompts_head_longest() -> None:
    tier = CpuTier(num_blocks=4, block_size=4)
    tier.store([h("x"), h("p1"), h("p2"), h("p3")])
    tier.touch([h("p1"), h("p2"), h("p3")])  # vLLM touches in reverse: p1 ends most recent
    assert tier.lru_order() == [h("x"), h("p3"), h("p2"), h("p1")]
    tier.store([h("y"), h("z")])
    assert tier.lru_order() == [h("p2"), h("p1"), h("y"), h("z")]


def test_blocks_already_held_are_not_written_again_and_a_batch_larger_than_the_pool_not_at_all() -> None:
    tier = CpuTier(num_blocks=2, block_size=4)
    assert tier.store([h("a")]) == [h("a")]
    assert tier.store([h("a"), h("b")]) == [h("b")]
    assert tier.stored_blocks == 2
    tier.take_events()
    assert tier.store([h("c"), h("d"), h("e")]) == []  # vLLM's prepare_store: None, nothing stored
    assert tier.take_events() == [] and tier.lru_order() == [h("a"), h("b")]


def test_lookup_counts_held_blocks_from_the_first() -> None:
    tier = CpuTier(num_blocks=4, block_size=4)
    tier.store([h("a"), h("b"), h("d")])
    assert tier.lookup([h("a"), h("b"), h("c"), h("d")]) == 2
    assert tier.lookup([h("c"), h("a")]) == 0


# -- the scheduler with a CPU tier -----------------------------------------------------------


def test_every_block_a_step_fills_is_written_to_the_cpu_tier_after_its_gpu_event() -> None:
    sched = offloading()
    sched.add(make_request("a", A, max_tokens=1))
    sched.schedule(0.0)
    gpu, cpu = sched.pool.take_events()
    assert isinstance(gpu, WireBlockStored) and gpu.medium == "GPU" and gpu.token_ids == A[:8]
    assert cpu == WireBlockStored(block_hashes=gpu.block_hashes, parent_block_hash=None, token_ids=[], block_size=4,
                                  lora_id=None, medium="CPU", lora_name=None)


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_cpu_instead_of_computed() -> None:
    sched = offloading()
    for rid, prompt in (("a", A), ("b", B)):  # b's blocks evict a's from the 3-block GPU pool
        sched.add(make_request(rid, prompt, max_tokens=1))
        run_until_idle(sched)
    events = sched.pool.take_events()
    assert ("Removed", "GPU", 1) in summary(events)  # a's blocks left the GPU ...
    assert not any(isinstance(e, WireBlockRemoved) and e.medium == "CPU" for e in events)  # ... not the CPU
    again = make_request("again", A, max_tokens=1)
    sched.add(again)
    plan = sched.schedule(10.0)
    assert plan.scheduled == [(again, 2)] and plan.reload_tokens == 8 and plan.prefill_tokens == 2
    assert (again.cached_tokens, again.offloaded_tokens) == (8, 8)
    stats = sched.prefix_stats
    assert (stats.queries, stats.hits, stats.external_queries, stats.external_hits) == (30, 0, 30, 8)
    # the loaded blocks enter the GPU prefix cache again (GPU events); the CPU already holds them
    assert summary(sched.pool.take_events()) == [("Removed", "GPU", 1), ("Removed", "GPU", 1), ("Stored", "GPU", 2)]


def test_a_load_from_the_cpu_runs_beside_the_other_requests_and_its_request_waits_for_it() -> None:
    """vLLM's asynchronous load: the request waits in WAITING_FOR_REMOTE_KVS for its blocks,
    takes none of the step's budget, and is scheduled as a cache hit once they are back; its
    blocks enter the GPU cache then, not before."""
    sched = offloading(num_blocks=8, num_cpu_blocks=10, reload_seconds_per_token=0.5)
    for rid, prompt in (("a", A), ("b", B), ("c", list(range(41, 51))), ("d", list(range(61, 71)))):
        sched.add(make_request(rid, prompt, max_tokens=1))  # 4 x 3 blocks through a 7-block pool
        run_until_idle(sched)
    sched.pool.take_events()
    again, other = make_request("again", A, max_tokens=1), make_request("other", list(range(81, 85)), max_tokens=1)
    sched.add(again)
    sched.add(other)
    plan = sched.schedule(10.0)
    assert plan.scheduled == [(other, 4)] and plan.loads_started == 8 and plan.reload_tokens == 0
    assert again.status is Status.WAITING_FOR_REMOTE_KVS and sched.next_ready() == 10.0 + 8 * 0.5
    assert sched.num_waiting == 1 and sched.has_work()
    assert not any(e.medium == "GPU" and isinstance(e, WireBlockStored) and e.token_ids[:8] == A[:8]
                   for e in sched.pool.take_events())  # type: ignore[attr-defined]
    sched.complete(plan, 11.0)
    assert sched.schedule(13.9).scheduled == []
    plan = sched.schedule(14.0)
    assert plan.scheduled == [(again, 2)] and plan.prefill_tokens == 2 and sched.next_ready() is None
    stored = [e for e in sched.pool.take_events() if isinstance(e, WireBlockStored) and e.medium == "GPU"]
    assert [e.token_ids for e in stored] == [A[:8]]
    assert (again.cached_tokens, again.offloaded_tokens) == (8, 8)


def test_an_abort_during_a_load_frees_its_blocks() -> None:
    sched = offloading(reload_seconds_per_token=0.5)
    for rid, prompt in (("a", A), ("b", B)):
        sched.add(make_request(rid, prompt, max_tokens=1))
        run_until_idle(sched)
    free = sched.pool.num_free
    sched.add(make_request("again", A, max_tokens=1))
    sched.schedule(10.0)
    assert sched.pool.num_free == free - 2
    assert sched.abort("again", 11.0) is not None
    assert (sched.pool.num_free, sched.next_ready(), sched.has_work()) == (free, None, False)


def test_a_cpu_hit_continues_a_shorter_gpu_hit() -> None:
    sched = offloading(num_blocks=6, num_cpu_blocks=8)
    sched.add(make_request("long", [*A[:8], 40, 41, 42, 43, 44], max_tokens=1))  # 3 full blocks
    run_until_idle(sched)
    sched.add(make_request("short", A[:5], max_tokens=1))  # touches block 1 on the GPU
    run_until_idle(sched)
    sched.add(make_request("filler", list(range(60, 73)), max_tokens=1))  # evicts blocks 3, 2 of "long"
    run_until_idle(sched)
    again = make_request("again", [*A[:8], 40, 41, 42, 43, 44], max_tokens=1)
    sched.add(again)
    plan = sched.schedule(10.0)
    assert (again.cached_tokens, again.offloaded_tokens, plan.reload_tokens) == (12, 8, 8)
    assert plan.scheduled == [(again, 1)]


def test_a_request_that_cannot_be_admitted_leaves_no_reload_and_no_counts() -> None:
    sched = offloading()
    sched.add(make_request("a", A, max_tokens=1))
    run_until_idle(sched)
    sched.add(make_request("b", B, max_tokens=1))
    run_until_idle(sched)
    blocker = make_request("blocker", list(range(50, 60)), max_tokens=5)
    sched.add(blocker)
    sched.schedule(20.0)  # holds all three GPU blocks
    before = (sched.prefix_stats.queries, sched.prefix_stats.external_queries, sched.prefix_stats.external_hits)
    again = make_request("again", A, max_tokens=1)
    sched.add(again)
    plan = sched.schedule(21.0)
    assert plan.reload_tokens == 0 and all(r is not again for r, _ in plan.scheduled)
    assert (again.num_computed, again.reloading) == (0, 0)
    assert before == (sched.prefix_stats.queries, sched.prefix_stats.external_queries,
                      sched.prefix_stats.external_hits)


def test_without_offloading_no_cpu_event_is_emitted() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", A, max_tokens=1))
    run_until_idle(sched)
    assert all(e.medium == "GPU" for e in sched.pool.take_events())  # type: ignore[attr-defined]


# -- sizes, timing, metrics ------------------------------------------------------------------


def test_the_offloading_size_is_vllms_cpu_bytes_to_use_in_blocks() -> None:
    per_block = 16 * 131072  # h100-llama8b: 2 MiB a 16-token block
    assert num_cpu_blocks(8, 16, 131072) == 8 * (1 << 30) // per_block == 4096
    assert num_cpu_blocks(None, 16, 131072) == 0
    with pytest.raises(ValueError, match="must be a number of GiB > 0"):
        num_cpu_blocks(0, 16, 131072)
    with pytest.raises(ValueError, match="holds no 16-token block"):
        num_cpu_blocks(0.001, 16, 131072)


def test_a_reload_costs_its_bytes_over_the_profiles_pcie_bandwidth() -> None:
    p = get_profile("h100-llama8b")
    assert p.reload_seconds(1000) == pytest.approx(1000 * 131072 / 50e9)
    assert p.step_seconds(0, 0, 10, 1000) == pytest.approx(p.step_seconds(0, 0, 10) + p.reload_seconds(1000))
    # a CPU hit is priced between a GPU hit (free) and a miss (prefill)
    assert 0 < p.reload_seconds(1000) < 1000 * p.prefill_per_token_s


def test_metrics_say_what_vllm_says_about_the_cpu_tier() -> None:
    args = parser().parse_args(["--kv-offloading-size", "8", "--kv-offloading-backend", "native"])
    metrics = _metrics(args, "m", 100, lora=False, offload_bytes=(131072, 50e9))
    sched = offloading()
    for rid, prompt in (("a", A), ("b", B), ("again", A)):
        req = make_request(rid, prompt, max_tokens=1)
        sched.add(req)
        plan = sched.schedule(0.0)
        if plan.reload_tokens:
            metrics.on_offload_load(plan.reload_tokens, 0.001)
        sched.complete(plan, 1.0)
        metrics.on_first_token(req)
    text = metrics.registry.render()
    assert 'kv_offloading_size="8.0"' in text and 'kv_offloading_backend="native"' in text
    assert 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 8.0' in text
    assert 'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 8.0' in text
    assert ('vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} '
            "1.048576e+06") in text
