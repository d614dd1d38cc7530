"""Batches survive a SIGKILL of the whole stack, and replicas sharing a database never answer a
line twice: real processes (`kvflow up`, gateways, simulated pods) and real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from tests.conftest import SimPodFactory
from tests.pids import pids_with, wait_exited
from tests.waiting import eventually_blocking

MODEL = "sim-model"


def request_file(n: int, max_tokens: int) -> bytes:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"request number {i} " * (1 + i % 7), "max_tokens": max_tokens}}
             for i in range(n)]
    return "\n".join(json.dumps(line) for line in lines).encode()


def submit(url: str, data: bytes) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    file = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h").id


def batch_status(url: str, batch_id: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2).batches.retrieve(batch_id)


def wait_for(url: str, batch_id: str, done: Callable[[Any], bool], timeout: float = 120) -> Any:
    """The batch as ``url`` reports it, once ``done`` holds for it."""
    batch: Any = None

    def reported() -> Any:
        nonlocal batch
        batch = batch_status(url, batch_id)
        return batch if done(batch) else None

    return eventually_blocking(reported, timeout,
                               what=lambda: f"batch {batch_id}, still {batch.status} {batch.request_counts}")


def custom_ids(url: str, batch: Any) -> Counter[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    seen: Counter[str] = Counter()
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            seen.update(json.loads(line)["custom_id"] for line in client.files.content(file_id).text.splitlines())
    return seen


def scrape(url: str, prefix: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def start_up(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("kvflow is up"):
            return proc
    raise AssertionError(f"kvflow up did not start (exit {proc.wait()})")


def close_output(proc: subprocess.Popen[str]) -> None:
    """wait() leaves the pipe open, for the collector to warn about."""
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_batch_survives_sigkill_of_the_whole_stack_and_answers_each_line_once(tmp_path: Path) -> None:
    gw, pod_port = free_port(), free_port()
    url = f"http://127.0.0.1:{gw}"
    argv = [sys.executable, "-m", "kvflow", "up", "--decode", "2", "--gateway", f"127.0.0.1:{gw}",
            "--pod-port", str(pod_port), "--log-dir", str(tmp_path / "logs"), "--batch-dir", str(tmp_path / "b")]
    n = 600
    stack = start_up(argv)
    try:
        batch_id = submit(url, request_file(n, max_tokens=120))
        before = wait_for(url, batch_id, lambda b: b.request_counts.completed >= 100)
        # the whole stack at once, as a power cut would: kvflow up, the gateway and both pods
        victims = [stack.pid, *pids_with(f"--port {pod_port} "), *pids_with(f"--port {gw} ")]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        stack.wait(timeout=10)
        close_output(stack)
        wait_exited(victims[1:], 10)  # the stack itself is reaped
        assert not any(pids_with(marker) for marker in (f"--port {pod_port} ", f"--port {gw} "))
        assert before.status == "in_progress" and before.request_counts.completed < n

        stack = start_up(argv)  # the same command again
        resumed = batch_status(url, batch_id)
        assert resumed.request_counts.completed >= before.request_counts.completed - 64  # done lines were kept
        done = wait_for(url, batch_id, lambda b: b.status == "completed")
        seen = custom_ids(url, done)
    finally:
        if stack.poll() is None:
            stack.send_signal(signal.SIGTERM)
            stack.wait(timeout=30)
        close_output(stack)
    assert set(seen) == {f"line-{i}" for i in range(n)}
    assert max(seen.values()) == 1  # none answered twice
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)


def start_gateways(group: ProcessGroup, pods: list[Any], config: Path, count: int) -> list[str]:
    urls = []
    for i in range(count):
        port = free_port()
        group.start(f"gateway-{i}", kvflow_argv("gateway", "--config", str(config), "--port", str(port),
                                                "--model", MODEL, *[a for p in pods for a in ("--endpoint", p.id)]),
                    ready_url=f"http://127.0.0.1:{port}/health")
        urls.append(f"http://127.0.0.1:{port}")
    group.wait_ready(30)
    return urls


def test_two_replicas_share_one_database_and_run_each_line_once(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    pods = sim_pods(2, "--model", MODEL)
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"batch": {"dir": str(tmp_path / "b"), "poll_s": 0.1}}))
    n = 400
    with ProcessGroup(tmp_path / "gw") as group:
        first, second = start_gateways(group, pods, config, 2)
        batch_id = submit(first, request_file(n, max_tokens=64))
        done = wait_for(second, batch_id, lambda b: b.status == "completed")  # either replica answers for it
        served = [scrape(url, "kvflow_gateway_routed_total") for url in (first, second)]
        seen = custom_ids(first, done)
    assert set(seen) == {f"line-{i}" for i in range(n)} and max(seen.values()) == 1
    assert sum(served) == n and min(served) > 0  # both replicas ran lines, no line ran on both
    finished = sum(scrape(p.url, 'vllm:request_success_total{') for p in pods)
    assert finished == n  # and the pods computed each line once


def test_when_a_replica_dies_another_takes_over_its_lines_after_the_lease(sim_pods: SimPodFactory,
                                                                          tmp_path: Path) -> None:
    pods = sim_pods(2, "--model", MODEL)
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"batch": {"dir": str(tmp_path / "b"), "poll_s": 0.1, "lease_s": 2}}))
    n = 300
    with ProcessGroup(tmp_path / "gw") as group:
        first, second = start_gateways(group, pods, config, 2)
        batch_id = submit(first, request_file(n, max_tokens=96))
        wait_for(first, batch_id, lambda b: b.request_counts.completed >= 30)
        group.stop(group.children[0], sig=signal.SIGKILL)
        done = wait_for(second, batch_id, lambda b: b.status == "completed")
        seen = custom_ids(second, done)
    assert set(seen) == {f"line-{i}" for i in range(n)} and max(seen.values()) == 1
    assert done.request_counts.completed == n
