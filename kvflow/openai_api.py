"""The OpenAI request bodies kvflow accepts, validated with pydantic at the edge.

Both the simulator and the gateway parse requests here, so a malformed body gets the same
400 wherever it lands. Unknown fields are kept (vLLM accepts many extensions, and the gateway
forwards bodies untouched).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvflow.errors import InvalidRequestError

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


Endpoint = Literal["completions", "chat"]
_MODELS: dict[str, type[_Common]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says why not."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


def validate(kind: Endpoint, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    """A typed request, or a 400 naming the first offending field."""
    try:
        return _MODELS[kind].model_validate(body)  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequestError(f"{where}: {first['msg']}", param=where) from None


def parse_request(kind: Endpoint, raw: bytes) -> CompletionRequest | ChatCompletionRequest:
    return validate(kind, decode_json(raw))
