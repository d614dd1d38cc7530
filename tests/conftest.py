"""Shared fixtures: simulated vLLM pods as real processes on 127.0.0.2, 127.0.0.3, ...

    def test_x(sim_pods):
        pods = sim_pods(2, "--profile", "instant", kv_events=True)
        pods[0].url             # http://127.0.0.2:PORT
        pods[0].kv_events       # tcp://127.0.0.2:PORT to connect a SUB socket to (or None)

Every pod is stopped when the test ends, pass or fail. The pods serve the simulator's admin
routes (``/_sim/faults``, ``/_sim/state``), which ``kvflow sim`` leaves off unless asked.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvflow.local.procs import Child, ProcessGroup, free_port, kvflow_argv


@dataclass
class SimPod:
    host: str
    port: int
    child: Child
    kv_events: str | None = None
    """Where a subscriber connects (the pod binds ``tcp://*:PORT``, as vLLM does for wildcards)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def id(self) -> str:
        return f"{self.host}:{self.port}"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return bytes(r.read())

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


SimPodFactory = Callable[..., list[SimPod]]


@pytest.fixture(autouse=True, scope="session")
def _batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Gateways started by tests keep Batch API state in a temporary directory, never in the
    checkout's .kvflow/batches (which may hold a user's own batches)."""
    previous = os.environ.get("KVFLOW_BATCH_DIR")
    os.environ["KVFLOW_BATCH_DIR"] = str(tmp_path_factory.mktemp("batches"))
    yield
    if previous is None:
        os.environ.pop("KVFLOW_BATCH_DIR", None)
    else:
        os.environ["KVFLOW_BATCH_DIR"] = previous


@pytest.fixture
def sim_pods(tmp_path: Path) -> Iterator[SimPodFactory]:
    group = ProcessGroup(tmp_path / "sim-logs")
    started = 0

    def start(n: int = 1, *args: str, kv_events: bool = False, env: dict[str, str] | None = None,
              first_host: int = 2, timeout: float = 30.0) -> list[SimPod]:
        nonlocal started
        pods: list[SimPod] = []
        for i in range(n):
            host = f"127.0.0.{first_host + started + i}"
            port = free_port(host)
            argv = ["sim", "--host", host, "--port", str(port), "--enable-admin-routes", *args]
            kv = None
            if kv_events:
                kv_port = free_port()
                argv += ["--kv-events-endpoint", f"tcp://*:{kv_port}", "--kv-events-topic", f"kv@{host}:{port}"]
                kv = f"tcp://{host}:{kv_port}"
            # PYTHONHASHSEED=0 as kvflow starts every vLLM, so routers' hashes agree by default
            child = group.start(f"sim-{host}-{port}", kvflow_argv(*argv), env={"PYTHONHASHSEED": "0", **(env or {})},
                                ready_url=f"http://{host}:{port}/health")
            pods.append(SimPod(host, port, child, kv))
        started += n
        group.wait_ready(timeout, [p.child for p in pods])
        return pods

    try:
        yield start
    finally:
        group.stop_all()


# -- no test module is skipped wholesale without a documented reason ------------------------------

WHOLESALE_SKIPS_ALLOWED = (
    "KVFLOW_REAL_VLLM",  # the real-vLLM suites (README: KVFLOW_REAL_VLLM=1 make test)
    "nixl is not installed",  # optional: make install adds it
    "helm unavailable",  # optional: fetched with npm by tests/operator/tools.sh
    "buildah",  # optional: the container-image test
    "apache-beam",  # optional extra kvflow[beam]
)
"""Reasons a whole test module may be skipped in a full ``make test``; any other fails the run."""

_module_outcomes: dict[str, list[tuple[str, str]]] = {}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and report.nodeid.endswith(".py"):
        _module_outcomes.setdefault(report.nodeid, []).append(("skipped", _skip_reason(report)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        module = report.nodeid.split("::", 1)[0]
        _module_outcomes.setdefault(module, []).append((report.outcome, _skip_reason(report)))


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr or "")


def wholesale_skips(outcomes: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    """Modules whose every test was skipped, with the reason, unless the reason is an allowed one."""
    bad = {}
    for module, results in outcomes.items():
        if results and all(outcome == "skipped" for outcome, _ in results):
            reason = results[0][1]
            if not any(allowed in reason for allowed in WHOLESALE_SKIPS_ALLOWED):
                bad[module] = reason
    return bad


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    full_run = not config.option.keyword and not config.option.markexpr and not getattr(config.option, "lf", False) \
        and [str(a) for a in config.args] in ([], [str(p) for p in config.getini("testpaths")])
    bad = wholesale_skips(_module_outcomes)
    if full_run and bad:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        for module, reason in bad.items():
            line = f"{module} was skipped wholesale ({reason}): fix the guard or document the reason in tests/conftest.py"
            if reporter is not None:
                reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
