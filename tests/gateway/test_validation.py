"""The gateway's fast body checks accept exactly what kvflow.openai_api (pydantic) accepts, and
reject with its 400."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.validation import validate
from kvflow.openai_api import validate as validate_with_pydantic

M = {"model": "m"}
CHAT = {**M, "messages": [{"role": "user", "content": "hi"}]}
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("completions", {**M, "prompt": "x"}),
    ("completions", {**M, "prompt": ["a", "b"]}),
    ("completions", {**M, "prompt": [1, 2, 0]}),
    ("completions", {**M, "prompt": [[1, 2], [3]]}),
    ("completions", {**M, "prompt": []}),
    ("completions", {**M, "prompt": [-1]}),
    ("completions", {**M, "prompt": [[-1]]}),
    ("completions", {**M, "prompt": [1, "a"]}),
    ("completions", {**M, "prompt": [True]}),
    ("completions", {**M, "prompt": None}),
    ("completions", {**M, "prompt": 3}),
    ("completions", M),
    ("completions", {"prompt": "x"}),
    ("completions", {"model": 3, "prompt": "x"}),
    ("completions", {**M, "prompt": "x", "max_tokens": 4, "temperature": 0, "top_p": 1, "seed": 2**70,
                     "stream": True, "stream_options": {"include_usage": True, "x": 1}, "stop": ["a"],
                     "kv_transfer_params": {"do_remote_decode": True}, "vendor": {"a": 1}}),
    ("completions", {**M, "prompt": "x", "max_tokens": 0}),
    ("completions", {**M, "prompt": "x", "max_tokens": "4"}),
    ("completions", {**M, "prompt": "x", "max_tokens": True}),
    ("completions", {**M, "prompt": "x", "max_tokens": 4.0}),
    ("completions", {**M, "prompt": "x", "max_tokens": None}),
    ("completions", {**M, "prompt": "x", "n": 2}),
    ("completions", {**M, "prompt": "x", "n": None}),
    ("completions", {**M, "prompt": "x", "temperature": -0.5}),
    ("completions", {**M, "prompt": "x", "stream": "yes"}),
    ("completions", {**M, "prompt": "x", "stream": 1}),
    ("completions", {**M, "prompt": "x", "stream_options": {"include_usage": "no"}}),
    ("completions", {**M, "prompt": "x", "stop": [1]}),
    ("completions", {**M, "prompt": "x", "min_tokens": -1}),
    ("completions", {**M, "prompt": "x", "kv_transfer_params": [1]}),
    ("chat", CHAT),
    ("chat", {**CHAT, "max_completion_tokens": 3, "messages": [{"role": "system", "content": None, "name": "s"},
                                                               {"role": "user", "content": [{"type": "text"}]}]}),
    ("chat", {**CHAT, "max_completion_tokens": 0}),
    ("chat", {**M, "messages": []}),
    ("chat", M),
    ("chat", {**M, "messages": [{"role": "robot", "content": "x"}]}),
    ("chat", {**M, "messages": [{"content": "x"}]}),
    ("chat", {**M, "messages": [{"role": "user", "content": 5}]}),
    ("chat", {**M, "messages": "hi"}),
]


def _verdict(check: Any, kind: str, body: dict[str, Any]) -> tuple[str, str | None]:
    try:
        check(kind, body)
    except InvalidRequestError as exc:
        return str(exc), exc.param
    return "ok", None


@pytest.mark.parametrize(("kind", "body"), BODIES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BODIES)])
def test_accepts_and_rejects_exactly_as_pydantic(kind: str, body: dict[str, Any]) -> None:
    assert _verdict(validate, kind, body) == _verdict(validate_with_pydantic, kind, body)
