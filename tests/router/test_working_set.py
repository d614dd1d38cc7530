"""A pod's working set: the distinct prompt tokens its requests touched lately, by hash sampling."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from kvflow.endpoints import Endpoint
from kvflow.local.procs import free_port
from kvflow.router import EngineMetrics, Router, SchedulingRequest, load_config
from kvflow.router.framework import Cycle
from kvflow.router.model import LoadCounter
from kvflow.router.peers import RELEASED, SENT, Message
from kvflow.router.plugins import PluginContext
from kvflow.router.plugins.prefix_cache import precise_matches
from kvflow.router.working_set import WorkingSet


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64)


def test_it_estimates_how_many_distinct_tokens_were_touched() -> None:
    ws = WorkingSet(block_size=16, window=10.0)
    assert ws.tokens == 0
    ws.touch(blocks(4000, seed=1), now=0.0)
    assert ws.tokens == pytest.approx(4000 * 16, rel=0.1)


def test_a_shared_prefix_counts_once_however_many_requests_touch_it() -> None:
    ws = WorkingSet(block_size=16, window=10.0)
    prefix = blocks(4000, seed=1)
    for i in range(10):
        ws.touch(np.concatenate([prefix, blocks(100, seed=100 + i)]), now=float(i))
    assert ws.tokens == pytest.approx(5000 * 16, rel=0.1)


def test_blocks_not_touched_within_the_window_leave_it() -> None:
    ws = WorkingSet(block_size=16, window=10.0)
    old, recent = blocks(2000, seed=1), blocks(2000, seed=2)
    ws.touch(old, now=0.0)
    ws.touch(recent, now=8.0)
    assert ws.tokens == pytest.approx(4000 * 16, rel=0.1)
    ws.expire(now=12.0)  # `old` is 12 s old
    assert ws.tokens == pytest.approx(2000 * 16, rel=0.1)
    ws.touch(recent, now=20.0)  # touching again keeps a block in
    ws.expire(now=25.0)
    assert ws.tokens == pytest.approx(2000 * 16, rel=0.1)
    ws.expire(now=31.0)
    assert ws.tokens == 0


def test_room_is_the_capacity_the_working_set_leaves() -> None:
    counter = LoadCounter(working_set=WorkingSet(block_size=16, window=10.0))
    counter.touched(blocks(600, seed=1), now=0.0)
    assert counter.room == math.inf  # capacity unknown: never full
    counter.observe(EngineMetrics(num_blocks=1000, block_size=16))
    counter.touched(blocks(600, seed=1), now=0.0)
    assert counter.room == 16_000 - counter.working_set.tokens
    assert counter.room == 400 * 16  # a small cache is sampled whole (fit), so the count is exact
    counter.scraped(EngineMetrics(num_blocks=1000, block_size=16), now=11.0)  # a scrape ages it out
    assert counter.room == 16_000


def test_the_router_counts_what_it_sends_to_a_pod_in_its_working_set() -> None:
    pods = [Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)]
    now = [0.0]
    router = Router(load_config({"kvEvents": {"enabled": False}, "workingSetSeconds": 5}), pods,
                    clock=lambda: now[0])
    for pod in pods:
        router.datastore.record_scrape(pod.id, EngineMetrics(num_blocks=10_000, block_size=16), 0.0)
    prompt = list(range(16 * 4000))
    flight = router.decide(SchedulingRequest("r", "m", prompt))
    flight.dispatch()
    result = flight.result
    sent, other = (router.datastore.counter(p.id) for p in (result.targets[0], result.targets[1]))
    assert sent is not None and other is not None
    # The blocks it sampled are exactly the prompt's under this router's (random) secret; how
    # near that sample comes to the prompt's length is the estimate's business, tested above.
    keys = router.fingerprinter.prompt(prompt).array
    bits = sent.working_set.sample_bits
    assert bits == 3  # 10,000 blocks: one in 8 gives 1,250 samples a cacheful
    sampled = int(np.count_nonzero((keys & np.uint64((1 << bits) - 1)) == 0))
    assert sent.working_set.tokens == sampled * (16 << bits)
    assert other.working_set.tokens == 0
    now[0] = 6.0
    router.datastore.record_scrape(result.targets[0].id, EngineMetrics(num_blocks=10_000, block_size=16), 6.0)
    assert sent.working_set.tokens == 0 and sent.room == 160_000


def test_a_prefix_survives_until_a_cacheful_of_other_blocks_is_touched_after_it() -> None:
    ws = WorkingSet(block_size=16, window=60.0)
    capacity = 1000 * 16
    prefix = blocks(200, seed=1)
    ws.touch(blocks(1500, seed=2), now=0.0)  # older than the prefix: they are evicted first
    ws.touch(prefix, now=1.0)
    ws.touch(blocks(500, seed=3), now=2.0)  # half a cacheful after it
    assert ws.tokens > capacity  # the pod is evicting...
    assert ws.surviving(prefix, capacity) == 200  # ...but not this prefix yet
    ws.touch(blocks(1000, seed=4), now=3.0)  # now a cacheful and a half
    assert ws.surviving(prefix, capacity) == 0  # a cacheful and a half after all of it: gone
    ws.touch(prefix, now=4.0)  # a request read it again: the most recently used
    assert ws.surviving(prefix, capacity) == 200


def test_a_prefix_at_the_edge_of_the_lru_order_loses_its_tail_first() -> None:
    # vLLM frees a request's blocks last block first, so the tail of a prefix is evicted first.
    ws = WorkingSet(block_size=16, window=60.0, sample_bits=0)
    capacity = 1000 * 16  # 999 blocks hold KV: vLLM's block 0 is its null block
    prefix = blocks(200, seed=1)
    ws.touch(prefix, now=1.0)
    ws.touch(blocks(700, seed=2), now=2.0)  # 700 blocks after it: 299 more fit, the whole prefix is held
    assert ws.surviving(prefix, capacity) == 200
    ws.touch(blocks(150, seed=3), now=3.0)  # 850 after it: the prefix's last 51 blocks are gone
    assert ws.surviving(prefix, capacity) == 149
    ws.touch(prefix[:40], now=4.0)  # a request read its first 40 blocks again: the top of the order
    assert ws.surviving(prefix, capacity) == 149  # blocks 40.. are as far down as they were
    ws.touch(blocks(100, seed=4), now=5.0)  # 990 after block 40: 9 of its run fit
    assert ws.surviving(prefix, capacity) == 49


def test_the_count_by_touch_time_follows_every_touch_and_expiry() -> None:
    # What places a block in the LRU order: for every touch time, the samples last touched then.
    ws = WorkingSet(block_size=16, window=5.0, sample_bits=1)
    rng = np.random.default_rng(3)
    prefixes = [blocks(300, seed=10 + i) for i in range(8)]
    now = 0.0
    for _ in range(300):
        now += float(rng.exponential(0.05))
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        ws.touch(np.concatenate([prefix[: int(rng.integers(1, 300))], blocks(20, seed=int(rng.integers(1 << 30)))]), now)
        touches = list(ws.last_touches().values())
        assert touches == sorted(touches)  # touch order is LRU order
        by_time: dict[float, int] = {}
        for t in touches:
            by_time[t] = by_time.get(t, 0) + 1
        assert ws.samples_by_time() == by_time and list(ws.samples_by_time()) == sorted(by_time)
        assert min(by_time) >= now - 5.0


def test_the_sample_is_as_fine_as_the_pods_capacity_calls_for() -> None:
    small, large = WorkingSet(block_size=16), WorkingSet(block_size=16)
    small.fit(2_400 * 16)  # the routing benchmark's pods: every other block
    large.fit(30_000 * 16)  # an 8B model on a GPU: one block in 16
    keys = blocks(8_000, seed=1)
    small.touch(keys, now=0.0)
    large.touch(keys, now=0.0)
    assert small.samples == pytest.approx(8_000 / 2, rel=0.05)
    assert large.samples == pytest.approx(8_000 / 16, rel=0.15)
    assert small.tokens == pytest.approx(large.tokens, rel=0.15)
    fixed = WorkingSet(block_size=16, sample_bits=3)
    fixed.fit(2_400 * 16)  # a rate given is kept
    fixed.touch(keys, now=0.0)
    assert fixed.samples == pytest.approx(8_000 / 8, rel=0.1)


def test_nothing_is_evicted_while_fewer_tokens_than_the_cache_holds_were_touched() -> None:
    ws = WorkingSet(block_size=16, window=60.0)
    prefix = blocks(200, seed=1)
    ws.touch(prefix, now=0.0)
    ws.touch(blocks(500, seed=2), now=1.0)
    assert ws.surviving(prefix, 1000 * 16) == 200


def sampled(n: int, seed: int) -> np.ndarray:
    """Blocks that are all in the pins' one-in-16 sample (their low four bits zero)."""
    return blocks(n, seed) & ~np.uint64(15)


