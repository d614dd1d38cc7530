"""The OpenAI request bodies vLLM 0.32 accepts: the one definition the gateway and simulator share.

The models mirror vLLM's own (``vllm/entrypoints/openai/completion/protocol.py``,
``.../chat_completion/protocol.py``, ``vllm/entrypoints/serve/tokenize/protocol.py``): the same
fields in the same order with the same types, so pydantic reports the same errors, and the same
``mode="before"`` checks, run in the order pydantic runs vLLM's (last defined first). Unknown
fields are kept, as vLLM keeps them. A few deeply nested vLLM types (tools, structured outputs,
response formats, the message union) are declared loosely: they accept what vLLM accepts, but a
malformed one gets pydantic's message for the loose type (docs/simulator.md lists these).

Errors leave in vLLM's two shapes (``kvflow.errors`` renders both):

* ``RequestValidationError`` — FastAPI's 400 for a body that is not JSON or does not fit the
  schema: ``"type": "Bad Request"``, pydantic's error dicts in the message, the first error's
  field path as ``param`` (vLLM's ``validation_exception_handler``);
* ``VllmValidationError`` — vLLM's own checks: ``BadRequestError``, the message ending with
  ``(parameter=..., value=...)`` as ``VLLMValidationError.__str__`` writes it.

gateway/validation.py generates its fast-path validator from these models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from kvflow.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
DEFAULT_COMPLETION_MAX_TOKENS = 16


# -- errors --------------------------------------------------------------------------------
class VllmValidationError(InvalidRequestError):
    """vLLM's ``VLLMValidationError``: the message names the parameter and value it rejects."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


class RequestValidationError(InvalidRequestError):
    """FastAPI's 400 for a body that is not JSON or does not fit the schema, as vLLM renders it."""

    type = "Bad Request"

    @classmethod
    def from_errors(cls, errors: Sequence[dict[str, Any]]) -> RequestValidationError:
        """``errors``: pydantic's error dicts, ``loc`` already starting with ``"body"``."""
        count = len(errors)
        label = "error" if count == 1 else "errors"
        lines = [f"{count} validation {label}:"] + [f"  {_format_error(e)}" for e in errors[:_MAX_REPORTED_ERRORS]]
        if count > _MAX_REPORTED_ERRORS:
            lines.append(f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}")
        param = clean_loc(tuple(errors[0]["loc"])) if errors else None
        return cls(sanitize_message("\n".join(lines)), param=param)


_MAX_REPORTED_ERRORS, _MAX_ERROR_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype",
})


def clean_loc(loc: tuple[Any, ...]) -> str:
    """A pydantic ``loc`` as vLLM's ``param``: union-branch and wrapper markers dropped."""
    parts = [str(p) for p in loc if not (_BRACKETED.search(str(p)) or str(p).lower() in _INTERNAL_LOC)]
    return ".".join(parts or [str(p) for p in loc])


