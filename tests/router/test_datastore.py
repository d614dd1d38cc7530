"""The datastore: endpoints drop out when scrapes fail or go stale, and come back."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router import Router, load_config
from kvflow.router.datastore import Datastore
from kvflow.router.model import EngineMetrics, LoadCounter
from kvflow.endpoints import Endpoint
from tests.waiting import eventually

A, B = Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)


def healthy(ds: Datastore) -> dict[str, bool]:
    return {v.id: v.healthy for v in ds.snapshot()}


def test_health_transitions() -> None:
    ds = Datastore([A, B])
    assert healthy(ds) == {A.id: True, B.id: True}  # optimistic before the first scrape
    ds.record_failure(A.id)
    ds.record_scrape(B.id, EngineMetrics(running=2), now=10.0)
    assert healthy(ds) == {A.id: False, B.id: True}
    ds.record_scrape(B.id, EngineMetrics(running=2), now=99.0)  # however long since: time alone drops no one
    assert healthy(ds)[B.id] is True
    ds.record_scrape(A.id, EngineMetrics(), now=12.0)
    ds.mark_failed(A.id)
    assert healthy(ds)[A.id] is False
    ds.record_scrape(A.id, EngineMetrics(), now=12.1)
    assert healthy(ds)[A.id] is True


def test_set_endpoints_notifies_and_keeps_state() -> None:
    ds = Datastore([A])
    seen: list[tuple[str, bool]] = []
    ds.subscribe(lambda ep, added: seen.append((ep.id, added)))
    ds.started(A.id)
    ds.set_endpoints([A, B])
    ds.set_endpoints([B])
    assert seen == [(B.id, True), (A.id, False)]
    ds.set_endpoints([A])
    assert ds.view(A.id).in_flight == 0  # type: ignore[union-attr]  # a new pod at an old address starts fresh


def test_dispatched_since_scrape_resets_on_scrape() -> None:
    ds = Datastore([A])
    ds.started(A.id)
    ds.started(A.id)
    assert (ds.view(A.id).dispatched_since_scrape, ds.view(A.id).in_flight) == (2, 2)  # type: ignore[union-attr]
    ds.record_scrape(A.id, EngineMetrics(waiting=1), now=1.0)
    assert (ds.view(A.id).dispatched_since_scrape, ds.view(A.id).in_flight) == (0, 2)  # type: ignore[union-attr]


def test_own_load_is_live_and_other_routers_load_comes_from_scrapes() -> None:
    ds = Datastore([A])
    counter = ds.counter(A.id)
    assert counter is not None
    counter.in_flight, counter.prefilling = 2, 1  # this router: one prefilling, one decoding
    ds.record_scrape(A.id, EngineMetrics(running=4, waiting=3), now=1.0)
    view = ds.view(A.id)
    assert view is not None
    # the pod has 7; 2 are ours (1 of them waiting), so 2 other routers' wait and 3 run
    assert (view.foreign_waiting, view.foreign_running) == (2, 3)
    assert (view.queue, view.load, view.decoding) == (3, 7, 4)
    counter.in_flight, counter.prefilling = 5, 4  # we sent three more since the scrape
    assert (view.queue, view.load, view.decoding) == (6, 10, 4)


def test_kv_usage_moves_with_the_tokens_sent_since_the_scrape() -> None:
    ds = Datastore([A])
    counter = ds.counter(A.id)
    assert counter is not None
    counter.tokens = 100
    ds.record_scrape(A.id, EngineMetrics(kv_usage=0.25, block_size=16, num_blocks=100), now=1.0)
    view = ds.view(A.id)
    assert view is not None and view.kv_usage == 0.25
    counter.tokens += 800  # half the cache's 1,600 tokens
    assert view.kv_usage == 0.75
    counter.tokens += 8000
    assert view.kv_usage == 1.0


def test_prefill_queue_drains_at_the_pod_rate_and_ends_at_a_first_token() -> None:
    counter = LoadCounter(default_rate=1000.0)
    assert counter.enqueue(500, now=0.0) == (0.0, 500)
    assert counter.enqueue(300, now=0.1) == (400.0, 800)  # 100 tokens drained in 0.1 s
    assert counter.queued(0.3) == 500.0
    counter.prefilled(800)  # the second request's first token: nothing sent before it is left
    assert counter.queued(0.3) == 0.0
    counter.enqueue(200, now=1.0)
    counter.dequeue(200, now=1.0)  # that request failed before the pod computed anything
    assert counter.queued(1.0) == 0.0
    assert counter.mean_work == 1000 / 3


async def test_scraped_pod_drops_out_and_comes_back(tmp_path: Path) -> None:
    host = "127.0.0.90"
    port = free_port(host)
    argv = kvflow_argv("sim", "--host", host, "--port", str(port), "--profile", "instant")
    dead = Endpoint("127.0.0.91", free_port("127.0.0.91"))  # nothing listens there
    with ProcessGroup(tmp_path / "logs") as group:
        sim = group.start("sim", argv, ready_url=f"http://{host}:{port}/health")
        await asyncio.to_thread(group.wait_ready, 30)
        live = Endpoint(host, port)
        router = Router(load_config({"kvEvents": {"enabled": False}}), [live, dead])
        await router.start()
        try:
            def scraped() -> bool:
                view = router.datastore.view(live.id)
                return view is not None and view.metrics.num_blocks is not None  # from vllm:cache_config_info

            await eventually(lambda: healthy(router.datastore) == {live.id: True, dead.id: False} and scraped(),
                             what="the live pod scraped, the dead one out")
            group.stop(sim)
            await eventually(lambda: not healthy(router.datastore)[live.id], what="the stopped pod out")
            group.start("sim-again", argv, ready_url=f"http://{host}:{port}/health")
            await asyncio.to_thread(group.wait_ready, 30, [group.children[-1]])
            await eventually(lambda: healthy(router.datastore)[live.id], what="the restarted pod back")
        finally:
            await router.stop()