def pinned_tokens(keys: np.ndarray) -> int:
    """The tokens of a pinned prefix the cut keeps: up to its last block in the one-in-16 sample."""
    return (int(np.flatnonzero((keys & np.uint64(15)) == 0)[-1]) + 1) * 16


def test_the_blocks_requests_in_flight_use_are_counted_from_the_first() -> None:
    ws = WorkingSet(block_size=16, window=60.0, sample_bits=0)
    prefix = sampled(200, seed=1)
    assert ws.in_use(prefix) == 0
    ws.pin(prefix[:120])  # a request using its first 120 blocks is in flight
    assert ws.in_use(prefix) == 120
    ws.pin(prefix)
    assert ws.in_use(prefix) == 200
    ws.unpin(prefix)  # one ended; the other still uses the first 120
    assert ws.in_use(prefix) == 120
    ws.unpin(prefix[:120])
    assert ws.in_use(prefix) == 0
    ws.pin(prefix[100:])  # blocks past a gap are not a prefix of it
    assert ws.in_use(prefix) == 0


def offloading_router(now: list[float]) -> tuple[Router, Endpoint, list[int], np.ndarray]:
    """A router, one pod that offloads to a CPU tier and reports 1,000 blocks, and a prompt of
    200 blocks the pod's KV events report on its GPU."""
    pod = Endpoint("127.0.0.2", 8000)
    router = Router(load_config({}), [pod], profile="prefix-precise", clock=lambda: now[0])
    router.datastore.record_scrape(pod.id, EngineMetrics(num_blocks=1000, block_size=16), 0.0)
    router.event_sources.add(pod.id)
    router.precise.cpu.store(pod.id, [1], [1])  # its tier holds some other block: it offloads
    prompt = list(range(16 * 200))
    keys = router.fingerprints(SchedulingRequest("p", "m", prompt)).array
    router.precise.add(pod.id, keys.tolist())
    return router, pod, prompt, keys


