"""Per-pod load numbers: a row each on the datastore's ``LoadBoard``, written through the pod's
``LoadCounter``, read by a cycle as columns for many pods or row by row for a few, and the TTFT
estimate computed either way is the documented formula for every pod."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvflow.endpoints import Endpoint
from kvflow.router.datastore import Datastore
from kvflow.router.framework import Cycle
from kvflow.router.load import FIELDS, VECTOR_MIN, LoadBoard, LoadCounter
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
    assert counter.numbers().in_flight == 5.0 and counter.numbers().backlog == 12.5


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError, match="in_flihgt"):
        LoadCounter(in_flihgt=1)


def test_each_counter_writes_its_own_row_of_the_board_it_was_given_and_the_board_grows() -> None:
    board = LoadBoard(2)
    counters = [LoadCounter(i, board=board, backlog=i / 2) for i in range(5)]
    assert board.size == 8  # doubled twice
    assert len({c.base for c in counters}) == 5 and all(c.board is board for c in counters)
    assert [c.in_flight for c in counters] == list(range(5))
    assert [c.backlog for c in counters] == [i / 2 for i in range(5)]
    counters[1].tokens = 7
    assert [c.tokens for c in counters] == [0, 7, 0, 0, 0]


def test_a_snapshot_of_a_counters_numbers_does_not_move_with_it() -> None:
    counter = LoadCounter(1)
    before = counter.numbers()
    counter.in_flight += 1
    assert before.in_flight == 1.0 and counter.numbers().in_flight == 2.0


def test_the_datastore_owns_its_pods_rows_and_a_pod_that_leaves_takes_its_numbers_along() -> None:
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    store = Datastore([a, b])
    left = store.counter(a.id)
    assert left is not None and left.board is store.loads
    left.in_flight += 2  # requests in flight there
    row = left.base
    store.set_endpoints([b])
    assert left.board is not store.loads and left.in_flight == 2  # still counting, on a board of its own
    left.in_flight -= 1  # one of them ends after the pod left
    store.set_endpoints([b, Endpoint("10.0.0.3", 8000)])
    newcomer = store.counter(EndpointView(Endpoint("10.0.0.3", 8000)).id)
    assert newcomer is not None and newcomer.board is store.loads and newcomer.base == row  # its row
    assert newcomer.numbers() == LoadCounter().numbers()  # a row reused starts from the defaults
    left.in_flight -= 1
    assert left.in_flight == 0 and newcomer.in_flight == 0


def test_columns_are_the_candidates_numbers_in_their_order_and_a_subset_keeps_the_kept() -> None:
    board = LoadBoard()
    counters = [LoadCounter(i, board=board, tokens=10 * i, kv_base=0.1, kv_per_token=0.01) for i in range(5)]
    candidates = views(counters)[::-1]
    loads = board.columns(candidates)
    for name in FIELDS:
        assert getattr(loads.columns, name).tolist() == [getattr(ep.counter, name) for ep in candidates]
    counters[3].backlog = 9.5  # columns are read when asked for
    counters[3].in_flight += 1
    assert board.columns(candidates).columns.backlog.tolist() == [0.0, 9.5, 0.0, 0.0, 0.0]
    assert board.columns(candidates).columns.in_flight.tolist() == [4, 4, 2, 1, 0]
    keep = np.array([True, False, True, False, True])
    kept = [ep for ep, k in zip(candidates, keep) if k]
    subset = loads.subset(keep, kept)
    assert subset.endpoints is kept
    assert subset.columns.in_flight.tolist() == [4, 2, 0]
    assert subset.columns.backlog.tolist() == [0.0, 0.0, 0.0]
    # views whose counters are on other boards (made outside a datastore) read the same
    elsewhere = views([LoadCounter(i, tokens=10 * i, kv_base=0.1, kv_per_token=0.01) for i in range(5)])[::-1]
    assert board.columns(elsewhere).matrix.tolist() == board.columns(views(
        [LoadCounter(i, board=board, tokens=10 * i, kv_base=0.1, kv_per_token=0.01) for i in range(5)])[::-1]).matrix.tolist()


def test_a_filter_that_narrows_the_candidates_hands_the_scorers_their_loads() -> None:
    board = LoadBoard()
    full = LoadCounter(board=board, kv_base=1.0)  # its KV cache is full: the filter drops it for a sheddable request
    idle = [LoadCounter(i % 3, board=board) for i in range(VECTOR_MIN)]  # enough pods to be filtered on columns
    candidates = views([full, *idle])
    ctx = PluginContext(ApproxPrefixIndex(), PrefixIndex(), None, set(), 256)
    saturation = build("saturation", "saturation-filter", {}, ctx)[1]
    cycle = Cycle(SchedulingRequest("r", "m", [1] * 64, priority=-1), PrefixIndex().fingerprinter.prompt([1] * 64),
                  0, 16, board=board)
    kept = saturation.filter(cycle, candidates)
    assert [ep.counter for ep in kept] == idle
    assert cycle.loads(kept).columns.in_flight.tolist() == [i % 3 for i in range(VECTOR_MIN)]


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
@pytest.mark.parametrize("board", [True, False], ids=["one-board", "stand-alone"])
def test_the_estimate_pod_by_pod_or_on_whole_columns_is_the_formula_for_every_pod(pods: int, board: bool) -> None:
    rng = random.Random(pods)
    prompt = list(range(4096))
    precise = PrefixIndex()
    blocks = precise.fingerprinter.prompt(prompt).all()
    shared = LoadBoard() if board else None
    counters, held = [], []
    for i in range(pods):
        c = LoadCounter(default_rate=2000.0, board=shared)
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
                  now=1.5, board=shared)
    sent = sum(c.sent_requests for c in counters)
    mean_work = sum(c.sent_work for c in counters) / sent
    expected = [reference_estimate(c, prompt=len(prompt), cached=16 * n, best_cached=16 * max(held), now=1.5,
                                   rate=2000.0, mean_work=mean_work, step=256) for c, n in zip(counters, held)]
    assert any(c.foreign_waiting for c in counters) and any(c.room < math.inf for c in counters)
    estimates = scorer.estimates(cycle, candidates)
    assert isinstance(estimates, np.ndarray) is (pods >= VECTOR_MIN)
    assert list(estimates) == expected
