"""The JSON vLLM 0.32's OpenAI server returns, as plain dicts and pre-encoded SSE bytes.

Pure functions, no I/O. Field sets and order follow the captured responses in
tests/golden/vllm_responses.json:

* non-streaming bodies dump every field (``null`` included) and carry ``system_fingerprint``;
* stream chunks are dumped with ``exclude_unset``: only the fields the server sets, so no
  ``usage`` key on token chunks; the terminal token chunk carries ``system_fingerprint`` unless a
  usage chunk follows (``stream_options.include_usage``), which then carries it instead;
* the usage chunk is dumped with ``exclude_none`` (no ``*_details`` keys).

Streaming chunks are assembled from byte templates so the hot path encodes only the new text.
"""

from __future__ import annotations

import hashlib
import uuid
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


@dataclass(frozen=True, slots=True)
class Head:
    """What every response of one request shares."""

    id: str
    created: int
    model: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Result:
    text: str
    finish_reason: str | None
    stop_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    kv_transfer_params: dict[str, Any] | None


def completion(head: Head, r: Result) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [{
            "index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "routed_experts": None,
        }],
        "service_tier": None,
        "system_fingerprint": head.fingerprint,
        "usage": usage(r.prompt_tokens, r.completion_tokens),
        "kv_transfer_params": r.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_completion(head: Head, r: Result) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": r.text, "refusal": None, "annotations": None,
                        "audio": None, "function_call": None, "reasoning": None},
            "logprobs": None, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "token_ids": None,
            "routed_experts": None,
        }],
        "service_tier": None,
        "system_fingerprint": head.fingerprint,
        "usage": usage(r.prompt_tokens, r.completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": r.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


class StreamFormat:
    """Byte templates for one streamed response; ``chunk`` fills in the new text."""

    def __init__(self, head: Head, *, chat: bool, include_usage: bool) -> None:
        self.head, self.chat, self.include_usage = head, chat, include_usage
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._prefix = (
            b'data: {"id":' + dumps(head.id) + b',"object":"' + self._object.encode() + b'","created":'
            + str(head.created).encode() + b',"model":' + dumps(head.model) + b',"choices":[{"index":0,'
        )
        if chat:
            self._open, self._mid = b'"delta":{"content":', b'},"logprobs":null,"finish_reason":'
            self._end = b',"token_ids":null}]'
        else:
            self._open, self._mid = b'"text":', b',"logprobs":null,"finish_reason":'
            self._end = b',"prompt_token_ids":null,"token_ids":null}]'
        self._fingerprint = b',"system_fingerprint":' + dumps(head.fingerprint)

    def first(self) -> bytes:
        """Chat streams open with the assistant role and empty content."""
        if not self.chat:
            return b""
        return (self._prefix + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                b'"prompt_token_ids":null,"prompt_text":null}\n\n')

    def chunk(self, text: str) -> bytes:
        stop = b"" if self.chat else b',"stop_reason":null'
        return self._prefix + self._open + dumps(text) + self._mid + b"null" + stop + self._end + b"}\n\n"

    def last(self, text: str, finish_reason: str, stop_reason: str | None) -> bytes:
        tail = b"" if self.include_usage else self._fingerprint
        return (self._prefix + self._open + dumps(text) + self._mid + dumps(finish_reason)
                + b',"stop_reason":' + dumps(stop_reason) + self._end + tail + b"}\n\n")

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        body = {"id": self.head.id, "object": self._object, "created": self.head.created, "model": self.head.model,
                "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens,
                                         "completion_tokens": completion_tokens},
                "system_fingerprint": self.head.fingerprint}
        return b"data: " + dumps(body) + b"\n\n"


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
