"""What vLLM 0.32 checks after the request schema, in vLLM's order and with vLLM's messages.

The schema and vLLM's before-checks are ``kvflow.openai_api`` (shared with the gateway). This
module is the rest of the path a request takes through vLLM's OpenAI server, as pure functions:

1. the model name (``_check_model``): 404 for a name it does not serve, its default when none;
2. rendering (``OnlineRenderer``): suffix and tool checks, the chat template, tokenization, the
   output and prompt limits of ``TokenizeParams``;
3. sampling (``get_max_tokens``, ``SamplingParams.from_optional``, ``_verify_args``);
4. the engine's own checks (``SamplingParams.verify``, ``InputProcessor._validate_model_inputs``).

Steps 1-3 answer 400 before a response starts; step 4 runs when the engine takes the request, so
a streamed request already has its 200 and gets the error as an SSE event (``engine_error``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.errors import InvalidRequestError, KvflowError
from kvflow.openai_api import (
    ChatCompletionRequest, CompletionRequest, VllmValidationError, refuse_request_chat_template,
)
from kvflow.tokenizer import Tokenizer, chat_token_ids

MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS
MIN_TEMPERATURE = 1e-2  # vLLM raises temperatures in (0, 0.01) to this


class UnknownModelError(KvflowError):
    status = 404
    type = "NotFoundError"


@dataclass(frozen=True, slots=True)
class Limits:
    """What vLLM's checks read from the model and server configuration."""

    max_model_len: int
    vocab_size: int
    max_chars_per_token: int
    max_logprobs: int = 20  # --max-logprobs


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str
    """The prompt as echoed: the text sent, or the token ids decoded."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """The parts of vLLM's ``SamplingParams`` that shape the simulator's answer."""

    n: int
    max_tokens: int
    min_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    logprobs: int | None
    prompt_logprobs: int | None
    logprob_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    echo_only: bool = False
    """Completions ``echo`` with ``max_tokens: 0``: one step runs, the answer is the prompt."""


# -- 1. the model ----------------------------------------------------------------------------
def resolve_model(name: str | None, served: Sequence[str], loras: Sequence[str]) -> str:
    """The name to answer with: the request's, or the first served name when it names none."""
    if name is None:
        return served[0]
    if name in served or name in loras:
        return name
    raise UnknownModelError(f"The model `{name}` does not exist. Valid aliases: {', '.join(served)}.",
                            param="model")


# -- 2. rendering ----------------------------------------------------------------------------
def _output_limit(max_output: int | None, limits: Limits, param: str) -> None:
    """``TokenizeParams.__post_init__``: the request cannot ask for more than the context."""
    if max_output and max_output > limits.max_model_len:
        raise VllmValidationError(f"{param}={max_output} cannot be greater than max_model_len={limits.max_model_len}. "
                                  "Please request fewer output tokens.", parameter=param, value=max_output)


def _truncation_limit(truncate: int | None, limits: Limits) -> None:
    if truncate is not None and truncate > limits.max_model_len:
        raise VllmValidationError(f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = "
                                  f"{limits.max_model_len}. Please request a smaller truncation size.",
                                  parameter="truncate_prompt_tokens", value=truncate)


def _text_length(text: str, limits: Limits, truncate: int | None) -> None:
    bound = limits.max_model_len * limits.max_chars_per_token
    if truncate is None and len(text) > bound:
        raise VllmValidationError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt contains "
            f"{len(text)} characters (more than {bound} characters, which is the upper bound for "
            f"{limits.max_model_len} input tokens). Please reduce the length of the input prompt.",
            parameter="input_text", value=len(text))


@dataclass(frozen=True, slots=True)
class Truncation:
    """``truncate_prompt_tokens`` and its side; ``-1`` keeps what leaves room for output."""

    tokens: int | None = None
    side: str | None = None
    wants_output: bool = True

    def apply(self, ids: list[int], max_model_len: int) -> list[int]:
        if self.tokens is None:
            return ids
        keep = (max_model_len - 1 if self.wants_output else max_model_len) if self.tokens < 0 else self.tokens
        if keep >= len(ids):
            return ids
        return ids[len(ids) - keep:] if self.side == "left" else ids[:keep]


