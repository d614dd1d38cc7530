"""The Batch API through the official openai SDK: a gateway in this process (real router) in front
of simulated pods (real processes on 127.0.0.x)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import RunningGateway, start_gateway
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from tests.conftest import SimPod, SimPodFactory
from tests.gateway.fakes import FakePod, ScriptedRouter
from tests.waiting import eventually

MODEL = "sim-model"


def request(custom_id: str, prompt: str = "hello", url: str = "/v1/completions", **body: Any) -> str:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    if url == "/v1/chat/completions":
        payload.pop("prompt")
        payload["messages"] = [{"role": "user", "content": prompt}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


async def gateway(pods: list[SimPod], tmp_path: Path, **config: Any) -> RunningGateway:
    cfg = GatewayConfig.model_validate({
        "port": 0, "pools": [{"model": MODEL, "endpoints": [p.id for p in pods]}],
        **config, "batch": {"dir": str(tmp_path / "batches"), "poll_s": 0.1, **config.get("batch", {})},
    })
    return await start_gateway(cfg)


@pytest.fixture
async def client(sim_pods: SimPodFactory, tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    running = await gateway(sim_pods(2, "--model", MODEL, "--profile", "instant"), tmp_path)
    try:
        yield openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="unused", max_retries=0)
    finally:
        await running.close()


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60) -> Any:
    async def ended() -> Any:
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None

    return await eventually(ended, timeout, what=f"batch {batch_id} to end")


async def completed(client: openai.AsyncOpenAI, batch_id: str) -> int:
    counts = (await client.batches.retrieve(batch_id)).request_counts
    assert counts is not None
    return counts.completed


def routable(running: RunningGateway, endpoint: str) -> float | None:
    """The gateway's ``kvflow_router_endpoint_healthy`` for ``endpoint`` (None before it is rendered)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{running.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvflow_router_endpoint_healthy" and sample.labels.get("endpoint") == endpoint:
                return float(sample.value)
    return None


async def lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await client.files.content(file_id)).text.splitlines()]


async def test_a_batch_runs_and_its_results_come_back_in_openais_shapes(client: openai.AsyncOpenAI) -> None:
    good = [request(f"ok-{i}", f"prompt {i}") for i in range(20)]
    bad = ["{this is not json", request("unknown-model", model="no-such-model"),
           request("bad-body", max_tokens=-1), json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
           request("too-deep", user=json.loads("[" * 200 + "]" * 200))]  # an interactive request's depth limit
    upload = await client.files.create(file=("in.jsonl", "\n".join(good[:10] + bad + good[10:]).encode()),
                                       purpose="batch")
    assert (upload.purpose, upload.filename) == ("batch", "in.jsonl")
    created = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                          completion_window="24h", metadata={"job": "test"})
    assert created.status == "validating" and created.metadata == {"job": "test"}

    batch = await finished(client, created.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (25, 20, 5)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    output = await lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in output] == [f"ok-{i}" for i in range(20)]  # in input order
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in output)
    assert output[0]["response"]["body"]["usage"]["completion_tokens"] == 4
    errors = {x["custom_id"]: x for x in await lines(client, batch.error_file_id)}
    assert set(errors) == {None, "unknown-model", "bad-body", "too-deep"}
    assert errors["unknown-model"]["response"]["status_code"] == 404
    assert errors["unknown-model"]["response"]["body"]["error"]["type"] == "NotFoundError"
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert "nested deeper than" in errors["too-deep"]["response"]["body"]["error"]["message"]
    assert errors[None]["error"]["code"] in ("invalid_json_line", "missing_custom_id")
    assert len(await lines(client, batch.error_file_id)) == 5

    listed = [b.id async for b in client.batches.list()]
    assert listed == [created.id]
    files = {f.id: f.purpose async for f in client.files.list()}
    assert files == {upload.id: "batch", batch.output_file_id: "batch_output", batch.error_file_id: "batch_output"}