def test_on_an_offloading_pod_the_cut_keeps_a_prefix_its_requests_in_flight_use() -> None:
    # A pod with a full KV cache admits requests seconds after they were sent: the send order
    # (the LRU sample) runs ahead of it, and a prefix its running requests share is still held.
    now = [0.0]
    router, pod, prompt, keys = offloading_router(now)
    flight = router.decide(SchedulingRequest("a", "m", prompt))
    flight.send(pod)  # still in flight (queued or decoding) while other prompts are sent after it
    counter = router.datastore.counter(pod.id)
    assert counter is not None
    now[0] = 10.0  # past the speculative guess of where it was sent
    counter.touched(blocks(2000, seed=2), now=10.0)
    assert router.decide(SchedulingRequest("b", "m", prompt)).result.cached_tokens == pinned_tokens(keys)
    flight.finish()
    assert router.decide(SchedulingRequest("c", "m", prompt)).result.cached_tokens == 0


def test_on_a_pod_without_a_cpu_tier_the_lru_order_alone_decides() -> None:
    now = [0.0]
    router, pod, prompt, keys = offloading_router(now)
    router.precise.cpu.clear(pod.id)  # no tier: a wrong belief would cost a prefill, not a reload
    flight = router.decide(SchedulingRequest("a", "m", prompt))
    flight.send(pod)
    counter = router.datastore.counter(pod.id)
    assert counter is not None
    now[0] = 10.0
    counter.touched(blocks(2000, seed=2), now=10.0)
    assert router.decide(SchedulingRequest("b", "m", prompt)).result.cached_tokens == 0
    flight.finish()


def test_a_peer_replicas_request_in_flight_keeps_its_prefix_too() -> None:
    now = [0.0]
    router, pod, prompt, keys = offloading_router(now)
    router.heard(Message(b"replica2", SENT, 1, pod.id, keys.tolist(), False, work=3200, tokens=3200))
    now[0] = 10.0
    counter = router.datastore.counter(pod.id)
    assert counter is not None
    counter.touched(blocks(2000, seed=2), now=10.0)
    assert router.decide(SchedulingRequest("b", "m", prompt)).result.cached_tokens == pinned_tokens(keys)
    router.heard(Message(b"replica2", RELEASED, 1))
    assert router.decide(SchedulingRequest("c", "m", prompt)).result.cached_tokens == 0