def _fit_tokens(ids: list[int], limits: Limits, truncation: Truncation, *, from_text: bool) -> list[int]:
    """Truncation as vLLM applies it, then the length check (text is cut at max_model_len + 1)."""
    if truncation.tokens is not None:
        ids = truncation.apply(ids, limits.max_model_len)
    elif from_text:
        ids = ids[: limits.max_model_len + 1]
    if len(ids) > limits.max_model_len:
        count = len(ids)
        qualifier = "at least " if count == limits.max_model_len + 1 else ""
        raise VllmValidationError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. Please "
            "reduce the length of the input prompt.", parameter="input_tokens", value=count)
    return ids


def check_beam_stream(req: CompletionRequest) -> None:
    """The completions handler's first check, before even the model name."""
    if req.stream and req.use_beam_search:
        raise InvalidRequestError("Streaming is not currently supported with beam search")


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> list[Prompt]:
    """vLLM's ``render_completion``: the prompts of a completions request, or its 400."""
    if req.suffix is not None:
        if req.echo:
            raise InvalidRequestError("Echo is unsupported with suffix.", param="suffix")
        if req.prompt_embeds is not None:
            raise InvalidRequestError("suffix is not supported with prompt_embeds", param="suffix")
        if req.truncate_prompt_tokens is not None:
            raise InvalidRequestError("suffix is not supported with truncate_prompt_tokens", param="suffix")
        texts = isinstance(req.prompt, str) or (isinstance(req.prompt, list) and all(isinstance(p, str)
                                                                                     for p in req.prompt))
        raise InvalidRequestError("suffix is only supported for models with FIM completion rendering" if texts
                                  else "suffix requires text prompt input for FIM completion rendering", param="suffix")
    if req.prompt_embeds is not None:
        raise VllmValidationError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
                                  parameter="prompt_embeds")
    prompt = req.prompt
    single = isinstance(prompt, str) or bool(prompt and isinstance(prompt[0], int))
    items: list[Any] = [prompt] if single else list(prompt or [])
    _output_limit(req.max_tokens, limits, "max_tokens")
    _truncation_limit(req.truncate_prompt_tokens, limits)
    if not items:
        raise InvalidRequestError("You must pass at least one prompt")
    truncation = Truncation(req.truncate_prompt_tokens, req.truncation_side, bool(req.max_tokens))
    prompts = []
    for item in items:
        if isinstance(item, str):
            _text_length(item, limits, req.truncate_prompt_tokens)
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            ids = _fit_tokens(ids, limits, truncation, from_text=True)
            prompts.append(Prompt(ids, item))
        else:
            ids = _fit_tokens(list(item), limits, truncation, from_text=False)
            prompts.append(Prompt(ids, tokenizer.decode(ids, skip_special_tokens=False)))
    return prompts


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """vLLM's ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (the simulator parses no calls)."""

    auto: bool = False
    parser: str | None = None


def chat_prompt(req: ChatCompletionRequest, body: dict[str, Any], tokenizer: Tokenizer, limits: Limits,
                tools: ToolConfig = ToolConfig()) -> Prompt:
    """vLLM's ``render_chat`` for a text model: tool and template checks, the template, tokens."""
    choice = req.tool_choice
    if tools.parser is None and choice not in (None, "none"):
        if choice == "auto" and not tools.auto:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      "to be set")
        if choice != "auto":
            desc = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
            raise InvalidRequestError(f"tool_choice={desc} requires --tool-call-parser to be set")
    refuse_request_chat_template(req)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, name):
            raise VllmValidationError(
                f"Per-request {name} are disabled by default because they can change multimodal "
                f"{'preprocessing' if name == 'mm_processor_kwargs' else 'media loading'} resource usage. Start the "
                "server with --trust-request-mm-kwargs only when clients are trusted.", parameter=name)
    _check_content_parts(body["messages"])
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _output_limit(req.output_limit(), limits, param)
    _truncation_limit(req.truncate_prompt_tokens, limits)
    ids = chat_token_ids(tokenizer, body)
    truncation = Truncation(req.truncate_prompt_tokens, req.truncation_side, bool(req.output_limit()))
    ids = _fit_tokens(ids, limits, truncation, from_text=True)
    return Prompt(ids, "")


_OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _check_content_parts(messages: Sequence[dict[str, Any]]) -> None:
    """Text parts only, each with its text (vLLM checks parts lazily, when it renders the chat).

    OpenAI's message types take dict parts only; vLLM's own type for other roles also takes
    plain strings. A text model has nothing to do with image, audio or file parts.
    """
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, str) and m["role"] not in _OPENAI_ROLES:
                continue
            ok = isinstance(part, dict) and (
                (part.get("type", "text") == "text" and isinstance(part.get("text"), str))
                or (part.get("type") == "refusal" and isinstance(part.get("refusal"), str)))
            if not ok:
                raise InvalidRequestError(f"messages.{i}.content.{j}: a text model takes text parts "
                                          "({'type': 'text', 'text': ...}) only")


