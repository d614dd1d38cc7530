"""The OpenAI body checks of ``kvflow.openai_api``, fast on the gateway's data path.

``kvflow.openai_api.validate`` (pydantic) is the rule: a body is accepted exactly when it
accepts it, and a rejected body gets its 400. Building its model costs a few µs per request
that the gateway, which forwards the original bytes, does not otherwise need. So the usual body
is first checked against msgspec structs with the same fields and bounds, in strict mode:
whatever they accept pydantic accepts too (strict is the narrower of the two). Anything else,
including everything pydantic would coerce or reject, goes to pydantic, which decides.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvflow.openai_api import validate as validate_with_pydantic

_Positive = Annotated[int, Meta(ge=1)]
_NonNegative = Annotated[int, Meta(ge=0)]


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct):
    model: str
    max_tokens: _Positive | None = None
    min_tokens: _NonNegative = 0
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: float | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class _Completion(_Common, kw_only=True):
    prompt: Any  # str | list[str] | token ids | lists of token ids: checked below
    echo: bool = False
    logprobs: int | None = None


class _Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class _Chat(_Common, kw_only=True):
    messages: Annotated[list[_Message], Meta(min_length=1)]
    max_completion_tokens: _Positive | None = None


_STRUCTS: dict[str, type[_Common]] = {"completions": _Completion, "chat": _Chat}


def _token_ids(items: list[Any]) -> bool:
    return all(type(t) is int and t >= 0 for t in items)


def _plain_prompt(prompt: Any) -> bool:
    """A prompt of the accepted shapes, in the plainest types (anything else: pydantic decides)."""
    if type(prompt) is str:
        return True
    if type(prompt) is not list or not prompt:
        return False
    first = type(prompt[0])
    if first is str:
        return all(type(p) is str for p in prompt)
    if first is int:
        return _token_ids(prompt)
    return all(type(p) is list and _token_ids(p) for p in prompt)


def validate(kind: str, body: dict[str, Any]) -> None:
    """Nothing when ``kvflow.openai_api.validate(kind, body)`` accepts the body; its 400 otherwise."""
    try:
        checked = msgspec.convert(body, _STRUCTS[kind], strict=True)
    except msgspec.ValidationError:
        checked = None
    if checked is not None and (kind == "chat" or _plain_prompt(checked.prompt)):  # type: ignore[attr-defined]
        return
    validate_with_pydantic(kind, body)  # type: ignore[arg-type]
