"""OpenAI API conformance: response bodies, SSE framing and errors, against real vLLM's capture.

Shapes (the keys at every level, in order, and each value's JSON type) must equal those in
tests/golden/vllm_responses.json; errors must match byte for byte apart from the model name.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from .targets import Target, golden

GOLDEN = golden("vllm_responses.json")


def shape(value: Any) -> Any:
    """Keys in order and JSON types, recursively; list items by their first element."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def call(target: Target, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, str, bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(target.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    return [block.removeprefix("data: ") for block in text[:-2].split("\n\n")]


def completion_body(target: Target, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "prompt": "The quick brown fox", "max_tokens": 5, **extra}


def chat_body(target: Target, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 3, **extra}


def test_completion_body_has_vllms_shape(target: Target) -> None:
    status, ctype, raw = call(target, "/v1/completions", completion_body(target))
    body = json.loads(raw)
    assert (status, ctype) == (200, "application/json")
    assert shape(body) == shape(GOLDEN["completion"])
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", body["id"])
    usage = body["usage"]
    assert (usage["completion_tokens"], body["choices"][0]["finish_reason"]) == (5, "length")
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["system_fingerprint"].startswith("vllm-0.32.0-")


def test_chat_body_has_vllms_shape(target: Target) -> None:
    status, _, raw = call(target, "/v1/chat/completions", chat_body(target))
    body = json.loads(raw)
    assert status == 200
    assert shape(body) == shape(GOLDEN["chat_completion"])
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"])
    assert (body["choices"][0]["message"]["role"], body["usage"]["completion_tokens"]) == ("assistant", 3)


def test_token_id_prompts_count_exactly(target: Target) -> None:
    _, _, raw = call(target, "/v1/completions", {"model": target.model, "prompt": [5, 6, 7, 8], "max_tokens": 2})
    assert json.loads(raw)["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2,
                                        "prompt_tokens_details": None, "completion_tokens_details": None}


@pytest.mark.parametrize(("path", "make", "golden_key"), [
    ("/v1/completions", completion_body, "stream_completion"),
    ("/v1/chat/completions", chat_body, "stream_chat"),
])
def test_streams_with_usage_match_vllms_chunks(target: Target, path: str, make: Any, golden_key: str) -> None:
    status, ctype, raw = call(target, path, make(target, stream=True, stream_options={"include_usage": True}))
    want = sse_events(GOLDEN[golden_key]["raw"].encode())
    got = sse_events(raw)
    assert (status, ctype) == (200, GOLDEN[golden_key]["content_type"])
    assert got[-1] == want[-1] == "[DONE]"
    got_chunks, want_chunks = [json.loads(c) for c in got[:-1]], [json.loads(c) for c in want[:-1]]
    # first chunk, a middle token chunk, the finishing chunk and the usage chunk line up in shape
    for i in (0, 1, -2, -1):
        assert shape(got_chunks[i]) == shape(want_chunks[i]), i
    assert len({c["id"] for c in got_chunks}) == 1
    assert got_chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = got_chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_stream_without_usage_ends_with_a_fingerprinted_chunk(target: Target) -> None:
    _, _, raw = call(target, "/v1/completions", completion_body(target, stream=True, max_tokens=3))
    chunks = [json.loads(c) for c in sse_events(raw)[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert [("usage" in c, "system_fingerprint" in c) for c in chunks] == [(False, False), (False, False),
                                                                           (False, True)]
    assert "".join(c["choices"][0]["text"] for c in chunks) != ""


def test_models_lists_the_served_name(target: Target) -> None:
    status, _, raw = call(target, "/v1/models")
    body = json.loads(raw)
    assert status == 200
    assert shape(body) == shape(GOLDEN["models"])
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [(target.model, target.max_model_len)]


def _expected_error(key: str, target: Target) -> tuple[int, dict[str, Any]]:
    entry = GOLDEN[key]
    text = json.dumps(entry["body"]).replace("tiny-llama", target.model)
    return entry["status"], json.loads(text)


@pytest.mark.parametrize(("key", "path", "raw"), [
    ("error_malformed_json", "/v1/completions", b"{bad"),
    ("error_missing_field", "/v1/completions", b'{"model": "tiny-llama"}'),
    ("error_bad_field", "/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}'),
    ("error_unknown_model", "/v1/completions", b'{"model": "nope", "prompt": "x"}'),
    ("error_chat_unknown_model", "/v1/chat/completions",
     b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}'),
])
def test_errors_are_vllms_exactly(target: Target, key: str, path: str, raw: bytes) -> None:
    status, ctype, body = call(target, path, raw=raw)
    assert (status, json.loads(body)) == _expected_error(key, target)
    assert ctype == "application/json"


def test_a_too_long_text_prompt_is_vllms_400(target: Target) -> None:
    prompt = " ".join(["hello"] * (target.max_model_len * 2))
    status, _, body = call(target, "/v1/completions", {"model": target.model, "prompt": prompt, "max_tokens": 1})
    assert (status, json.loads(body)) == _expected_error("error_too_long", target)


@pytest.mark.parametrize(("path", "status", "body"), [
    ("/health", 200, b""),
    ("/version", 200, b'{"version":"0.32.0"}'),
])
def test_health_and_version(target: Target, path: str, status: int, body: bytes) -> None:
    got_status, _, got = call(target, path)
    assert (got_status, got) == (status, body)


def test_unknown_routes_are_fastapis_404(target: Target) -> None:
    status, _, body = call(target, "/v1/nothing-here")
    assert (status, json.loads(body)) == (404, {"detail": "Not Found"})


def test_a_stop_string_never_reaches_the_client(target: Target) -> None:
    fixed = {"max_tokens": 3, "seed": 7, "temperature": 0.0}  # the same output every time
    _, _, raw = call(target, "/v1/completions", completion_body(target, **fixed))
    first_word = json.loads(raw)["choices"][0]["text"][:3]
    body = completion_body(target, **fixed, stop=[first_word])
    _, _, plain = call(target, "/v1/completions", body)
    _, _, streamed = call(target, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(c) for c in sse_events(streamed)[:-1]]
    assert json.loads(plain)["choices"][0]["finish_reason"] == "stop"
    assert first_word not in "".join(c["choices"][0]["text"] for c in chunks)
