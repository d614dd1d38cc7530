"""`--workers 2`: two gateway processes share one port; stopping the supervisor stops both."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port

pytestmark = pytest.mark.slow


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_two_workers_share_the_port_and_stop_together(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (pod,) = sim_pods(1, "--model", "tiny", "--profile", "instant")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        gw = group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", "tiny",
                                                "--endpoint", pod.id, "--workers", "2"),
                         ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        workers = children_of(gw.popen.pid)
        assert len(workers) == 2
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        for _ in range(20):  # a new connection each time: the kernel spreads them over the workers
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as r:
                assert r.status == 200
        group.stop(gw)
        assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
                   for pid in workers)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
