"""The batch runner against any line and any mix of owners: a gateway in this process (real
router) in front of simulated pods (real processes on 127.0.0.x)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from kvflow.gateway.batch.fair import OwnerQueue, shares
from tests.batch.test_api import MODEL, finished, gateway, lines, request
from tests.conftest import SimPodFactory


def raw(custom_id: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


async def run_batch(client: openai.AsyncOpenAI, data: str) -> Any:
    upload = await client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
    created = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                          completion_window="24h")
    return await finished(client, created.id, timeout=60)


async def test_a_line_without_a_model_runs_as_the_same_body_would_interactively(sim_pods: SimPodFactory,
                                                                               tmp_path: Path) -> None:
    running = await gateway(sim_pods(1, "--model", MODEL, "--profile", "instant"), tmp_path)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        interactive = await client.completions.create(model=None, prompt="hi", max_tokens=2)  # type: ignore[arg-type]
        assert interactive.model == MODEL  # a one-pool gateway answers with its model, as vLLM does
        data = "\n".join([raw("no-model", {"prompt": "hi", "max_tokens": 2}),
                          raw("model-null", {"model": None, "prompt": "hi", "max_tokens": 2}),
                          raw("model-list", {"model": ["x"], "prompt": "hi", "max_tokens": 2}),
                          request("good")])
        batch = await run_batch(client, data)
        output = {x["custom_id"]: x for x in await lines(client, batch.output_file_id)}
        errors = {x["custom_id"]: x for x in await lines(client, batch.error_file_id)}
    finally:
        await running.close()
    assert batch.status == "completed"
    assert set(output) == {"no-model", "model-null", "good"}
    assert output["no-model"]["response"]["body"]["model"] == MODEL
    assert set(errors) == {"model-list"} and errors["model-list"]["response"]["status_code"] in (400, 404)


async def test_a_runner_survives_a_batch_of_bad_lines_and_runs_the_next_batch(sim_pods: SimPodFactory,
                                                                             tmp_path: Path) -> None:
    pods = sim_pods(1, "--model", MODEL, "--profile", "instant")
    running = await gateway(pods, tmp_path, pools=[{"model": MODEL, "endpoints": [p.id for p in pods]},
                                                   {"model": "other", "endpoints": [p.id for p in pods]}])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        # two pools: a line without a model has no pool to go to (a 404 as an interactive request gets)
        bad = await run_batch(client, "\n".join(raw(f"b{i}", {"prompt": "x", "max_tokens": 1}) for i in range(201)))
        errors = await lines(client, bad.error_file_id)
        after = await run_batch(client, "\n".join(request(f"ok-{i}") for i in range(5)))
    finally:
        await running.close()
    assert bad.status == "completed" and bad.request_counts is not None
    assert (bad.request_counts.total, bad.request_counts.completed, bad.request_counts.failed) == (201, 0, 201)
    assert {e["response"]["status_code"] for e in errors} == {404} and len(errors) == 201
    assert after.status == "completed" and after.request_counts.completed == 5  # type: ignore[union-attr]


async def test_a_cancelled_batch_of_bad_lines_settles(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    pods = sim_pods(1, "--model", MODEL, "--profile", "instant")
    running = await gateway(pods, tmp_path, pools=[{"model": MODEL, "endpoints": [p.id for p in pods]},
                                                   {"model": "other", "endpoints": [p.id for p in pods]}])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        data = "\n".join([raw(f"b{i}", {"prompt": "x"}) if i % 2 else request(f"g{i}") for i in range(400)])
        upload = await client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
        created = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                              completion_window="24h")
        await client.batches.cancel(created.id)
        done = await finished(client, created.id, timeout=30)
    finally:
        await running.close()
    assert done.status == "cancelled"


async def test_another_keys_small_batch_does_not_wait_behind_a_large_one(sim_pods: SimPodFactory,
                                                                         tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-big\nsk-small\n")
    pods = sim_pods(1, "--model", MODEL, "--profile", "h100-llama8b")
    running = await gateway(pods, tmp_path, auth={"keys_file": str(keys)}, batch={"per_pod": 8})
    base = f"http://127.0.0.1:{running.port}/v1"
    big, small = (openai.AsyncOpenAI(base_url=base, api_key=k, max_retries=0) for k in ("sk-big", "sk-small"))
    try:
        data = "\n".join(request(f"r{i}", max_tokens=40) for i in range(1000)).encode()
        upload = await big.files.create(file=("in.jsonl", data), purpose="batch")
        large = await big.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                         completion_window="24h")
        while (await big.batches.retrieve(large.id)).request_counts.completed < 8:  # type: ignore[union-attr]
            pass  # each retrieve is a round trip: the large batch is running once this ends
        few = await run_batch(small, "\n".join(request(f"s{i}", max_tokens=40) for i in range(10)))
        large_then = await big.batches.retrieve(large.id)
        await big.batches.cancel(large.id)
    finally:
        await running.close()
    assert few.status == "completed" and few.request_counts.completed == 10  # type: ignore[union-attr]
    # the small batch was done while the large one still ran (before: only after all of its lines)
    assert large_then.status == "in_progress" and large_then.request_counts.completed < 1000  # type: ignore[union-attr]


@pytest.mark.parametrize(("room", "owners", "expected"), [
    (10, 1, [10]), (10, 3, [4, 3, 3]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (5, 0, []),
], ids=["one-owner", "remainder-first", "less-room-than-owners", "no-room", "no-owners"])
def test_room_is_shared_evenly_between_owners(room: int, owners: int, expected: list[int]) -> None:
    assert shares(room, owners) == expected


def test_owners_are_served_in_turn_whatever_their_backlog() -> None:
    queue: OwnerQueue[str] = OwnerQueue()
    for i in range(5):
        queue.append("big", f"big-{i}")
    queue.append("small", "small-0")
    queue.append("small", "small-1")
    assert [queue.popleft() for _ in range(5)] == ["big-0", "small-0", "big-1", "small-1", "big-2"]
    assert len(queue) == 2 and list(queue) == ["big-3", "big-4"]


def test_removing_a_batchs_lines_keeps_the_others_in_order() -> None:
    queue: OwnerQueue[tuple[str, int]] = OwnerQueue()
    for i in range(3):
        queue.append("a", ("x", i))
        queue.append("b", ("y", i))
    assert queue.remove(lambda item: item[0] == "x") == [("x", 0), ("x", 1), ("x", 2)]
    assert len(queue) == 3 and [queue.popleft() for _ in range(3)] == [("y", 0), ("y", 1), ("y", 2)]