def _summarize_input(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def _format_error(err: dict[str, Any]) -> str:
    err = dict(err)
    if "input" in err:
        err["input"] = _summarize_input(err["input"])
    err["loc"] = clean_loc(tuple(err["loc"]))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize_message(message: str) -> str:
    """vLLM strips addresses, tracebacks and file paths from every error message."""
    for pattern, repl in _SANITIZE:
        message = pattern.sub(repl, message)
    return message.strip()


def decode_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or FastAPI's 400 for one that is not JSON or not an object."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        pos = getattr(exc, "pos", 0)
        err = {"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error", "input": {},
               "ctx": {"error": getattr(exc, "msg", str(exc))}}
        raise RequestValidationError.from_errors([err]) from None
    if not isinstance(body, dict):
        raise _not_an_object(body)
    return body


def _not_an_object(body: Any) -> RequestValidationError:
    return RequestValidationError.from_errors([{
        "type": "model_attributes_type", "loc": ("body",),
        "msg": "Input should be a valid dictionary or object to extract fields from", "input": body}])


# -- vLLM's mode="before" checks, on the raw body ---------------------------------------------
Check = Callable[[dict[str, Any]], None]


def reads(*keys: str) -> Callable[[Check], Check]:
    """Mark a check as a no-op on a body with none of ``keys``, so it is skipped there."""
    def mark(check: Check) -> Check:
        check.reads = frozenset(keys)  # type: ignore[attr-defined]
        return check
    return mark


def run_checks(checks: tuple[Check, ...], data: dict[str, Any]) -> None:
    """The checks in order, skipping those that read no key of this body."""
    keys = data.keys()
    for needs, check in _plan(checks):
        if needs is None or not needs.isdisjoint(keys):
            check(data)


@lru_cache(maxsize=16)
def _plan(checks: tuple[Check, ...]) -> tuple[tuple[frozenset[str] | None, Check], ...]:
    return tuple((getattr(c, "reads", None), c) for c in checks)


@reads("cache_salt")
def check_cache_salt(data: dict[str, Any]) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise VllmValidationError("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  parameter="cache_salt")
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise VllmValidationError("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                  "'@', '/', '\\\\', or NUL.", parameter="cache_salt")


@reads("response_format")
def check_response_format(data: dict[str, Any]) -> None:
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise VllmValidationError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                  "provided.", parameter="response_format")


def _structured_output_kinds(data: dict[str, Any]) -> int:
    so = data.get("structured_outputs")
    return sum(so.get(k) is not None for k in ("json", "regex", "choice")) if isinstance(so, dict) else 0


_ONE_KIND = "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."


@reads("structured_outputs")
def check_structured_outputs(data: dict[str, Any]) -> None:
    if _structured_output_kinds(data) > 1:
        raise VllmValidationError(_ONE_KIND, parameter="structured_outputs")


@reads("structured_outputs")
def check_chat_structured_outputs(data: dict[str, Any]) -> None:
    kinds = _structured_output_kinds(data)
    if kinds > 1:
        raise VllmValidationError(_ONE_KIND)
    if kinds and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise VllmValidationError("You can only either use constraints for structured outputs or tools, not both.")


def _check_logprob_counts(data: dict[str, Any], top: str) -> None:
    """The shared tail of vLLM's two ``check_logprobs``: ``top`` is ``logprobs`` or ``top_logprobs``."""
    for name in ("prompt_logprobs", top):
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise VllmValidationError(f"`{name}` must be an integer.", parameter=name, value=value)
    if (prompt_logprobs := data.get("prompt_logprobs")) is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise VllmValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise VllmValidationError("`prompt_logprobs` must be a positive value or -1.",
                                      parameter="prompt_logprobs", value=prompt_logprobs)
    value = data.get(top)
    if value is not None and value < 0 and value != -1:
        raise VllmValidationError(f"`{top}` must be a positive value or -1.", parameter=top, value=value)


@reads("logprob_token_ids", "use_beam_search", "echo", "logprobs", "prompt_logprobs")
def check_completion_logprobs(data: dict[str, Any]) -> None:
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise VllmValidationError("`logprob_token_ids` is not supported with beam search.",
                                  parameter="logprob_token_ids")
    if data.get("use_beam_search") and data.get("echo") and data.get("logprobs") is not None:
        raise VllmValidationError("`echo` with `logprobs` is not supported with beam search because beam search "
                                  "does not compute prompt logprobs.", parameter="echo")
    if data.get("logprob_token_ids") and data.get("echo") and data.get("max_tokens") == 0:
        raise VllmValidationError("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                                  "no output tokens are generated.", parameter="logprob_token_ids")
    if data.get("logprob_token_ids") and data.get("logprobs") is None:
        raise VllmValidationError("when using `logprob_token_ids`, `logprobs` must be set.",
                                  parameter="logprob_token_ids")
    _check_logprob_counts(data, "logprobs")


@reads("logprob_token_ids", "use_beam_search", "logprobs", "prompt_logprobs", "top_logprobs")
def check_chat_logprobs(data: dict[str, Any]) -> None:
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise VllmValidationError("`logprob_token_ids` is not supported with beam search.",
                                  parameter="logprob_token_ids")
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        raise VllmValidationError("when using `logprob_token_ids`, `logprobs` must be set to true.",
                                  parameter="logprob_token_ids")
    _check_logprob_counts(data, "top_logprobs")
    top = data.get("top_logprobs")
    if top is not None and (top == -1 or top > 0) and not data.get("logprobs"):
        raise VllmValidationError("when using `top_logprobs`, `logprobs` must be set to true.",
                                  parameter="top_logprobs")


@reads("stream_options")
def check_stream_options(data: dict[str, Any]) -> None:
    if data.get("stream_options") and not data.get("stream"):
        raise VllmValidationError("Stream options can only be defined when `stream=True`.",
                                  parameter="stream_options")


def check_prompt_present(data: dict[str, Any]) -> None:
    prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        raise VllmValidationError("Either prompt or prompt_embeds must be provided and non-empty.",
                                  parameter="prompt")


@reads("prompt", "prompt_embeds")
def check_prompt_count(data: dict[str, Any]) -> None:
    prompt = data.get("prompt")
    if (isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt)
            and len(prompt) > MAX_COMPLETION_PROMPTS):
        raise VllmValidationError(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. To "
            "increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.", parameter="prompt")
    embeds = data.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > MAX_COMPLETION_PROMPTS:
        raise VllmValidationError(
            f"prompt_embeds list length {len(embeds)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            parameter="prompt_embeds")


@reads("continue_final_message")
def check_generation_prompt(data: dict[str, Any]) -> None:
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise VllmValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


@reads("tools", "tool_choice")
def check_tool_usage(data: dict[str, Any]) -> None:
    if data.get("tools") == []:
        raise VllmValidationError("`tools` must not be an empty array. Either provide at least one tool or omit the "
                                  "field entirely.", parameter="tools")
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"  # vLLM's default once tools are given
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if data.get("tools") is None:
        raise VllmValidationError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise VllmValidationError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                  "or \"required\" are supported.", parameter="tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise VllmValidationError(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                                      parameter="tool_choice.function")
        if "name" not in function:
            raise VllmValidationError(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                                      parameter="tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise VllmValidationError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                                      parameter="tool_choice.function.name")
        if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in data["tools"]):
            raise VllmValidationError("The tool specified in `tool_choice` does not match any of the specified "
                                      "`tools`", parameter="tool_choice")


@reads("messages")
def check_message_content(data: dict[str, Any]) -> None:
    """Only OpenAI's assistant (and legacy function) messages take ``content: null``."""
    messages = data.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(m, dict) and "content" in m and m["content"] is None and m.get("role") not in (
                "assistant", "function"):
            raise RequestValidationError.from_errors([{
                "type": "string_type", "loc": ("body", "messages", i, "content"), "msg": "Input should be a valid "
                "string", "input": None}])


def null_max_tokens_means_default(data: dict[str, Any]) -> None:
    """Completions only: ``max_tokens: null`` is vLLM's default of 16."""
    if data.get("max_tokens") is None:
        data["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS


def _run_checks(checks: tuple[Check, ...], data: Any) -> Any:
    if isinstance(data, dict):
        data = dict(data)  # some checks fill in defaults; the caller's body stays as sent
        run_checks(checks, data)
    return data


COMPLETION_CHECKS: tuple[Check, ...] = (
    check_prompt_count, check_prompt_present, check_stream_options, check_completion_logprobs,
    check_structured_outputs, check_response_format, null_max_tokens_means_default, check_cache_salt,
)
"""vLLM's ``CompletionRequest`` before-validators, in the order pydantic runs them."""
CHAT_CHECKS: tuple[Check, ...] = (
    check_generation_prompt, check_tool_usage, check_chat_structured_outputs, check_chat_logprobs, check_stream_options,
    check_response_format, check_cache_salt, check_message_content,
)
"""vLLM's ``ChatCompletionRequest`` before-validators, in the order pydantic runs them, then the
null-content rule vLLM's message union holds and kvflow's one loose message model does not."""
TOKENIZE_CHAT_CHECKS: tuple[Check, ...] = (check_generation_prompt, check_message_content)


# -- the models --------------------------------------------------------------------------------
class OpenAIModel(BaseModel):
    """vLLM's ``OpenAIBaseModel``: extra fields are allowed and kept."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


TokenId = Annotated[int, Field(ge=0)]
StopParam = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None
XArgs = dict[str, str | int | float | list[str | int | float]]
TopLogprobs = Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)]


class CompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopParam = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    prompt_embeds: bytes | list[bytes] | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str = ""
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: XArgs | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        return _run_checks(COMPLETION_CHECKS, data)


class ChatMessage(OpenAIModel):
    """One message of vLLM's message union, loosely: any role its chat template renders.

    Content parts are checked when the chat is rendered, as vLLM checks them; a null content
    only OpenAI's assistant message takes (``check_message_content``).
    """

    role: str
    content: str | list[str | dict[str, Any]] | None = None
    name: str = ""


class ChatCompletionRequest(OpenAIModel):
    messages: list[ChatMessage]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopParam = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking_token_budget: int | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str = ""
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: XArgs | None = None
    repetition_detection: dict[str, Any] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        return _run_checks(CHAT_CHECKS, data)

    def output_limit(self) -> int | None:
        """The requested output length: ``max_completion_tokens`` wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        return _run_checks(TOKENIZE_CHAT_CHECKS, data)


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


Endpoint = Literal["completions", "chat", "tokenize", "detokenize"]
MODELS: dict[str, tuple[type[OpenAIModel], ...]] = {
    "completions": (CompletionRequest,),
    "chat": (ChatCompletionRequest,),
    "tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),  # vLLM's TokenizeRequest union
    "detokenize": (DetokenizeRequest,),
}


def validate(kind: Endpoint, body: Any) -> Any:
    """The typed request, or the 400 vLLM answers for this body."""
    if not isinstance(body, dict):  # FastAPI's error for a JSON body that is not an object
        raise _not_an_object(body)
    errors: list[dict[str, Any]] = []
    for model in MODELS[kind]:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            errors += [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
    raise RequestValidationError.from_errors(errors)


def refuse_request_chat_template(req: ChatCompletionRequest | TokenizeChatRequest) -> None:
    """vLLM without ``--trust-request-chat-template``: a chat template sent with the request is a 400."""
    if req.chat_template is not None or (req.chat_template_kwargs or {}).get("chat_template") is not None:
        raise InvalidRequestError("Chat template is passed with request, but --trust-request-chat-template is not "
                                  "set. Refused request with untrusted chat template.")


def tokenize_request(body: Any, resolve_model: Callable[[str | None], object] | None = None,
                     ) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``/tokenize`` body checked as vLLM checks it, in its order: its ``TokenizeRequest``, the
    model it names (``resolve_model``: the server's check, raising for a model it does not
    serve), and no chat template of the request's own."""
    req = validate("tokenize", body)
    if resolve_model is not None:
        resolve_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        refuse_request_chat_template(req)
    return req  # type: ignore[no-any-return]


def tokenize_answer(tokenizer: Any, tokens: list[int], max_model_len: int | None,
                    req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` for ``tokens`` (``tokenizer``: ``convert_ids_to_tokens``)."""
    strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def parse_request(kind: Endpoint, raw: bytes) -> Any:
    return validate(kind, decode_json(raw))
