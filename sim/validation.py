"""Request validation with vLLM's own error messages, so a client cannot tell sim from vLLM.

vLLM (FastAPI) reports body problems as ``"type": "Bad Request"`` with pydantic's error dicts in
the message and the field path (``body.<field>``) as ``param``; its own checks use
``BadRequestError`` and end the message with ``(parameter=..., value=...)``. Everything here
raises kvflow's error tree, so the server's one middleware renders it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kvflow.errors import InvalidRequestError, KvflowError
from kvflow.openai_api import ChatCompletionRequest, CompletionRequest


class RequestValidationError(InvalidRequestError):
    """FastAPI's 400 for a body that is not JSON or does not fit the schema."""

    type = "Bad Request"


class UnknownModelError(KvflowError):
    status = 404
    type = "NotFoundError"


def _summarise(value: Any) -> Any:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    return value


def _fastapi_message(errors: Sequence[dict[str, Any]]) -> str:
    n = len(errors)
    lines = [f"{n} validation error{'s' if n != 1 else ''}:"]
    lines += [f"  {err!r}" for err in errors]
    return "\n".join(lines)


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        pos = getattr(exc, "pos", 0)
        msg = getattr(exc, "msg", str(exc))
        err = {"type": "json_invalid", "loc": f"body.{pos}", "msg": "JSON decode error", "input": "<dict of 0 items>",
               "ctx": {"error": msg}}
        raise RequestValidationError(_fastapi_message([err]), param=f"body.{pos}") from None
    if not isinstance(body, dict):
        err = {"type": "model_attributes_type", "loc": "body", "msg": "Input should be a valid dictionary or object "
               "to extract fields from", "input": _summarise(body)}
        raise RequestValidationError(_fastapi_message([err]), param="body")
    return body


def validate(chat: bool, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    if not chat and not body.get("prompt"):
        raise InvalidRequestError(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", param="prompt")
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = []
        for e in exc.errors(include_url=False):
            err = {"type": e["type"], "loc": ".".join(["body", *map(str, e["loc"])]), "msg": e["msg"],
                   "input": _summarise(e.get("input"))}
            if e.get("ctx"):
                err["ctx"] = {k: str(v) for k, v in e["ctx"].items()}
            errors.append(err)
        raise RequestValidationError(_fastapi_message(errors), param=errors[0]["loc"]) from None


def unknown_model(model: str, aliases: Sequence[str]) -> UnknownModelError:
    return UnknownModelError(f"The model `{model}` does not exist. Valid aliases: {', '.join(aliases)}.", param="model")


def check_prompt_length(num_tokens: int, max_model_len: int, *, from_text: bool) -> None:
    """vLLM's check: a prompt must leave room for at least one output token.

    vLLM tokenizes text with truncation at ``max_model_len + 1`` tokens, so an over-long text
    prompt always reports "at least max_model_len + 1".
    """
    if num_tokens < max_model_len:
        return
    count = min(num_tokens, max_model_len + 1) if from_text else num_tokens
    qualifier = "at least " if count == max_model_len + 1 else ""
    raise InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
        f"Please reduce the length of the input prompt. (parameter=input_tokens, value={count})",
        param="input_tokens",
    )