# -- 3. sampling -------------------------------------------------------------------------------
def max_tokens_for(requested: int | None, prompt_len: int, limits: Limits, truncate: int | None = None) -> int:
    """vLLM's ``get_max_tokens``: the request's limit, at most what the context leaves."""
    if truncate is not None:
        prompt_len = min(prompt_len, limits.max_model_len if truncate == -1 else truncate)
    if prompt_len > limits.max_model_len:
        raise InvalidRequestError(f"Input length ({prompt_len}) exceeds model's maximum context length "
                                  f"({limits.max_model_len}).")
    room = limits.max_model_len - prompt_len
    return room if requested is None else min(room, requested)


def _logit_bias_ids(bias: dict[str, float] | None) -> tuple[int, ...]:
    if not bias:
        return ()
    bad = []
    ids = []
    for key in bias:
        try:
            ids.append(int(key))
        except ValueError:
            bad.append(key)
    if bad:
        raise VllmValidationError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                                  parameter="logit_bias", value=bad)
    return tuple(ids)


def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Sampling:
    """``SamplingParams.from_optional`` and its ``_verify_args``, for one prompt of the request."""
    echo_only = False
    if isinstance(req, ChatCompletionRequest):
        logprobs = req.top_logprobs if req.logprobs and not req.logprob_token_ids else None
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.top_logprobs
    else:
        logprobs = None if req.logprob_token_ids else req.logprobs
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.logprobs
        echo_only = bool(req.echo) and req.max_tokens == 0
        if echo_only:
            max_tokens = 1  # echo without generation still runs one step
    bias = _logit_bias_ids(req.logit_bias)
    n = 1 if req.n is None else req.n
    temperature = 1.0 if req.temperature is None else req.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _verify_args(n, req, temperature, max_tokens, stop, logprobs, prompt_logprobs)
    if temperature < GREEDY_EPS and n > 1:
        raise InvalidRequestError(f"n must be 1 when using greedy sampling, got {n}.")
    return Sampling(
        n=n, max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=temperature,
        seed=None if req.seed == -1 else req.seed, stop=tuple(dict.fromkeys(stop)),
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        logprob_token_ids=tuple(req.logprob_token_ids) if req.logprob_token_ids else None, logit_bias=bias,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
        echo_only=echo_only,
    )


