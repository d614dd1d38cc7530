"""Load counters kept column by column: each counter reads its own row, a cycle reads every
candidate's at once, and the TTFT estimate computed on whole columns is the documented formula
for every pod."""

from __future__ import annotations

import copy
import gc
import math
import random

import numpy as np
import pytest

from kvflow.endpoints import Endpoint
from kvflow.router.framework import Cycle
from kvflow.router.load import FIELDS, TABLE, VECTOR_MIN, LoadCounter, Loads, LoadTable
from kvflow.router.model import EndpointView, EngineMetrics, SchedulingRequest
from kvflow.router.plugins import PluginContext, build
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex


def views(counters: list[LoadCounter]) -> list[EndpointView]:
    return [EndpointView(Endpoint(f"10.1.{i // 250}.{i % 250 + 1}", 8000), counter=c) for i, c in enumerate(counters)]


def test_a_counter_starts_at_the_defaults_and_reads_back_what_it_was_given() -> None:
    counter = LoadCounter(2, prefilling=1, default_rate=500.0)
    assert (counter.in_flight, counter.prefilling, counter.default_rate) == (2, 1, 500.0)
    assert counter.backlog == 0.0 and counter.room == math.inf and counter.seconds_per_token == 0.0
    counter.in_flight += 3
    counter.backlog = 12.5
    assert counter.in_flight == 5 and type(counter.in_flight) is int  # integer fields read as ints
    assert counter.backlog == 12.5


def test_a_collected_counter_gives_its_row_back_and_a_row_handed_out_starts_from_the_defaults() -> None:
    counter = LoadCounter(7, backlog=3.0)
    row = counter.row
    del counter
    gc.collect()
    assert row in TABLE._free
    table = LoadTable([0.0, 5.0], size=2)
    first = table.allocate()
    table.matrix[:, first] = [1.0, 2.0]
    table.release(first)
    assert table.allocate() == first and table.matrix[:, first].tolist() == [0.0, 5.0]


def test_the_table_grows_and_keeps_every_counters_numbers() -> None:
    counters = [LoadCounter(i, backlog=i / 2) for i in range(3 * TABLE.size)]
    assert [c.in_flight for c in counters] == list(range(len(counters)))
    assert [c.backlog for c in counters] == [i / 2 for i in range(len(counters))]
    assert len({c.row for c in counters}) == len(counters)


def test_a_counter_is_not_copied_into_a_second_owner_of_its_row() -> None:
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(LoadCounter())


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError, match="in_flihgt"):
        LoadCounter(in_flihgt=1)  # type: ignore[call-arg]


def test_loads_are_the_candidates_counters_in_their_order_and_a_subset_keeps_the_kept() -> None:
    counters = [LoadCounter(i, tokens=10 * i, kv_base=0.1, kv_per_token=0.01) for i in range(5)]
    candidates = views(counters)[::-1]
    loads = Loads(candidates)
    for name in FIELDS:
        assert getattr(loads, name).tolist() == [getattr(ep.counter, name) for ep in candidates]
    counters[3].backlog = 9.5  # every write reaches the table
    counters[3].in_flight += 1
    assert Loads(candidates).backlog.tolist() == [0.0, 9.5, 0.0, 0.0, 0.0]
    assert Loads(candidates).in_flight.tolist() == [4, 4, 2, 1, 0]
    keep = np.array([True, False, True, False, True])
    kept = [ep for ep, k in zip(candidates, keep) if k]
    subset = loads.subset(keep, kept)
    assert subset.endpoints is kept
    assert subset.in_flight.tolist() == [4, 2, 0]
    assert subset.backlog.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(AttributeError):
        _ = loads.in_flihgt


