"""The JSON vLLM 0.32's OpenAI server returns, as plain dicts and pre-encoded SSE bytes.

Pure functions, no I/O. Field sets and order follow real vLLM's answers (tests/golden):

* non-streaming bodies dump every field (``null`` included) and carry ``system_fingerprint``;
* stream chunks are dumped with ``exclude_unset``: only the fields the server sets, so no
  ``usage`` key on token chunks unless ``continuous_usage_stats``; a choice's finishing chunk
  carries ``system_fingerprint`` unless a usage chunk follows (``include_usage``), which then
  carries it instead;
* the usage chunk is dumped with ``exclude_none`` (no ``*_details`` keys);
* an error after a stream started is one ``data:`` event with the error JSON, then ``[DONE]``.

The plain token chunk (no logprobs, token ids or usage) is assembled from byte templates, so the
hot path encodes only the new text.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

VLLM_VERSION = "0.32.0"
_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
_MASK_64 = (1 << 64) - 1


def dumps(obj: Any) -> bytes:
    return _enc.encode(obj)


def random_id() -> str:
    """16 hex characters, like vLLM's ``random_uuid``."""
    return f"{uuid.uuid4().int & _MASK_64:016x}"


def system_fingerprint(model: str) -> str:
    return f"vllm-{VLLM_VERSION}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def short_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Usage as a chunk carries it (``exclude_unset``/``exclude_none``)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def chat_chunk_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A chat chunk's continuous usage: the server sets ``completion_tokens_details`` too."""
    return {**short_usage(prompt_tokens, completion_tokens), "completion_tokens_details": None}


@dataclass(frozen=True, slots=True)
class Head:
    """What every response of one request shares."""

    id: str
    created: int
    model: str
    fingerprint: str


# -- logprobs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: the token's text and logprob (``None``: the prompt's first token) and the top list."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None


def completion_logprobs(entries: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """``CompletionLogProbs``: the top dict holds the chosen token and the k best (by decoded text)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"text_offset": offsets, "token_logprobs": [e.logprob for e in entries],
            "tokens": [e.token for e in entries],
            "top_logprobs": [None if e.top is None else dict(e.top) for e in entries]}


def chat_logprobs(entries: Sequence[TokenLogprobs], k: int) -> dict[str, Any]:
    """``ChatCompletionLogProbs``: the top list is the first k of (chosen, best...)."""
    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}

    content = []
    for e in entries:
        top = list(e.top or ())
        top = top if k == -1 else top[:k]
        content.append({**item(e.token, e.logprob if e.logprob is not None else -9999.0),
                         "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


# -- whole answers ------------------------------------------------------------------------------------
def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason: str | int | None, *,
                      logprobs: dict[str, Any] | None = None, token_ids: list[int] | None = None,
                      prompt_logprobs: list[Any] | None = None,
                      prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt_token_ids, "routed_experts": None}


def completion(head: Head, choices: list[dict[str, Any]], use: dict[str, Any],
               kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
            "choices": choices, "service_tier": None, "system_fingerprint": head.fingerprint, "usage": use,
            "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None}


def chat_choice(index: int, role: str, content: str, finish_reason: str | None, stop_reason: str | int | None, *,
                logprobs: dict[str, Any] | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    message = {"role": role, "content": content, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason or "stop",
            "stop_reason": stop_reason, "token_ids": token_ids, "routed_experts": None}


def chat_completion(head: Head, choices: list[dict[str, Any]], use: dict[str, Any], *,
                    prompt_logprobs: list[Any] | None = None, prompt_token_ids: list[int] | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
            "choices": choices, "service_tier": None, "system_fingerprint": head.fingerprint, "usage": use,
            "prompt_logprobs": prompt_logprobs, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
            "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None}


# -- streams ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Delta:
    """One choice's new output since its last chunk."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    logprobs: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    fingerprint: bool = False

    @property
    def plain(self) -> bool:
        return (self.token_ids is None and self.logprobs is None and self.prompt_token_ids is None
                and self.usage is None)


class StreamFormat:
    """The SSE events of one streamed response."""

    def __init__(self, head: Head, *, chat: bool) -> None:
        self.head, self.chat = head, chat
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._prefix = (
            b'data: {"id":' + dumps(head.id) + b',"object":"' + self._object.encode() + b'","created":'
            + str(head.created).encode() + b',"model":' + dumps(head.model) + b',"choices":[{"index":'
        )
        if chat:
            self._open, self._mid, self._end = b',"delta":{"content":', b'},"logprobs":null,"finish_reason":', b"]"
        else:
            self._open, self._mid = b',"text":', b',"logprobs":null,"finish_reason":'
            self._end = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'

    def _top(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": self.head.id, "object": self._object, "created": self.head.created, "model": self.head.model,
                "choices": [choice], **extra}

    def role(self, index: int, role: str, *, prompt_token_ids: list[int] | None,
             usage: dict[str, Any] | None) -> bytes:
        """A chat stream opens each choice with its role and empty content."""
        choice = {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        extra: dict[str, Any] = {} if usage is None else {"usage": usage}
        return _event(self._top(choice, **extra, prompt_token_ids=prompt_token_ids, prompt_text=None))

    def echo(self, index: int, content: str, *, usage: dict[str, Any] | None) -> bytes:
        """A chat stream with ``echo`` repeats the last message's content after the role."""
        choice = {"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
        return _event(self._top(choice, **({} if usage is None else {"usage": usage})))

    def plain(self, index: int, text: str) -> bytes:
        """A token chunk with only new text: from the byte templates."""
        if self.chat:
            return (self._prefix + str(index).encode() + self._open + dumps(text) + self._mid
                    + b'null,"token_ids":null}' + self._end + b"}\n\n")
        return self._prefix + str(index).encode() + self._open + dumps(text) + self._mid + b"null" + self._end \
            + b"}\n\n"

    def chunk(self, d: Delta) -> bytes:
        if d.plain and d.finish_reason is None:
            return self.plain(d.index, d.text)
        if self.chat:
            choice: dict[str, Any] = {"index": d.index, "delta": {"content": d.text}, "logprobs": d.logprobs,
                                      "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            choice["token_ids"] = d.token_ids
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": d.logprobs, "finish_reason": d.finish_reason,
                      "stop_reason": d.stop_reason, "prompt_token_ids": d.prompt_token_ids, "token_ids": d.token_ids}
        extra: dict[str, Any] = {}
        if d.usage is not None:
            extra["usage"] = d.usage
        if d.fingerprint:
            extra["system_fingerprint"] = self.head.fingerprint
        return _event(self._top(choice, **extra))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        body = {"id": self.head.id, "object": self._object, "created": self.head.created, "model": self.head.model,
                "choices": [], "usage": short_usage(prompt_tokens, completion_tokens),
                "system_fingerprint": self.head.fingerprint}
        return _event(body)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An error after the 200: vLLM writes it with ``json.dumps`` (spaces after separators)."""
    return b"data: " + json.dumps(body).encode() + b"\n\n" + DONE


def model_card(name: str, root: str, created: int, max_model_len: int, parent: str | None = None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{random_id()}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    }
