"""`kvflow up` starts the whole local stack with one command and stops all of it on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvflow.local.procs import free_port
from tests.pids import pids_with, wait_exited
from tests.waiting import eventually_blocking


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


class Stack:
    def __init__(self, proc: subprocess.Popen[str], url: str, pod_port: int) -> None:
        self.proc, self.url, self.pod_port = proc, url, pod_port


def start_stack(tmp_path: Path, *extra: str) -> Stack:
    gw, pod_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvflow", "up", "--gateway", f"127.0.0.1:{gw}", "--pod-port", str(pod_port),
            "--log-dir", str(tmp_path / "logs"), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    banner = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        banner.append(line)
        if line.startswith("kvflow is up") or time.monotonic() > deadline:
            break
    assert banner and banner[-1].startswith("kvflow is up"), "".join(banner)
    return Stack(proc, f"http://127.0.0.1:{gw}", pod_port)


def stop_stack(stack: Stack) -> None:
    try:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGTERM)
            try:
                stack.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(stack.proc.pid, signal.SIGKILL)
                raise
    finally:
        if stack.proc.stdout is not None:
            stack.proc.stdout.close()  # wait() leaves the pipe open, for the collector to warn about


@pytest.fixture
def aggregated(tmp_path: Path) -> Iterator[Stack]:
    stack = start_stack(tmp_path, "--decode", "2")
    try:
        yield stack
    finally:
        stop_stack(stack)


def test_stack_serves_completions_and_streams(aggregated: Stack):
    body = json.loads(post(f"{aggregated.url}/v1/completions", {"model": "sim-model", "prompt": "San Francisco is a", "max_tokens": 16}))
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"

    raw = post(f"{aggregated.url}/v1/chat/completions", {
        "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True},
    }).decode()
    events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 4

    models = json.loads(urllib.request.urlopen(f"{aggregated.url}/v1/models", timeout=10).read())
    assert [m["id"] for m in models["data"]] == ["sim-model"]


def test_sigterm_during_start_up_stops_what_has_started(tmp_path: Path):
    gw, pod_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvflow", "up", "--gateway", f"127.0.0.1:{gw}", "--pod-port", str(pod_port),
            "--log-dir", str(tmp_path / "logs"), "--decode", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = f"--port {pod_port}"
    try:
        eventually_blocking(lambda: pids_with(marker), timeout=60, what="a pod process to start")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wait_exited(pids_with(marker) + pids_with(f"127.0.0.1:{gw}"), 10)  # kvflow up is gone: none start now
    assert pids_with(marker) == [] and pids_with(f"127.0.0.1:{gw}") == []
    assert proc.returncode == 130  # interrupted, as Ctrl-C would, not killed by the signal


def test_sigterm_stops_every_child(tmp_path: Path):
    stack = start_stack(tmp_path, "--decode", "2")
    marker = f"--port {stack.pod_port}"
    assert len(pids_with(marker)) == 2  # two simulated pods on that port, one per loopback address
    stop_stack(stack)
    assert stack.proc.returncode == 0
    wait_exited(pids_with(marker) + pids_with(stack.url.rsplit(":", 1)[1]), 10)
    assert pids_with(marker) == [] and pids_with(stack.url.rsplit(":", 1)[1]) == []


def test_bad_arguments_are_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "kvflow", "up", "--decode", "0"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "kvflow up: --decode must be at least 1"


def scrape(url: str) -> dict[str, float]:
    """Unlabelled sums of a pod's Prometheus samples, by metric name."""
    totals: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def test_pd_stack_moves_kv_over_nixl(tmp_path: Path):
    pytest.importorskip("nixl._api", reason="nixl is not installed (make install adds it)")
    stack = start_stack(tmp_path, "--decode", "2", "--prefill", "1")
    try:
        long = "the quick brown fox jumps over the lazy dog " * 40  # ~370 tokens: over the P/D threshold
        for i in range(4):
            body = json.loads(post(f"{stack.url}/v1/completions", {"model": "sim-model", "prompt": f"{i}: {long}", "max_tokens": 8}))
            assert body["usage"]["completion_tokens"] == 8
        decode = [scrape(f"http://127.0.0.{host}:{stack.pod_port}/metrics") for host in (2, 3)]
        assert sum(m["vllm:nixl_xfer_time_seconds_count"] for m in decode) == 4
        assert sum(m["vllm:nixl_bytes_transferred_sum"] for m in decode) > 0
        assert sum(m["kvflow_sim:nixl_pull_fallbacks_total"] for m in decode) == 0
        gateway = scrape(f"{stack.url}/metrics")
        assert gateway["kvflow_gateway_routed_total"] == 4
    finally:
        stop_stack(stack)
