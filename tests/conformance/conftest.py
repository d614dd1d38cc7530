"""Fixtures of the conformance suite: ``make_target(kind, ...)`` and a long-lived ``target``.

See targets.py for how each kind of server is started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvflow.local.procs import Child, ProcessGroup, free_port, http_ok

from .targets import KINDS, Endpoints, Target, TargetFactory, command


def wait_ready_polling(group: ProcessGroup, child: Child, sub: zmq.Socket, timeout: float) -> None:
    """Wait for /health while polling the SUB socket.

    libzmq hands a bound SUB's subscriptions to a newly connected PUB only when the SUB's owner
    thread next touches the socket; an idle SUB would make the publisher drop its first batches.
    """
    deadline = time.monotonic() + timeout
    while not http_ok(child.ready_url or ""):
        if not child.alive() or time.monotonic() > deadline:
            group.wait_ready(0.1, [child])  # raises StartupError with the log tail
        sub.poll(100)
    for _ in range(3):
        sub.poll(20)


def launch(group: ProcessGroup, kind: str, *, hash_algo: str = "sha256", hash_seed: str | None = "0",
           extra_args: tuple[str, ...] = ()) -> Target:
    """Start one server of ``kind`` in ``group`` with a fresh SUB socket bound for its events."""
    if hash_seed is None and "PYTHONHASHSEED" in os.environ:
        pytest.skip("PYTHONHASHSEED is set in this environment; cannot test the unset default")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events = f"tcp://127.0.0.1:{free_port()}"
    sub.bind(events)
    host = "127.0.0.2"  # not the events host: the server connects there, as vLLM does
    ep = Endpoints(host, free_port(host), events, f"tcp://127.0.0.1:{free_port()}")
    argv, env = command(kind, ep, hash_algo=hash_algo, hash_seed=hash_seed, extra_args=extra_args)
    child = group.start(f"{kind}-{ep.port}", argv, env=env, ready_url=f"http://{host}:{ep.port}/health")
    try:
        wait_ready_polling(group, child, sub, 30.0 if kind == "sim" else 900.0)
    except BaseException:
        sub.close(linger=0)
        raise
    seed = hash_seed if hash_seed is not None else "vllm-none-hash"
    return Target(kind, f"http://{host}:{ep.port}", seed, hash_algo, sub, ep.replay)


@pytest.fixture
def make_target(tmp_path: Path) -> Iterator[TargetFactory]:
    """Start fresh servers (empty cache, event sequence from 0), stopped when the test ends."""
    group = ProcessGroup(tmp_path / "conformance-logs")
    targets: list[Target] = []

    def make(kind: str, **kwargs: Any) -> Target:
        targets.append(launch(group, kind, **kwargs))
        return targets[-1]

    try:
        yield make
    finally:
        group.stop_all()
        for t in targets:
            t.sub.close(linger=0)


@pytest.fixture(scope="session", params=KINDS)
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One long-lived server per kind, for checks that do not need a fresh cache."""
    group = ProcessGroup(tmp_path_factory.mktemp(f"conformance-{request.param}"))
    try:
        t = launch(group, request.param)
        yield t
        t.sub.close(linger=0)
    finally:
        group.stop_all()