def test_a_block_this_router_never_sent_is_left_as_the_pod_reports_it() -> None:
    # Another router replica may have sent it a moment ago: this one cannot place it in the LRU order.
    ws = WorkingSet(block_size=16, window=60.0)
    ws.touch(blocks(3000, seed=2), now=0.0)
    assert ws.surviving(blocks(200, seed=1), 1000 * 16) == 200


@pytest.mark.parametrize("predict", [True, False])
def test_the_router_counts_a_reported_prefix_as_evicted_once_a_cacheful_was_sent_after_it(predict: bool) -> None:
    pod = Endpoint("127.0.0.2", 8000)
    config = load_config({"kvEvents": {"predictEvictions": predict}})
    router = Router(config, [pod], profile="prefix-precise")
    router.datastore.record_scrape(pod.id, EngineMetrics(num_blocks=1000, block_size=16), 0.0)  # 16,000 tokens
    router.event_sources.add(pod.id)
    prompt = list(range(16 * 200))
    keys = router.fingerprints(SchedulingRequest("p", "m", prompt)).array
    router.precise.add(pod.id, keys.tolist())  # the pod's KV events report the whole prompt
    counter = router.datastore.counter(pod.id)
    assert counter is not None
    counter.touched(keys, now=0.0)  # the router sent it there
    assert router.decide(SchedulingRequest("a", "m", prompt)).result.cached_tokens == 3200
    counter.touched(blocks(900, seed=2), now=1.0)  # then 900 blocks of other prompts
    # no BlockRemoved yet: only the LRU order says the prompt's tail is gone (999 blocks hold KV)
    expected = 99 * 16 if predict else 3200
    assert router.decide(SchedulingRequest("b", "m", prompt)).result.cached_tokens == expected
    exposed = router.metrics.registry.render().splitlines()
    assert f'kvflow_router_evictions_predicted_total{{pool="default"}} {1 if predict else 0}.0' in exposed


def test_a_pd_decision_cuts_the_prefill_pods_matches_as_well_as_the_decode_pods() -> None:
    # The decision reads the decode pods' matches first, then, in the same cycle, the prefill pods'.
    decode, prefill = Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)
    router = Router(load_config({}), [decode, prefill])
    prompt = list(range(16 * 200))
    request = SchedulingRequest("p", "m", prompt)
    keys = router.fingerprints(request).array
    for pod in (decode, prefill):
        router.datastore.record_scrape(pod.id, EngineMetrics(num_blocks=1000, block_size=16), 0.0)
        router.event_sources.add(pod.id)
        router.precise.add(pod.id, keys.tolist())
        counter = router.datastore.counter(pod.id)
        assert counter is not None
        counter.touched(keys, now=0.0)
        counter.touched(blocks(900, seed=2), now=1.0)  # 900 blocks sent after the prompt: 99 of it fit
    ctx = PluginContext(router.approx, router.precise, router.speculative, router.event_sources)
    views = {view.id: view for view in router.datastore.snapshot()}
    cycle = Cycle(request, router.fingerprints(request), 0, 16, 1.0)
    assert precise_matches(cycle, ctx, [views[decode.id]])[decode.id] == 99
    found = precise_matches(cycle, ctx, [views[prefill.id]])
    assert found == {decode.id: 99, prefill.id: 99}
    assert cycle.data["prefix:evictions"] == 2
    assert precise_matches(cycle, ctx, [views[decode.id], views[prefill.id]]) == found  # read again: cut once
    assert cycle.data["prefix:evictions"] == 2


async def test_a_started_router_counts_a_send_once_the_request_is_on_its_way() -> None:
    # Sampling a long prompt into the working set costs ~0.1-0.2 ms: a router on an event loop
    # does it on the loop's next turn, after the caller has written the request to the pod.
    pod = Endpoint("127.0.0.2", free_port("127.0.0.2"))  # nothing listens: its scrapes fail, harmlessly
    router = Router(load_config({"kvEvents": {"enabled": False}}), [pod])
    await router.start()
    try:
        router.datastore.record_scrape(pod.id, EngineMetrics(num_blocks=10_000, block_size=16), 0.0)
        counter = router.datastore.counter(pod.id)
        assert counter is not None
        router.decide(SchedulingRequest("r", "m", list(range(16 * 400)))).dispatch()
        assert counter.in_flight == 1 and counter.working_set.tokens == 0
        await asyncio.sleep(0)
        assert counter.working_set.tokens > 0
    finally:
        await router.stop()