def _verify_args(n: int, req: CompletionRequest | ChatCompletionRequest, temperature: float, max_tokens: int,
                 stop: list[str], logprobs: int | None, prompt_logprobs: int | None) -> None:
    """``SamplingParams._verify_args``, message for message."""
    if n < 1:
        raise InvalidRequestError(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise InvalidRequestError(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
                                  "VLLM_MAX_N_SEQUENCES environment variable.")
    presence = 0.0 if req.presence_penalty is None else float(req.presence_penalty)
    frequency = 0.0 if req.frequency_penalty is None else float(req.frequency_penalty)
    repetition = 1.0 if req.repetition_penalty is None else float(req.repetition_penalty)
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    top_k = 0 if req.top_k is None else req.top_k
    min_p = 0.0 if req.min_p is None else float(req.min_p)
    if not -2.0 <= presence <= 2.0:
        raise InvalidRequestError(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise InvalidRequestError(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not math.isfinite(repetition):
        raise InvalidRequestError(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise InvalidRequestError(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = float(temperature)
    if not math.isfinite(temperature):
        raise VllmValidationError(f"temperature must be a finite number, got {temperature}.", parameter="temperature",
                                  value=temperature)
    if temperature < 0.0:
        raise VllmValidationError(f"temperature must be non-negative, got {temperature}.", parameter="temperature",
                                  value=temperature)
    if temperature > 2.0:
        raise VllmValidationError(f"temperature must be in [0, 2], got {temperature}.", parameter="temperature",
                                  value=temperature)
    if not 0.0 < top_p <= 1.0:
        raise VllmValidationError(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p)
    if top_k < -1:
        raise InvalidRequestError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequestError(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise VllmValidationError(f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens",
                                  value=max_tokens)
    if req.min_tokens < 0:
        raise InvalidRequestError(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
    if req.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                                  f"{req.min_tokens}.")
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise VllmValidationError(f"logprobs must be non-negative or -1, got {logprobs}.", parameter="logprobs",
                                  value=logprobs)
    if prompt_logprobs is not None and prompt_logprobs != -1 and prompt_logprobs < 0:
        raise VllmValidationError(f"prompt_logprobs must be non-negative or -1, got {prompt_logprobs}.",
                                  parameter="prompt_logprobs", value=prompt_logprobs)
    if any(not s for s in stop):
        raise InvalidRequestError("stop cannot contain an empty string.")
    bad_words = list(dict.fromkeys(req.bad_words))
    if any(not w for w in bad_words):
        raise InvalidRequestError(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")


# -- 4. the engine -------------------------------------------------------------------------------
def engine_error(prompts: Sequence[Prompt], params: Sequence[Sampling], tokenizer: Tokenizer,
                 limits: Limits) -> KvflowError | None:
    """The first refusal vLLM's engine makes when it takes these prompts (``None``: it takes them)."""
    try:
        for prompt, p in zip(prompts, params, strict=True):
            _verify_sampling(p, limits)
            _verify_prompt(prompt.token_ids, tokenizer, limits)
    except KvflowError as exc:
        return exc
    return None


def _out_of_vocab(ids: Sequence[int], vocab_size: int) -> list[int]:
    return [t for t in ids if t < 0 or t >= vocab_size]


def _verify_sampling(p: Sampling, limits: Limits) -> None:
    """``SamplingParams.verify``: limits that depend on the model."""
    vocab = limits.vocab_size
    _verify_logprob_count("sample", "logprobs", p.logprobs, limits)
    if p.logprob_token_ids is not None:
        _verify_logprob_token_ids(p, limits)
    _verify_logprob_count("prompt", "prompt_logprobs", p.prompt_logprobs, limits)
    for name, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids)):
        if bad := _out_of_vocab(ids, vocab):
            raise VllmValidationError(f"token_id(s) {bad} in {name} contain out-of-vocab token ids. Vocabulary size: "
                                      f"{vocab}", parameter=name, value=bad)
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise VllmValidationError("allowed_token_ids is not None and empty!", parameter="allowed_token_ids",
                                      value=[])
        if bad := _out_of_vocab(p.allowed_token_ids, vocab):
            raise VllmValidationError("allowed_token_ids contains out-of-vocab token id!",
                                      parameter="allowed_token_ids", value=bad)


def _verify_logprob_count(kind: str, param: str, count: int | None, limits: Limits) -> None:
    if count:
        count = limits.vocab_size if count == -1 else count
        if count > limits.max_logprobs:
            raise VllmValidationError(f"Requested {kind} logprobs of {count}, which is greater than max allowed: "
                                      f"{limits.max_logprobs}", parameter=param, value=count)


def _verify_logprob_token_ids(p: Sampling, limits: Limits) -> None:
    ids = p.logprob_token_ids or ()
    if len(ids) > 128:
        raise VllmValidationError(f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                                  "allowed: 128", parameter="logprob_token_ids", value=len(ids))
    if bad := _out_of_vocab(ids, limits.vocab_size):
        raise VllmValidationError(f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. "
                                  f"Vocabulary size: {limits.vocab_size}", parameter="logprob_token_ids", value=bad)
    if p.logprobs is not None and p.logprobs != len(ids):
        raise VllmValidationError(f"When both logprobs and logprob_token_ids are set, logprobs must equal "
                                  f"len(logprob_token_ids). Got logprobs={p.logprobs}, "
                                  f"len(logprob_token_ids)={len(ids)}.", parameter="logprob_token_ids", value=len(ids))


def _verify_prompt(ids: Sequence[int], tokenizer: Tokenizer, limits: Limits) -> None:
    """``InputProcessor._validate_model_input`` for a decoder-only text model."""
    if not ids:
        raise VllmValidationError("The decoder prompt cannot be empty")
    if len(ids) == limits.max_model_len:
        raise VllmValidationError(
            f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) is longer "
            f"than the maximum model length of {limits.max_model_len}. Make sure that `max_model_len` is no smaller "
            "than the number of text tokens (prompt + requested output tokens).")
    if min(ids) < 0:
        raise VllmValidationError(f"Token id {min(ids)} is out of vocabulary")
    if max(ids) > max(tokenizer.vocab_size, limits.vocab_size) - 1:
        raise VllmValidationError(f"Token id {max(ids)} is out of vocabulary")
