"""The gateway's fast checks are generated from kvflow.openai_api's models and never accept more.

A msgspec struct is generated from each pydantic model; the fast path may only accept a body
pydantic accepts (anything else goes to pydantic, which decides). Every field of each model is
tried with a value of every JSON type. The vLLM corpus (tests/conformance/test_request_validation.py)
pins that the gateway's refusals are vLLM's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.validation import fast_accepts, slow_fields, struct_for, validate
from kvflow.openai_api import ChatCompletionRequest, CompletionRequest
from kvflow.openai_api import validate as validate_with_pydantic

M = {"model": "m"}
BASE = {"completions": {**M, "prompt": "x"}, "chat": {**M, "messages": [{"role": "user", "content": "hi"}]}}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
VALUES: list[Any] = [None, True, False, 0, 1, -1, 2.5, 2**64, 2**70, "x", "", [], [1], [-1], ["a"], [""], [[1]],
                     [1, "a"], {}, {"a": 1}, {"include_usage": True}, {"role": "user", "content": "hi"},
                     [{"role": "user", "content": "hi"}], [{"role": "user"}], [{"role": 1, "content": "x"}]]


def _pydantic_accepts(kind: str, body: dict[str, Any]) -> bool:
    try:
        validate_with_pydantic(kind, body)  # type: ignore[arg-type]
    except InvalidRequestError:
        return False
    return True


def _fast(kind: str, body: dict[str, Any]) -> bool:
    try:
        return fast_accepts(kind, body)
    except InvalidRequestError:
        return False


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_struct_has_every_field_of_the_model(kind: str) -> None:
    fields = [f.name for f in msgspec.structs.fields(struct_for(MODELS[kind]))]
    assert fields == list(MODELS[kind].model_fields)


def test_only_fields_msgspec_cannot_express_go_to_pydantic() -> None:
    assert slow_fields(CompletionRequest) == {"prompt", "prompt_embeds"}  # a union of two list types; bytes
    assert slow_fields(ChatCompletionRequest) == {"top_logprobs"}  # a validator maps null to 0


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_fast_path_never_accepts_what_pydantic_refuses(kind: str) -> None:
    accepted_fast = 0
    for field in MODELS[kind].model_fields:
        for value in VALUES:
            body = {**BASE[kind], field: value}
            if _fast(kind, body):
                accepted_fast += 1
                assert _pydantic_accepts(kind, body), (field, value)
    assert accepted_fast > 100  # the fast path is in use, not a dead branch


@pytest.mark.parametrize("body", [
    {**M, "prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
    {**M, "prompt": [[1, 2], [3]], "n": 2, "stop": ["a"], "kv_transfer_params": {"do_remote_decode": True}},
    {**M, "prompt": ["a", "b"], "seed": 2**62, "vendor_extension": {"a": 1}},
])
def test_usual_completions_take_the_fast_path(body: dict[str, Any]) -> None:
    assert fast_accepts("completions", body)


def test_usual_chats_take_the_fast_path() -> None:
    body = {**BASE["chat"], "max_completion_tokens": 3, "logprobs": True, "messages": [
        {"role": "system", "content": "s", "name": "x"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None}]}
    assert fast_accepts("chat", body)


@pytest.mark.parametrize(("kind", "body"), [
    ("completions", {**M, "prompt": "x", "max_tokens": "4"}),  # pydantic coerces; msgspec strict does not
    ("completions", {**M, "prompt": [True]}),
    ("chat", {**BASE["chat"], "top_logprobs": None, "logprobs": True}),
    ("chat", {**M, "messages": [{"role": "user", "content": None}]}),
    ("completions", {**M, "prompt": "x", "stream_options": {"include_usage": True}}),
])
def test_the_slow_path_decides_what_the_fast_path_does_not(kind: str, body: dict[str, Any]) -> None:
    def outcome(check: Any) -> Any:
        try:
            check(kind, body)
        except InvalidRequestError as exc:
            return exc.type, exc.message, exc.param
        return "ok"

    assert outcome(validate) == outcome(validate_with_pydantic)
