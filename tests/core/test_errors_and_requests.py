"""Bad requests become OpenAI-shaped 4xx errors that name the problem."""

import pytest

from kvflow.errors import ModelNotFoundError, RateLimitError, from_exception
from kvflow.openai_api import parse_request


@pytest.mark.parametrize(
    ("kind", "raw", "type_", "message", "param"),
    [
        ("completions", b"{", "Bad Request", "1 validation error:\n  {'type': 'json_invalid'", "body.1"),
        ("completions", b"[1]", "Bad Request", "1 validation error:\n  {'type': 'model_attributes_type'", "body"),
        ("completions", b'{"model": "m", "prompt": "x", "max_tokens": "many"}', "Bad Request",
         "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens'", "body.max_tokens"),
        ("completions", b'{"model": "m", "prompt": ""}', "BadRequestError",
         "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"),
        ("chat", b'{"model": "m", "messages": "hi"}', "Bad Request",
         "1 validation error:\n  {'type': 'list_type', 'loc': 'body.messages'", "body.messages"),
        ("chat", b'{"messages": [], "stream_options": {"include_usage": true}}', "BadRequestError",
         "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options"),
    ],
    ids=["malformed", "not-object", "bad-type", "empty-prompt", "messages-not-a-list", "stream-options-alone"],
)
def test_bad_requests_are_vllms_400(kind, raw, type_, message, param):
    with pytest.raises(Exception) as info:
        parse_request(kind, raw)
    err = from_exception(info.value)
    body = err.body()["error"]
    assert (err.status, body["type"], body["code"], body["param"]) == (400, type_, 400, param)
    assert body["message"].startswith(message)


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        ("completions", b'{"prompt": "x"}'),
        ("completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}'),
        ("chat", b'{"model": "m", "messages": []}'),
        ("chat", b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}'),
    ],
    ids=["no-model", "zero-tokens", "no-messages", "any-role"],
)
def test_what_vllm_decides_after_the_schema_passes_it(kind, raw):
    """No model means the server's default; the rest the model server refuses (or the template accepts)."""
    assert parse_request(kind, raw) is not None


def test_extensions_are_kept_for_forwarding():
    req = parse_request("completions", b'{"model": "m", "prompt": [1], "kv_transfer_params": {"do_remote_decode": true}, "x": 1}')
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert req.model_extra == {"x": 1}


def test_unknown_model_and_rate_limit_shapes():
    assert ModelNotFoundError("nope").body() == {
        "error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert RateLimitError("slow down", retry_after=2.4).headers() == {"Retry-After": "2"}


def test_unexpected_exceptions_hide_their_details():
    err = from_exception(KeyError("secret"))
    assert err.status == 500 and "secret" not in err.message
