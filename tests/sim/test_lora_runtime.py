"""vLLM's dynamic LoRA API on the simulator: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Conformance with vLLM's ``OpenAIServingModels`` (statuses, bodies, what ``/v1/models`` lists
after) and with ``--lora-modules``: a loaded adapter is served, hashed and reported like a static one.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from kvflow.hashing import external_int, hash_request_tokens
from kvflow.protocol.kv_events import BlockStored, WireBlockStored, decode_batch, decode_structs
from kvflow.sim.lora import runtime_updating

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16


def post(pod: Any, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """(status, content type, body text) of a JSON POST."""
    req = urllib.request.Request(pod.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def served(pod: Any) -> list[tuple[str, str, str | None]]:
    return [(m["id"], m["root"], m["parent"]) for m in json.loads(pod.get("/v1/models"))["data"]]


def error(text: str) -> tuple[str, str, int]:
    e = json.loads(text)["error"]
    return e["message"], e["type"], e["code"]


@pytest.mark.parametrize(("value", "on"), [
    ("True", True), ("true", True), ("1", True), (" TRUE ", True), ("0", False), ("False", False), ("yes", False),
], ids=lambda v: repr(v))
def test_the_routes_are_on_exactly_when_vllm_reads_the_variable_as_true(value: str, on: bool) -> None:
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is on
    assert runtime_updating({}) is False


def test_without_the_variable_the_routes_are_absent_as_in_vllm(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--enable-lora")
    status, _, text = post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert (status, json.loads(text)) == (404, {"detail": "Not Found"})
    assert post(pod, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
    assert [m[0] for m in served(pod)] == ["sim-model"]


def test_a_loaded_adapter_is_listed_served_and_unloaded(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--enable-lora", "--max-loras", "2", env=RUNTIME)
    status, kind, text = post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert (status, kind.split(";")[0], text) == (200, "text/plain", "Success: LoRA adapter 'sql' added successfully.")
    assert served(pod) == [("sim-model", "sim-model", None), ("sql", "/adapters/sql", "sim-model")]
    completion = {"model": "sql", "prompt": "hello", "max_tokens": 2}
    code, body = pod.post_json("/v1/completions", completion)
    assert (code, body["model"]) == (200, "sql")

    status, _, text = post(pod, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert served(pod) == [("sim-model", "sim-model", None)]
    code, body = pod.post_json("/v1/completions", completion)
    assert (code, body["error"]["type"], body["error"]["param"]) == (404, "NotFoundError", "model")


def test_refusals_are_vllms_statuses_and_error_bodies(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--lora-modules", "chat=/adapters/chat", env=RUNTIME)
    load = {"lora_name": "chat", "lora_path": "/adapters/other"}
    status, kind, text = post(pod, "/v1/load_lora_adapter", load)
    assert (status, kind.split(";")[0]) == (400, "application/json")
    assert error(text) == ("The lora adapter 'chat' has already been loaded. If you want to load the adapter in "
                           "place, set 'load_inplace' to True.", "InvalidUserInput", 400)
    status, _, text = post(pod, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"})
    assert error(text) == ("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
    status, _, text = post(pod, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert (status, json.loads(text)["error"]["param"]) == (400, "body.lora_path")  # FastAPI's validation error, as vLLM renders it
    status, _, text = post(pod, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert error(text) == ("The lora adapter 'nope' cannot be found.", "NotFoundError", 404)
    status, _, text = post(pod, "/v1/unload_lora_adapter", {"lora_name": ""})
    assert error(text) == ("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
    assert served(pod) == [("sim-model", "sim-model", None), ("chat", "/adapters/chat", "sim-model")]

    # in place: the same name takes the new path
    assert post(pod, "/v1/load_lora_adapter", {**load, "load_inplace": True})[0] == 200
    assert served(pod) == [("sim-model", "sim-model", None), ("chat", "/adapters/other", "sim-model")]


def test_loading_without_enable_lora_fails_in_the_engine_with_a_500(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", env=RUNTIME)
    status, _, text = post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert error(text) == ("Call to add_lora method failed: LoRA is not enabled.", "InternalServerError", 500)
    assert [m[0] for m in served(pod)] == ["sim-model"]


def test_a_static_adapter_can_be_unloaded_and_loaded_again(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--lora-modules", "sql=/adapters/sql", env=RUNTIME)
    assert post(pod, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 200
    assert post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql-v2"})[0] == 200
    assert served(pod) == [("sim-model", "sim-model", None), ("sql", "/adapters/sql-v2", "sim-model")]


def test_a_loaded_adapter_runs_in_lora_requests_info(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--enable-lora", "--max-loras", "2", env=RUNTIME)  # a real step time: tokens take a while
    metrics = pod.get("/metrics").decode()
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    assert post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})[0] == 200
    req = urllib.request.Request(pod.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "sql", "prompt": "hi", "max_tokens": 4000,
                                                  "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=10) as stream:
        stream.readline()  # the first token is out: the request is running
        metrics = pod.get("/metrics").decode()
    assert 'max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""' in metrics


def test_a_loaded_adapters_blocks_are_hashed_and_published_as_a_static_ones(sim_pods: Any) -> None:
    import zmq

    [pod] = sim_pods(1, "--profile", "instant", "--lora-modules", "chat=/adapters/chat", "--block-size", "16",
                     kv_events=True, env=RUNTIME)
    assert post(pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})[0] == 200
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pod.kv_events)
    try:
        stored: list[BlockStored] = []
        ids: list[int | None] = []
        deadline = time.monotonic() + 10
        n = 0
        while not stored and time.monotonic() < deadline:  # until the subscription has reached the publisher
            n += 1  # a new prompt each time: a cached one stores nothing
            pod.post_json("/v1/completions", {"model": "sql", "prompt": [n, *PROMPT], "max_tokens": 1})
            while sub.poll(200):
                payload = sub.recv_multipart()[2]
                stored += [e for e in decode_batch(payload) if isinstance(e, BlockStored)]
                ids += [e.lora_id for e in decode_structs(payload).events if isinstance(e, WireBlockStored)]
    finally:
        sub.close(linger=0)
    assert stored, "no BlockStored event arrived"
    raw = stored[0]
    expected = [external_int(h) for h in hash_request_tokens(list(raw.token_ids), 16, seed="0",
                                                             lora=("sql", "/adapters/sql"))]
    assert (list(raw.block_hashes), raw.lora_name, raw.extra_keys) == (expected, "sql", (("sql",), ("sql",)))
    assert ids[0] == 2  # ids count on from the static adapters' (chat is 1)
