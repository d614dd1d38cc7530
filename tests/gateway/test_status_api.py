"""The status API, the explained-response header and ``kvflow status``, against a real gateway
(real router) in front of simulated decode and prefill pods, all processes on 127.0.0.x."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port

MODEL = "tiny"
ADMIN, USER = "sk-admin", "sk-user"
KEYS = f"""keys:
  - {{key: {ADMIN}, name: ops, admin: true, allow_headers: [x-kvflow-explain]}}
  - {{key: {USER}, name: team}}
"""
LONG = "a prompt long enough to go through a prefill pod, well over eight tokens " * 3


@dataclass
class Stack:
    url: str
    decode: list[str]
    prefill: str
    logs: Path
    group: ProcessGroup


def call(url: str, body: object | None = None, key: str | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=h), timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as refused:
        return refused.code, {k.lower(): v for k, v in refused.headers.items()}, refused.read()


@pytest.fixture
def stack(sim_pods, tmp_path: Path) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    decode = sim_pods(2, "--model", MODEL, "--profile", "instant", "--role", "decode")
    (prefill,) = sim_pods(1, "--model", MODEL, "--profile", "instant", "--role", "prefill")
    (tmp_path / "keys.yaml").write_text(KEYS)
    (tmp_path / "router.json").write_text('{"pd": {"threshold": 8}, "kvEvents": {"enabled": false}}')
    port = free_port()
    logs = tmp_path / "gw"
    with ProcessGroup(logs) as group:
        group.start("gateway", kvflow_argv(
            "gateway", "--port", str(port), "--model", MODEL, *[a for p in decode for a in ("--endpoint", p.id)],
            "--prefill-endpoint", prefill.id, "--router-config", str(tmp_path / "router.json"),
            "--api-keys-file", str(tmp_path / "keys.yaml"), "--no-batch"), ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        yield Stack(f"http://127.0.0.1:{port}", [p.id for p in decode], prefill.id, logs, group)


def test_the_status_document_shows_every_pod_and_why_each_request_went_where_it_did(stack: Stack) -> None:
    short = call(f"{stack.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}, ADMIN,
                 {"x-kvflow-explain": "1"})
    long = call(f"{stack.url}/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 3, "stream": True},
                ADMIN, {"x-kvflow-explain": "1"})
    quiet = call(f"{stack.url}/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 3}, USER,
                 {"x-kvflow-explain": "1"})
    assert short[0] == long[0] == quiet[0] == 200
    pod, mode, prefill, cached = (kv.split("=")[1] for kv in short[1]["x-kvflow-route"].split("; "))
    assert pod in stack.decode and (mode, prefill) == ("aggregated", "-") and int(cached) >= 0
    fields = dict(kv.split("=") for kv in long[1]["x-kvflow-route"].split("; "))
    assert fields["pod"] in stack.decode and (fields["mode"], fields["prefill"]) == ("pd", stack.prefill)
    assert "x-kvflow-route" not in quiet[1]  # a key not allowed the header gets no explanation

    status, _, raw = call(f"{stack.url}/v1/kvflow/status", key=ADMIN)
    assert status == 200
    doc = json.loads(raw)
    (model,) = doc["models"]
    assert doc["source"] == "gateway" and model["model"] == MODEL and model["pd"] == {"enabled": True, "threshold": 8}
    pods = {p["id"]: p for p in model["pods"]}
    assert set(pods) == {*stack.decode, stack.prefill}
    assert pods[stack.prefill]["role"] == "prefill" and all(pods[d]["role"] == "decode" for d in stack.decode)
    assert sum(pods[d]["served"]["requests"] for d in stack.decode) == 3
    assert sum(pods[d]["served"]["ttft_count"] for d in stack.decode) == 1  # the one streamed answer
    newest, middle, oldest = model["decisions"][:3]
    assert (oldest["mode"], middle["mode"], newest["mode"]) == ("aggregated", "pd", "pd")
    assert middle["pick"] == fields["pod"] and middle["prefill"] == stack.prefill
    assert middle["reason"].startswith(f"{middle['pick']} picked")
    assert f"prefill on {stack.prefill}" in middle["reason"] and "exceed the threshold 8" in middle["reason"]
    assert "at most the P/D threshold 8" in oldest["reason"]
    assert {c["id"] for c in middle["candidates"] if c["leg"] == "decode"} == set(stack.decode)
    assert [c["id"] for c in middle["candidates"] if c["picked"]] == [middle["pick"], stack.prefill]
    assert LONG[:20] not in raw.decode() and "hi" not in {d.get("prompt") for d in model["decisions"]}


def test_the_access_log_names_the_prefill_pod_of_a_pd_request(stack: Stack) -> None:
    assert call(f"{stack.url}/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 2}, USER,
                {"X-Request-Id": "pd-1"})[0] == 200
    stack.group.stop_all()  # the gateway writes out the lines it holds as it stops
    lines = [json.loads(x) for x in (stack.logs / "gateway.log").read_text().splitlines() if x.startswith('{"ts"')]
    (line,) = [x for x in lines if x["request_id"] == "pd-1"]
    assert (line["mode"], line["prefill"]) == ("pd", stack.prefill) and line["upstream"] in stack.decode


@pytest.mark.parametrize(("path", "key", "status"), [
    ("/v1/kvflow/status", None, 401), ("/v1/kvflow/status", USER, 403), ("/v1/kvflow/status", "sk-wrong", 401),
    ("/dashboard", None, 401), ("/dashboard", USER, 403), ("/dashboard/static/uPlot.iife.min.js", None, 401),
], ids=["api-no-key", "api-user-key", "api-wrong-key", "page-no-key", "page-user-key", "asset-no-key"])
def test_only_an_admin_key_reads_the_status(stack: Stack, path: str, key: str | None, status: int) -> None:
    got, headers, raw = call(stack.url + path, key=key)
    assert got == status
    assert json.loads(raw)["error"]["type"] == ("PermissionDeniedError" if status == 403 else "AuthenticationError")
    assert ("www-authenticate" in headers) == (path != "/v1/kvflow/status" and status == 401)  # the browser asks


def test_the_page_and_its_assets_load_with_the_admin_key_as_a_browser_sends_it(stack: Stack) -> None:
    basic = "Basic " + base64.b64encode(f"admin:{ADMIN}".encode()).decode()
    status, headers, page = call(stack.url + "/dashboard", headers={"Authorization": basic})
    assert status == 200 and headers["content-type"].startswith("text/html") and b"uPlot.iife.min.js" in page
    for asset, kind in (("dashboard.js", "text/javascript"), ("uPlot.iife.min.js", "text/javascript"),
                        ("uPlot.min.css", "text/css")):
        status, headers, body = call(f"{stack.url}/dashboard/static/{asset}", headers={"Authorization": basic})
        assert status == 200 and headers["content-type"].startswith(kind) and body
    assert call(stack.url + "/dashboard/static/../app.py", headers={"Authorization": basic})[0] == 404


def kvflow_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow", "status", *args], capture_output=True, text=True,
                          timeout=60)


def test_kvflow_status_prints_the_pods_and_decisions_as_tables(stack: Stack) -> None:
    assert call(f"{stack.url}/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 2}, USER)[0] == 200
    shown = kvflow_status("--url", stack.url, "--api-key", ADMIN)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "POD", "ROLE", "HEALTH", "IN-FLIGHT", "RUNNING", "WAITING", "KV-CACHE",
                                "PREFIX-HIT", "LORA", "SCRAPED", "KV-LAG", "SERVED"]
    rows = {line.split()[1]: line.split() for line in lines[1:4]}
    assert set(rows) == {*stack.decode, stack.prefill} and rows[stack.prefill][2] == "prefill"
    decisions = lines[lines.index("") + 1:]
    assert decisions[0].split()[:4] == ["MODEL", "AGE", "REQUEST", "MODE"]
    assert decisions[1].split()[3] == "pd" and f"prefill on {stack.prefill}" in decisions[1]

    as_json = kvflow_status("--url", stack.url, "--api-key", ADMIN, "-o", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["kvflow_status"] == 1

    watch = subprocess.Popen([sys.executable, "-m", "kvflow", "status", "--url", stack.url, "--api-key", ADMIN,
                              "--watch", "--interval", "0.1", "-o", "json"], stdout=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        first, second = json.loads(watch.stdout.readline()), json.loads(watch.stdout.readline())
        assert second["time"] > first["time"]  # refreshed: one document per line
    finally:
        watch.terminate()
        watch.wait(10)
        if watch.stdout is not None:
            watch.stdout.close()  # wait() leaves the pipe open, for the collector to warn about


@pytest.mark.parametrize(("key", "says"), [
    (None, "HTTP 401: missing API key"), (USER, "HTTP 403: the status API and page need an admin key"),
], ids=["no-key", "not-admin"])
def test_kvflow_status_says_in_one_line_why_it_cannot_show_the_status(stack: Stack, key: str | None,
                                                                      says: str) -> None:
    refused = kvflow_status("--url", stack.url, *(["--api-key", key] if key else []))
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"kvflow status: {stack.url}: {says}") and refused.stderr.count("\n") == 1


def test_kvflow_status_says_in_one_line_that_nothing_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    down = kvflow_status("--url", url, "--api-key", ADMIN)
    assert down.returncode == 1 and down.stdout == ""
    assert down.stderr.startswith(f"kvflow status: cannot reach {url}") and down.stderr.count("\n") == 1


async def test_a_running_batch_shows_with_its_progress_and_its_lines_count(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import aiohttp
    import openai

    from kvflow.gateway.config import GatewayConfig
    from kvflow.gateway.server import start_gateway
    from kvflow.statuscli import render

    pods = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b")
    config = GatewayConfig.model_validate({"port": 0, "pools": [{"model": MODEL, "endpoints": [p.id for p in pods]}],
                                           "batch": {"dir": str(tmp_path / "batches"), "poll_s": 0.1}})
    running = await start_gateway(config)
    url = f"http://127.0.0.1:{running.port}"
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    lines = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 64}})
                      for i in range(40))
    try:
        upload = await client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        async with aiohttp.ClientSession() as session:
            row: dict = {}  # type: ignore[type-arg]
            while not (row.get("status") == "in_progress" and row.get("completed", 0) >= 1):
                async with session.get(f"{url}/v1/kvflow/status") as resp:  # each a round trip: no sleep
                    doc = await resp.json()
                row = next((b for b in doc["batches"] if b["id"] == batch.id), {})
            async with session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        await client.batches.cancel(batch.id)
    finally:
        await running.close()
    assert (row["endpoint"], row["total"]) == ("/v1/completions", 40) and row["completed"] + row["failed"] < 40
    table = render(doc).splitlines()
    assert table[table.index("", table.index("") + 1) + 1].split() == ["BATCH", "STATUS", "ENDPOINT", "PROGRESS",
                                                                       "DONE", "FAILED"]
    assert any(line.startswith(batch.id) and "in_progress" in line for line in table)
    assert 'kvflow_gateway_batch_lines_total{result="completed"}' in metrics
    assert f'kvflow_gateway_batch_lines_in_flight{{model="{MODEL}"}}' in metrics
