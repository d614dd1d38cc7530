"""The datastore: endpoints drop out when scrapes fail or go stale, and come back."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvflow.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router import Router, load_config
from kvflow.router.datastore import Datastore
from kvflow.router.model import EngineMetrics
from kvflow.endpoints import Endpoint

A, B = Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.3", 8000)


def healthy(ds: Datastore) -> dict[str, bool]:
    return {v.id: v.healthy for v in ds.snapshot()}


def test_health_transitions() -> None:
    ds = Datastore([A, B])
    assert healthy(ds) == {A.id: True, B.id: True}  # optimistic before the first scrape
    ds.record_failure(A.id)
    ds.record_scrape(B.id, EngineMetrics(running=2), now=10.0)
    assert healthy(ds) == {A.id: False, B.id: True}
    ds.expire(now=10.5, stale_after=1.0)
    assert healthy(ds)[B.id] is True
    ds.expire(now=11.5, stale_after=1.0)
    assert healthy(ds)[B.id] is False
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
    assert (ds.view(A.id).queue, ds.view(A.id).in_flight) == (2, 2)  # type: ignore[union-attr]
    ds.record_scrape(A.id, EngineMetrics(waiting=1), now=1.0)
    assert (ds.view(A.id).queue, ds.view(A.id).in_flight) == (1, 2)  # type: ignore[union-attr]


async def _until(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return False


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
            assert await _until(lambda: healthy(router.datastore) == {live.id: True, dead.id: False})
            view = router.datastore.view(live.id)
            assert view is not None and view.metrics.num_blocks is not None  # parsed from vllm:cache_config_info
            group.stop(sim)
            assert await _until(lambda: not healthy(router.datastore)[live.id])
            group.start("sim-again", argv, ready_url=f"http://{host}:{port}/health")
            await asyncio.to_thread(group.wait_ready, 30, [group.children[-1]])
            assert await _until(lambda: healthy(router.datastore)[live.id])
        finally:
            await router.stop()
