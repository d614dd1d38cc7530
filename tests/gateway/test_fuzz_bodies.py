"""Property: whatever body a client sends to ``/v1/completions`` or ``/v1/chat/completions``, the
gateway (as a process, with the real router in front of a simulated pod) answers 2xx, or 4xx in
OpenAI's error shape. Never a 5xx, never a traceback, never a hang."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

MODEL = "sim-model"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=40) | st.integers()
text_prompt = st.text(max_size=60)
token_prompt = st.lists(st.integers(min_value=-5, max_value=2**40), max_size=30)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "nobody"]) | st.text(max_size=5)},
    optional={"content": text_prompt | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": text_prompt}), max_size=2) | json_values, "name": st.text(max_size=5)},
)
common = {
    "model": st.just(MODEL) | st.text(max_size=10) | json_values,
    "max_tokens": small_ints | json_values,
    "min_tokens": small_ints,
    "temperature": st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=3) | json_values,
    "top_p": st.floats(allow_nan=False, min_value=-1, max_value=2),
    "n": small_ints,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | json_values,
    "seed": small_ints,
    "ignore_eos": st.booleans(),
    "logprobs": small_ints | st.booleans(),
    "priority": small_ints,
    "cache_salt": st.text(max_size=8) | json_values,
    "kv_transfer_params": json_values,
    "user": st.text(max_size=8),
    "vllm_xargs": json_values,
    "unknown_field": json_values,
}
completion_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={**{k: v for k, v in common.items() if k != "model"},
              "prompt": text_prompt | token_prompt | st.lists(text_prompt, max_size=3)
              | st.lists(token_prompt, max_size=3) | json_values, "echo": st.booleans()},
) | st.fixed_dictionaries({}, optional={**common, "prompt": json_values})
chat_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={**{k: v for k, v in common.items() if k != "model"},
              "messages": st.lists(message, max_size=4) | json_values,
              "max_completion_tokens": small_ints},
) | st.fixed_dictionaries({}, optional={**common, "messages": json_values})
raw_bodies = st.binary(max_size=200) | st.text(max_size=200).map(str.encode)


def check(conn: http.client.HTTPConnection, path: str, body: bytes) -> None:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert response.status < 500, (response.status, body, data)
    if response.status >= 400:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status, data
        assert "Traceback" not in error["message"]


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def test_every_body_gets_a_2xx_or_an_openai_4xx(sim_pods: Any, tmp_path: Path) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--max-model-len", "256")
    port = free_port()
    with ProcessGroup(tmp_path / "logs") as group:
        gateway = group.start("gateway", kvflow_argv(
            "gateway", "--port", str(port), "--model", MODEL, "--endpoint", pod.id, "--log-level", "WARNING"),
            ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(60, [gateway])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

        @FUZZ
        @given(body=completion_bodies)
        def completions(body: dict[str, Any]) -> None:
            check(conn, "/v1/completions", json.dumps(body).encode())

        @FUZZ
        @given(body=chat_bodies)
        def chat(body: dict[str, Any]) -> None:
            check(conn, "/v1/chat/completions", json.dumps(body).encode())

        @FUZZ
        @given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
        def raw(raw: bytes, path: str) -> None:
            check(conn, path, raw)

        completions()
        chat()
        raw()
        conn.close()
        assert "Traceback" not in gateway.log_tail(400)
