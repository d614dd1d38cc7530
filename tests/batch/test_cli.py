"""`kvflow batch submit|status|results|cancel` against a real gateway process, and its progress line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.batchcli import Sample, endpoint_of, progress_line, summary
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from tests.conftest import SimPodFactory

MODEL = "sim-model"


def batch(status: str, total: int, completed: int, failed: int) -> dict[str, object]:
    return {"id": "batch_1", "status": status, "output_file_id": "file-o", "error_file_id": None,
            "request_counts": {"total": total, "completed": completed, "failed": failed}}


def test_the_progress_line_shows_done_failed_rate_and_eta() -> None:
    line = progress_line(batch("in_progress", 1000, 590, 10), Sample(100.0, 100), Sample(110.0, 600), width=10)
    assert line == "[######----] 600/1000 done 590 failed 10 50.0/s ETA 0:08 in_progress"
    assert progress_line(batch("validating", 0, 0, 0), Sample(0, 0), Sample(0, 0), width=4) == \
        "[----] 0/0 done 0 failed 0 0.0/s ETA - validating"
    long = progress_line(batch("in_progress", 1_000_000, 1000, 0), Sample(0, 0), Sample(10, 1000), width=4)
    assert "ETA 2:46:30" in long


def test_summary_names_the_files() -> None:
    assert summary(batch("completed", 3, 2, 1)) == \
        "batch_1 completed: 2 completed, 1 failed of 3 (output file-o, errors -)"


def test_the_endpoint_comes_from_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('\n{"custom_id": "a", "url": "/v1/chat/completions"}\n')
    assert endpoint_of(path) == "/v1/chat/completions"


@pytest.fixture
def gateway(sim_pods: SimPodFactory, tmp_path: Path) -> Iterator[str]:
    (pod,) = sim_pods(1, "--model", MODEL, "--profile", "instant")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", MODEL, "--endpoint", pod.id,
                                           "--batch-dir", str(tmp_path / "b")),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        yield f"http://127.0.0.1:{port}"


def kvflow_batch(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow", "batch", "--url", url, *args], capture_output=True,
                          text=True, timeout=120)


def test_submit_wait_status_and_results(gateway: str, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                              "body": {"model": MODEL, "prompt": f"p{i}", "max_tokens": 3}})
                                  for i in range(30)) + "\n{broken\n")
    submitted = kvflow_batch(gateway, "submit", str(requests), "--wait", "--metadata", "team=a")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.splitlines()[0]
    assert batch_id.startswith("batch_")
    assert "[########################] 31/31 done 30 failed 1" in submitted.stdout  # the progress line, at the end
    assert submitted.stdout.splitlines()[-1].startswith(f"{batch_id} completed: 30 completed, 1 failed of 31")

    status = kvflow_batch(gateway + "/v1/", "status", batch_id, "--json")  # OpenAI's spelling of the URL too
    assert json.loads(status.stdout)["metadata"] == {"team": "a"}

    out = tmp_path / "out.jsonl"
    results = kvflow_batch(gateway, "results", batch_id, "-o", str(out))
    assert results.returncode == 0, results.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [f"r{i}" for i in range(30)]
    errors = (tmp_path / "out.errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["error"]["code"] == "invalid_json_line"


def test_errors_are_one_line(gateway: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused = kvflow_batch(gateway, "submit", str(empty), "--endpoint", "/v1/completions")
    assert refused.returncode == 1
    assert refused.stderr == "kvflow batch: POST /v1/files: HTTP 400: the file is empty: a batch file has one JSON" \
                             " request per line\n"
    missing = kvflow_batch(gateway, "status", "batch_nope")
    assert missing.stderr == "kvflow batch: GET /v1/batches/batch_nope: HTTP 404: No such Batch object: batch_nope\n"
    down = kvflow_batch(f"http://127.0.0.1:{free_port()}", "status", "batch_x")
    assert down.returncode == 1 and "is `kvflow up` running?" in down.stderr and down.stderr.count("\n") == 1
