"""Two `kvflow operator run` replicas against the emulated cluster: one reconciles, the other
stands by; kill the leader and the standby takes over within 15 s; a graceful stop hands over
at once. Then the RBAC audit covers the election's calls too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Harness, eventually
from operator_rbac import audit_against_chart
from test_operator_lifecycle import LLMS, NAME, deployment, sample, status

from kvflow.local.procs import free_port

LEASE_NS = "kvflow-system"
LEASE = "kvflow"  # the chart passes its full name (release "kvflow"); its Role names that Lease
TAKEOVER_SECONDS = 15.0  # the promise; the Lease lasts 10 s and candidates retry every 2 s


class Replica:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, health_port: int) -> None:
        self.name, self.proc, self.health_port = name, proc, health_port

    def health(self) -> tuple[int, dict[str, Any]]:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except urllib.error.URLError:
            return 0, {}  # not listening (yet)


@contextlib.asynccontextmanager
async def replicas(h: Harness, logs: Path, *names: str) -> AsyncIterator[dict[str, Replica]]:
    started: dict[str, Replica] = {}
    try:
        for name in names:
            port = free_port()
            with (logs / f"{name}.log").open("wb") as log:  # the child writes to its own copy
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvflow.cli", "operator", "run", "--server", str(h.server.url).rstrip("/"),
                    "--interval", "0.5", "--liveness", f"http://127.0.0.1:{port}/healthz",
                    "--lease-namespace", LEASE_NS, "--lease-name", LEASE,
                    env={**os.environ, "POD_NAME": name}, stdout=asyncio.subprocess.DEVNULL, stderr=log)
            started[name] = Replica(name, proc, port)
        yield started
    finally:
        for replica in started.values():
            if replica.proc.returncode is None:
                replica.proc.kill()
            await replica.proc.wait()


def holder(h: Harness) -> str:
    lease = h.k8s.read("coordination.k8s.io/v1/leases", LEASE_NS, LEASE) or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def writers(h: Harness, since: int) -> set[str]:
    """Which replicas wrote anything but the Lease (their user agent carries their identity)."""
    return {e.user_agent.split("/", 1)[1].rsplit("-", 1)[0] for e in h.k8s.audit[since:]
            if e.user_agent.startswith("kvflow-operator/") and e.verb in ("create", "patch", "update", "delete")
            and e.resource != "leases"}


@pytest.mark.timeout(120)
async def test_one_replica_reconciles_and_the_other_takes_over(cluster: Harness, tmp_path: Path) -> None:
    h = cluster
    async with replicas(h, tmp_path, "op-a", "op-b") as ops:
        first = (await eventually(lambda: holder(h), what="a leader")).rsplit("-", 1)[0]
        second = "op-b" if first == "op-a" else "op-a"
        # The standby is alive (its liveness probe passes) but does not lead.
        await eventually(lambda: ops[second].health() == (200, {"state": "standby"}), what="a healthy standby")
        assert ops[first].health() == (200, {"state": "leading"})

        since = len(h.k8s.audit)
        await h.request("POST", LLMS, sample(h.engines.port), content_type="application/json")
        await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")
        assert writers(h, since) == {first}, "only the leader writes"

        # Kill the leader without a chance to hand over; change the spec meanwhile.
        ops[first].proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"decode": {"replicas": 3}}})
        await eventually(lambda: holder(h).startswith(second), timeout=TAKEOVER_SECONDS, what="the standby leads")
        took_over = time.monotonic() - killed
        await eventually(lambda: deployment(h, "decode")["spec"]["replicas"] == 3, what="the new leader reconciles")
        await eventually(lambda: status(h).get("phase") == "Ready" and status(h)["observedGeneration"] == 2,
                         what="Ready at generation 2")
        print(f"takeover after SIGKILL: {took_over:.1f} s")
        assert ops[second].health() == (200, {"state": "leading"})

        # A graceful stop hands the Lease back: a fresh standby takes over without waiting it out.
        async with replicas(h, tmp_path, "op-c") as more:
            await eventually(lambda: more["op-c"].health() == (200, {"state": "standby"}), what="op-c stands by")
            ops[second].proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(ops[second].proc.wait(), 30) == 0
            released = time.monotonic()
            await eventually(lambda: holder(h).startswith("op-c"), timeout=5, what="op-c leads at once")
            print(f"takeover after SIGTERM: {time.monotonic() - released:.1f} s")
            since = len(h.k8s.audit)
            await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"decode": {"replicas": 2}}})
            await eventually(lambda: deployment(h, "decode")["spec"]["replicas"] == 2, what="op-c reconciles")
            assert writers(h, since) == {"op-c"}

    lease = h.k8s.read("coordination.k8s.io/v1/leases", LEASE_NS, LEASE)
    assert lease is not None and lease["spec"]["leaseTransitions"] == 2
    calls = [e for e in h.k8s.audit if e.user_agent.startswith(("kvflow-operator", "kopf"))]
    audit_against_chart(calls, check_unused=False)
