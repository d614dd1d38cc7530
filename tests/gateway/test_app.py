"""The gateway in-process, in front of fake pods on 127.0.0.x: routing, bad input, retries,
mid-stream failures, P/D bodies, client disconnects and the OpenAI client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import start_gateway
from kvflow.router.request import PoolNames
from tests.gateway.fakes import FakePod, ScriptedRouter

MODEL = "tiny"


@dataclass
class Stack:
    url: str
    pods: list[FakePod]
    router: ScriptedRouter
    gateway: Any
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.session.post(self.url + path, data=data, **kw) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return r.status, parsed, r.headers


async def make_stack(behaviours: list[str], *, prefill: str | None = None, rotate: bool = False,
                     **config: Any) -> Stack:
    pods = [FakePod(f"pod{i}", b) for i, b in enumerate(behaviours)]
    endpoints = [await pod.start(f"127.0.0.{i + 2}") for i, pod in enumerate(pods)]
    prefill_pod = None
    if prefill is not None:
        prefill_pod = FakePod("prefill", prefill)
        pods.append(prefill_pod)
        await prefill_pod.start("127.0.0.9")
    loras = config.pop("loras", [])
    router = ScriptedRouter(endpoints, prefill_pod.endpoint if prefill_pod else None, rotate=rotate,
                            names=PoolNames(MODEL, frozenset(loras)))
    pool = {"model": MODEL, "endpoints": [], "loras": loras}
    cfg = GatewayConfig.model_validate({"port": 0, "pools": [pool], **config})
    running = await start_gateway(cfg, {MODEL: router})
    return Stack(f"http://127.0.0.1:{running.port}", pods, router, running, aiohttp.ClientSession())


@pytest.fixture
async def stacks() -> AsyncIterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        await stack.session.close()
        await stack.gateway.close()
        for pod in stack.pods:
            await pod.stop()


@pytest.fixture
def start(stacks: list[Stack]):  # type: ignore[no-untyped-def]
    async def _start(behaviours: list[str], **kw: Any) -> Stack:
        stack = await make_stack(behaviours, **kw)
        stacks.append(stack)
        return stack
    return _start


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize(("raw", "status", "type_", "param"), [
    (b"{not json", 400, "BadRequestError", None),
    (b"[1, 2]", 400, "BadRequestError", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "four"}), 400, "Bad Request", "body.max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}), 400, "BadRequestError",
     "stream_options"),
    (json.dumps({"model": "no-such-model", "prompt": "x"}), 404, "NotFoundError", "model"),
    (json.dumps({"model": MODEL, "prompt": "x" * 5000}), 413, "BadRequestError", None),
], ids=["malformed", "not-object", "wrong-type", "stream-options-alone", "unknown-model", "too-large"])
async def test_bad_input_gets_openai_error_json(start, raw, status, type_, param) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"], max_body_bytes=4096)
    got_status, body, headers = await stack.post("/v1/completions", raw)
    assert got_status == status
    assert body["error"]["type"] == type_
    assert body["error"]["code"] == status
    assert body["error"]["param"] == param
    assert stack.pods[0].received == []


async def test_unknown_path_and_method_get_openai_error_json(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"])
    async with stack.session.get(stack.url + "/v1/nothing") as r:
        assert (r.status, (await r.json())["error"]["type"]) == (404, "NotFoundError")
    async with stack.session.get(stack.url + "/v1/completions") as r:
        assert (r.status, (await r.json())["error"]["type"]) == (405, "MethodNotAllowedError")


async def test_forwards_the_original_bytes_with_a_request_id(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"])
    raw = b'{"model":"tiny",  "prompt":"hello", "vendor_extension": {"a": 1}}'
    status, body, headers = await stack.post("/v1/completions", raw, headers={"X-Request-Id": "req-42"})
    assert (status, body["choices"][0]["text"], headers["X-Request-Id"]) == (200, "from pod0", "req-42")
    assert stack.pods[0].received == [json.loads(raw)]
    assert stack.pods[0].headers[0]["x-request-id"] == "req-42"
    assert stack.router.flights == [("req-42", [f"send {stack.pods[0].endpoint.id}", "answered", "finish"])]


async def test_a_body_without_a_model_goes_to_the_one_model_served(start) -> None:  # type: ignore[no-untyped-def]
    """vLLM answers an unnamed model with its own; a one-model gateway does the same."""
    stack = await start(["ok"])
    status, body, _ = await stack.post("/v1/completions", b'{"prompt": "hello"}')
    assert (status, body["choices"][0]["text"], stack.pods[0].received) == (200, "from pod0", [{"prompt": "hello"}])


@pytest.mark.parametrize(("behaviours", "served_by", "failed"), [
    (["500", "ok"], "from pod1", []),
    (["down", "ok"], "from pod1", ["127.0.0.2"]),
    (["500", "500", "ok"], "from pod2", []),
], ids=["5xx", "connection-refused", "two-failures"])
async def test_failures_before_the_first_byte_retry_on_the_next_candidate(
        start, behaviours, served_by, failed) -> None:  # type: ignore[no-untyped-def]
    stack = await start([b if b != "down" else "ok" for b in behaviours])
    for pod, b in zip(stack.pods, behaviours):
        if b == "down":
            await pod.stop()
    for stream in (False, True):
        status, body, _ = await stack.post("/v1/completions", {**COMPLETION, "stream": stream})
        assert status == 200
        assert (served_by in json.dumps(body)) or (served_by.split()[-1] in body)
    assert [f.split(":")[0] for f in stack.router.failed] == failed * 2
    for _, events in stack.router.flights:  # every failed attempt was undone before the next one
        sends = [e for e in events if e.startswith("send")]
        assert [e.split()[0] for e in events[: 2 * len(sends) - 1]] == ["send", "failed"] * (len(sends) - 1) + ["send"]
        assert events[-1] == "finish"
    metrics = (await (await stack.session.get(stack.url + "/metrics")).read()).decode()
    assert f'kvflow_gateway_retries_total{{model="{MODEL}"' in metrics


async def test_all_candidates_failing_is_a_502_not_a_hang(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["500", "500"])
    status, body, _ = await stack.post("/v1/completions", COMPLETION)
    assert status == 502
    assert body["error"]["type"] == "BadGatewayError"
    assert "HTTP 500" in body["error"]["message"]


async def test_client_errors_from_a_pod_pass_through_without_retry(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["400", "ok"])
    status, body, _ = await stack.post("/v1/completions", COMPLETION)
    assert (status, body["error"]["message"]) == (400, "bad prompt")
    assert len(stack.pods[1].received) == 0


async def test_a_stream_that_dies_after_its_first_chunk_ends_with_an_error_event(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["die", "ok"])
    status, text, _ = await stack.post("/v1/completions", {**COMPLETION, "stream": True})
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert status == 200
    assert json.loads(events[0])["choices"][0]["text"] == "pod0-0 "
    assert json.loads(events[1])["error"]["type"] == "BadGatewayError"
    assert events[2] == "[DONE]"
    assert len(stack.pods[1].received) == 0  # a half-sent answer is never retried


async def test_a_client_disconnect_cancels_the_upstream_request(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["hang"])
    async with stack.session.post(stack.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert (await r.content.readline()).startswith(b"data: ")
        r.close()
    await asyncio.wait_for(stack.pods[0].was_cancelled.wait(), 5)
    assert stack.pods[0].cancelled == 1
    assert stack.router.flights[0][1][-2:] == ["first_token", "finish"]  # released though cut short


async def test_pd_sends_the_nixl_protocol_to_prefill_then_decode(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"], prefill="ok")
    request = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2}
    status, text, _ = await stack.post("/v1/completions", request, headers={"X-Request-Id": "pd-1"})
    decode, prefill = stack.pods
    assert status == 200 and "pod0-2" in text
    assert prefill.received == [{"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": False,
                                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                        "remote_engine_id": None, "remote_block_ids": None,
                                                        "remote_host": None, "remote_port": None}}]
    assert decode.received == [{**request, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-prefill",
        "remote_request_id": "pd-1", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1", "remote_port": 5600}}]
    assert [h["x-request-id"] for h in prefill.headers + decode.headers] == ["pd-1", "pd-1"]


async def test_concurrent_pd_waves_keep_each_request_with_its_own_kv_params(start) -> None:  # type: ignore[no-untyped-def]
    # Waves of concurrent P/D requests: every decode leg must carry the kv_transfer_params its own
    # prefill answered with. The prefill step once released its pooled connection twice; from the
    # second wave two requests shared a connection and one hung or got the other's params.
    stack = await start(["ok", "ok"], prefill="ok", rotate=True, timeouts={"first_byte": 3, "idle": 3})
    ids = [f"w{wave}-{i}" for wave in range(3) for i in range(8)]
    for wave in range(3):
        statuses = await asyncio.wait_for(asyncio.gather(*(
            stack.post("/v1/completions", COMPLETION, headers={"X-Request-Id": rid})
            for rid in ids[8 * wave: 8 * wave + 8])), 10)
        assert [s for s, _, _ in statuses] == [200] * 8
    decoded = [(h["x-request-id"], b["kv_transfer_params"]["remote_request_id"])
               for pod in stack.pods[:2] for h, b in zip(pod.headers, pod.received)]
    assert sorted(decoded) == sorted(zip(ids, ids))


async def test_a_failed_prefill_falls_back_to_aggregated_decode(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"], prefill="500")
    status, body, _ = await stack.post("/v1/completions", COMPLETION)
    assert (status, body["choices"][0]["text"]) == (200, "from pod0")
    assert stack.pods[0].received == [COMPLETION]
    metrics = (await (await stack.session.get(stack.url + "/metrics")).read()).decode()
    assert f'kvflow_gateway_routed_total{{mode="pd_fallback",model="{MODEL}"}} 1.0' in metrics


async def test_models_health_and_metrics(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"])
    await stack.post("/v1/completions", {**COMPLETION, "stream": True})
    async with stack.session.get(stack.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with stack.session.get(stack.url + "/health") as r:
        assert r.status == 200
    async with stack.session.get(stack.url + "/metrics") as r:
        text = await r.text()
    for needle in (f'kvflow_gateway_requests_total{{model="{MODEL}",status="200"}} 1.0',
                   f'kvflow_gateway_time_to_first_token_seconds_count{{model="{MODEL}"}} 1.0',
                   f'kvflow_gateway_inter_token_latency_seconds_count{{model="{MODEL}"}}',
                   f'kvflow_gateway_request_duration_seconds_count{{model="{MODEL}"}} 1.0',
                   f'kvflow_gateway_routed_total{{mode="aggregated",model="{MODEL}"}} 1.0',
                   f'kvflow_gateway_inflight_requests{{model="{MODEL}"}} 0.0'):
        assert needle in text, needle


async def test_api_keys_authenticate_and_set_priority(start, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good\n")
    stack = await start(["ok"], auth={"keys_file": str(keys)})
    for auth, status in ((None, 401), ("Bearer sk-bad", 401), ("Bearer sk-good", 200)):
        headers = {"Authorization": auth} if auth else {}
        got, body, _ = await stack.post("/v1/completions", COMPLETION, headers=headers)
        assert got == status, body
    assert "authorization" not in stack.pods[0].headers[0]  # the gateway's key stays at the gateway


async def test_a_keys_priority_reaches_the_router_which_may_shed_below_zero(start, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-spare, name: spare, priority: -1}\n  - {key: sk-user, name: user}\n")
    stack = await start(["ok"], auth={"keys_file": str(keys)})
    for key in ("sk-spare", "sk-user"):
        status, _, _ = await stack.post("/v1/completions", COMPLETION, headers={"Authorization": f"Bearer {key}"})
        assert status == 200
    assert [r.priority for r in stack.router.scheduled] == [-1, 0]


async def test_the_openai_client_works(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"])
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    try:
        assert [m.id async for m in client.models.list()] == [MODEL]
        done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert done.choices[0].text == "from pod0"
        chunks = [c.choices[0].text async for c in await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, stream=True)]
        assert chunks == ["pod0-0 ", "pod0-1 ", "pod0-2 "]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="hi")
    finally:
        await client.close()


async def test_sidecar_runs_prefill_named_by_the_header_then_decodes_locally(stacks) -> None:  # type: ignore[no-untyped-def]
    from kvflow.gateway.server import listen
    from kvflow.sidecar.server import Sidecar

    local, prefiller = FakePod("local"), FakePod("prefill")
    await local.start("127.0.0.2")
    await prefiller.start("127.0.0.9")
    assert local.endpoint and prefiller.endpoint
    sidecar = Sidecar(GatewayConfig(sidecar={"prefillers": [prefiller.endpoint.host]}), local.endpoint)
    server, port = await listen(sidecar.handle, "127.0.0.1", 0, 1 << 20)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            headers = {"x-prefiller-host-port": prefiller.endpoint.id, "X-Request-Id": "sc-1"}
            async with session.post(url + "/v1/completions", json={**COMPLETION, "stream": True},
                                    headers=headers) as r:
                text = await r.text()
            async with session.post(url + "/v1/completions", json=COMPLETION) as r:
                plain = await r.json()
            async with session.get(url + "/v1/models") as r:
                passed_status = r.status
    finally:
        server.close()
        await sidecar.upstream.stop()
        await local.stop()
        await prefiller.stop()
    assert "local-2" in text and text.endswith("data: [DONE]\n\n")
    assert prefiller.received[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert local.received[0]["kv_transfer_params"]["remote_engine_id"] == "engine-prefill"
    assert [h["x-request-id"] for h in prefiller.headers + local.headers[:1]] == ["sc-1", "sc-1"]
    assert plain["choices"][0]["text"] == "from local" and "kv_transfer_params" not in local.received[1]
    assert passed_status == 404  # the fake pod has no /v1/models: its answer passes through
    assert sidecar.counts == {"pd": 1, "pd_fallback": 0, "passthrough": 2}


async def test_a_saturated_model_sheds_with_429_and_retry_after(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["hang"], flow={"max_inflight": 1, "max_queue": 0})
    async with stack.session.post(stack.url + "/v1/completions", json={**COMPLETION, "stream": True}) as first:
        assert (await first.content.readline()).startswith(b"data: ")
        status, body, headers = await stack.post("/v1/completions", COMPLETION)
        assert (status, body["error"]["type"], headers["Retry-After"]) == (429, "RateLimitError", "1")
        first.close()


async def test_per_key_rate_limits(start, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-slow, name: slow, rate: 0.001, burst: 2}\n  - {key: sk-free, name: free}\n")
    stack = await start(["ok"], auth={"keys_file": str(keys)})
    statuses = [(await stack.post("/v1/completions", COMPLETION, headers={"Authorization": f"Bearer {k}"}))[0]
                for k in ("sk-slow", "sk-slow", "sk-slow", "sk-free")]
    assert statuses == [200, 200, 429, 200]


async def test_a_lora_adapter_is_served_by_its_base_models_pool(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"], loras=["tiny-sql"])
    status, body, _ = await stack.post("/v1/completions", {**COMPLETION, "model": "tiny-sql"})
    assert (status, stack.pods[0].received[0]["model"]) == (200, "tiny-sql")  # forwarded as sent
    assert [(r.model, r.lora) for r in stack.router.scheduled] == [(MODEL, "tiny-sql")]
    async with stack.session.get(stack.url + "/v1/models") as r:
        listed = [(m["id"], m["parent"]) for m in (await r.json())["data"]]
    assert listed == [(MODEL, None), ("tiny-sql", MODEL)]


async def test_timeouts_first_byte_retries_and_idle_ends_the_stream(start) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["stall", "hang"], timeouts={"first_byte": 0.3, "idle": 0.3})
    status, text, _ = await stack.post("/v1/completions", {**COMPLETION, "stream": True})
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert status == 200
    assert json.loads(events[0])["choices"][0]["text"] == "pod1-0 "  # pod0 never answered: retried
    assert json.loads(events[1])["error"]["type"] == "BadGatewayError"  # pod1 went silent mid-stream
    metrics = (await (await stack.session.get(stack.url + "/metrics")).read()).decode()
    assert f'kvflow_gateway_retries_total{{model="{MODEL}",reason="timeout"}} 1.0' in metrics
    assert f'kvflow_gateway_failures_total{{model="{MODEL}",reason="midstream"}} 1.0' in metrics


async def test_access_log_has_one_json_line_per_request(start, caplog) -> None:  # type: ignore[no-untyped-def]
    stack = await start(["ok"])
    with caplog.at_level("INFO", logger="kvflow.gateway.access"):
        for rid in ("log-1", "log-2"):
            assert (await stack.post("/v1/completions", COMPLETION, headers={"X-Request-Id": rid}))[0] == 200
        stack.gateway.gateway.close()  # lines are written in batches; closing flushes them
    lines = [json.loads(line) for r in caplog.records if r.name == "kvflow.gateway.access"
             for line in r.getMessage().splitlines()]
    assert [(x["request_id"], x["status"], x["mode"], x["upstream"], x["error"]) for x in lines] == [
        ("log-1", 200, "aggregated", stack.pods[0].endpoint.id, None),
        ("log-2", 200, "aggregated", stack.pods[0].endpoint.id, None)]
    assert list(lines[0]) == ["ts", "request_id", "path", "model", "key", "status", "mode", "upstream", "prefill",
                              "retries", "ttft_ms", "duration_ms", "error"]