async def test_chat_completion_batches(client: openai.AsyncOpenAI) -> None:
    data = "\n".join(request(f"c{i}", f"hi {i}", url="/v1/chat/completions") for i in range(5)).encode()
    upload = await client.files.create(file=("chat.jsonl", data), purpose="batch")
    batch = await finished(client, (await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")).id)
    output = await lines(client, batch.output_file_id)
    assert [x["response"]["body"]["object"] for x in output] == ["chat.completion"] * 5
    assert batch.error_file_id is None


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the file is empty"),
    (b"one\ntwo\n", "no line of the file is a JSON request"),
    (b"\xff\xfe", "not UTF-8"),
    (b'{"custom_id": "x"}\n{"custom_id": "x"}', "custom_id 'x' is used on lines 1 and 2"),
], ids=["empty", "prose", "binary", "duplicates"])
async def test_files_that_cannot_run_are_refused_at_upload(client: openai.AsyncOpenAI, data: bytes,
                                                           message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        await client.files.create(file=("in.jsonl", data), purpose="batch")
    assert [f async for f in client.files.list()] == []


async def test_bad_calls_get_openai_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        await client.files.create(file=("in.jsonl", request("a").encode()), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        await client.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError, match="No such Batch object"):
        await client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError, match="No such batch input file"):
        await client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    upload = await client.files.create(file=("in.jsonl", request("a").encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                                    completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                    completion_window="soon")  # type: ignore[arg-type]
    deleted = await client.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    base = str(client.base_url).rstrip("/")
    for method, path, status in (("PUT", "/files", 405), ("GET", "/batches/x/cancel", 405),
                                 ("GET", "/files/x/other", 404), ("GET", "/filesystem", 404)):
        req = urllib.request.Request(base + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            await asyncio.to_thread(urllib.request.urlopen, req, timeout=10)
        assert info.value.code == status
        assert json.loads(info.value.read())["error"]["code"] == status


async def test_cancel_stops_new_lines_and_keeps_finished_ones(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    pods = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b")
    running = await gateway(pods, tmp_path, batch={"per_pod": 8})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        data = "\n".join(request(f"r{i}", max_tokens=40) for i in range(400)).encode()
        upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        async def eight_done() -> bool:
            return await completed(client, batch.id) >= 8

        await eventually(eight_done, timeout=60, what="8 lines to complete")
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await finished(client, batch.id, timeout=10)
        kept = await lines(client, done.output_file_id)
        served = pods[0].get("/metrics").decode()
    finally:
        await running.close()
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts is not None
    assert 8 <= done.request_counts.completed < 40 and len(kept) == done.request_counts.completed
    # lines that were running when it was cancelled finished; nothing else reached the pod
    ran = sum(float(line.rsplit(" ", 1)[1]) for line in served.splitlines()
              if line.startswith('vllm:request_success_total{') and 'finished_reason="length"' in line)
    assert ran == len(kept)


async def test_keys_see_only_their_own_files_and_batches(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alice\nsk-bob\n")
    running = await gateway(sim_pods(1, "--model", MODEL, "--profile", "instant"), tmp_path,
                            auth={"keys_file": str(keys)})
    base = f"http://127.0.0.1:{running.port}/v1"
    alice, bob = (openai.AsyncOpenAI(base_url=base, api_key=k, max_retries=0) for k in ("sk-alice", "sk-bob"))
    try:
        upload = await alice.files.create(file=("in.jsonl", request("a").encode()), purpose="batch")
        batch = await alice.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                           completion_window="24h")
        assert [f async for f in bob.files.list()] == [] and [b async for b in bob.batches.list()] == []
        with pytest.raises(openai.NotFoundError):
            await bob.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await bob.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base, api_key="sk-eve", max_retries=0).files.retrieve(upload.id)
        assert (await finished(alice, batch.id)).status == "completed"
    finally:
        await running.close()


async def test_lines_wait_for_unreachable_pods_and_run_when_they_come_back(tmp_path: Path) -> None:
    port = free_port("127.0.0.2")
    down = SimPod("127.0.0.2", port, None)  # type: ignore[arg-type]
    running = await gateway([down], tmp_path, batch={"max_attempts": 10})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        upload = await client.files.create(file=("in.jsonl", "\n".join(request(f"r{i}") for i in range(5)).encode()),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        async def waiting_for_the_pod() -> Any:
            """The batch has begun, and the gateway has found the pod unreachable."""
            now = await client.batches.retrieve(batch.id)
            seen = await asyncio.to_thread(routable, running, down.id)
            return now if now.status == "in_progress" and seen == 0 else None

        begun = await eventually(waiting_for_the_pod, what="the batch to run while its pod is unreachable")
        assert (begun.request_counts.completed, begun.request_counts.failed) == (0, 0)  # its lines wait
        with ProcessGroup(tmp_path / "late") as group:
            group.start("pod", kvflow_argv("sim", "--host", "127.0.0.2", "--port", str(port), "--model", MODEL,
                                           "--profile", "instant"), ready_url=f"{down.url}/health")
            await asyncio.to_thread(group.wait_ready, 30)
            done = await finished(client, batch.id, timeout=60)
    finally:
        await running.close()
    assert done.status == "completed" and done.request_counts.completed == 5  # type: ignore[union-attr]


async def test_a_line_fails_after_its_attempts_when_healthy_pods_keep_failing_it(tmp_path: Path) -> None:
    pod = FakePod("pod", "500")
    router = ScriptedRouter([await pod.start("127.0.0.2")])
    cfg = GatewayConfig.model_validate({"port": 0, "pools": [{"model": MODEL}],
                                        "batch": {"dir": str(tmp_path / "b"), "poll_s": 0.1, "max_attempts": 2}})
    running = await start_gateway(cfg, {MODEL: router})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        upload = await client.files.create(file=("in.jsonl", request("only").encode()), purpose="batch")
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id, timeout=30)
        [line] = await lines(client, batch.error_file_id)
    finally:
        await running.close()
        await pod.stop()
    assert batch.status == "completed" and batch.request_counts.failed == 1  # type: ignore[union-attr]
    assert len(pod.received) == 2  # max_attempts tries, then its last answer is its result
    assert line["custom_id"] == "only" and line["response"]["status_code"] == 502
    assert "no model server could serve the request" in line["response"]["body"]["error"]["message"]
    # batch lines are sheddable: a saturated pool refuses them (and they wait) before interactive requests
    assert {r.priority for r in router.scheduled} == {-1}