def test_a_filter_that_narrows_the_candidates_hands_the_scorers_their_loads() -> None:
    full = LoadCounter(kv_base=1.0)  # its KV cache is full: the saturation filter drops it
    idle = [LoadCounter(i % 3) for i in range(VECTOR_MIN)]  # enough pods to be filtered on columns
    candidates = views([full, *idle])
    ctx = PluginContext(ApproxPrefixIndex(), PrefixIndex(), None, set(), 256)
    saturation = build("saturation", "saturation-filter", {}, ctx)[1]
    cycle = Cycle(SchedulingRequest("r", "m", [1] * 64), PrefixIndex().fingerprinter.prompt([1] * 64),
                  0, 16)
    kept = saturation.filter(cycle, candidates)
    assert [ep.counter for ep in kept] == idle
    assert cycle.loads(kept).in_flight.tolist() == [i % 3 for i in range(VECTOR_MIN)]


def reference_estimate(c: LoadCounter, *, prompt: int, cached: int, best_cached: int, now: float, rate: float,
                       mean_work: float, step: int, batch: int = 8192, copy_weight: float = 1.0,
                       evict_weight: float = 0.5, per_decode: float = 1.0) -> float:
    """The estimate as ``kvflow.router.plugins.ttft``'s docstring writes it, for one pod."""
    queued = max(0.0, min(c.backlog - (now - c.backlog_at) * rate, c.sent_work - c.done_work))
    uncached = prompt - cached
    work = queued + max(uncached, 1) + c.foreign_waiting * mean_work
    copied = copy_weight * (best_cached - cached) + evict_weight * min(max(uncached - c.room, 0.0), uncached)
    decoding = c.in_flight - c.prefilling + c.foreign_running
    return work + copied + (1 + work // batch) * (step + decoding * per_decode)


@pytest.mark.parametrize("pods", [5, VECTOR_MIN, 300])
def test_the_estimate_pod_by_pod_or_on_whole_columns_is_the_formula_for_every_pod(pods: int) -> None:
    rng = random.Random(pods)
    prompt = list(range(4096))
    precise = PrefixIndex()
    blocks = precise.fingerprinter.prompt(prompt).all()
    counters, held = [], []
    for i in range(pods):
        c = LoadCounter(default_rate=2000.0)
        for _ in range(rng.randrange(4)):
            c.enqueue(rng.randrange(1, 3000), now=rng.uniform(0.0, 1.0))
            c.in_flight += 1
            c.prefilling += rng.randrange(2)
        c.prefilled(rng.randrange(c.sent_work + 1))
        waiting = rng.randrange(2) * rng.randrange(3) if i else 2  # pod 0: other routers' requests wait,
        capacity = rng.choice([None, 300, 3000]) if i else 300  # and its cache is small
        c.observe(EngineMetrics(running=rng.randrange(3), waiting=waiting, kv_usage=rng.random() / 2,
                                num_blocks=capacity, block_size=16))
        c.touched(np.random.default_rng(i).integers(0, 2**64, size=rng.randrange(400), dtype=np.uint64), now=1.0)
        counters.append(c)
        held.append(rng.choice([0, 0, rng.randrange(len(blocks))]))
    candidates = views(counters)
    for ep, n in zip(candidates, held):
        precise.add(ep.id, blocks[:n])
    ctx = PluginContext(ApproxPrefixIndex(), precise, None, {ep.id for ep in candidates}, 256)
    scorer = build("ttft", "ttft-scorer", {}, ctx)[1]
    cycle = Cycle(SchedulingRequest("r", "m", prompt), precise.fingerprinter.prompt(prompt), 0, 16,
                  now=1.5)
    sent = sum(c.sent_requests for c in counters)
    mean_work = sum(c.sent_work for c in counters) / sent
    expected = [reference_estimate(c, prompt=len(prompt), cached=16 * n, best_cached=16 * max(held), now=1.5,
                                   rate=2000.0, mean_work=mean_work, step=256) for c, n in zip(counters, held)]
    assert any(c.foreign_waiting for c in counters) and any(c.room < math.inf for c in counters)
    estimates = scorer.estimates(cycle, candidates)
    assert isinstance(estimates, np.ndarray) is (pods >= VECTOR_MIN)
    assert list(estimates) == expected
