"""Bad requests become OpenAI-shaped 4xx errors that name the problem."""

import pytest

from kvflow.errors import ModelNotFoundError, RateLimitError, from_exception
from kvflow.openai_api import parse_request


@pytest.mark.parametrize(
    ("kind", "raw", "message"),
    [
        ("completions", b"{", "request body is not valid JSON"),
        ("completions", b"[1]", "request body must be a JSON object"),
        ("completions", b'{"prompt": "x"}', "model: Field required"),
        ("completions", b'{"model": "m", "prompt": "x", "max_tokens": "many"}', "max_tokens: "),
        ("completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens: "),
        ("chat", b'{"model": "m", "messages": []}', "messages: List should have at least 1 item"),
        ("chat", b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role: "),
    ],
    ids=["malformed", "not-object", "no-model", "bad-type", "zero-tokens", "no-messages", "bad-role"],
)
def test_bad_requests_are_400_with_the_field_named(kind, raw, message):
    with pytest.raises(Exception) as info:
        parse_request(kind, raw)
    err = from_exception(info.value)
    assert err.status == 400
    body = err.body()["error"]
    assert body["type"] == "BadRequestError" and body["code"] == 400
    assert body["message"].startswith(message)


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
