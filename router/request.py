"""One OpenAI request → one ``SchedulingRequest``, whichever way it reached the router.

Every entry (the gateway with its router in process, the ext_proc server behind Envoy) parses
the body with ``kvflow.request_body.client_body`` and hands the router an ``Incoming``;
``Router.route`` turns it into a ``SchedulingRequest`` here, so a request is hashed and routed
the same way on either path: the same tokens, the same LoRA adapter (by model name, or by the
``x-lora`` header naming one the pool serves), the same ``cache_salt`` (it keys the first
block's hash, as in vLLM), the same multimodal keys and the same chosen profile. The edges strip
client routing headers before they get here (``kvflow.routing_headers``); whatever is left is
the router's to read.

Large prompts are tokenised (``tokens_off_loop``) and fingerprinted off the event loop: a
million-token prompt must not stall every other request the router is deciding.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.errors import InvalidRequestError
from kvflow.router.model import SchedulingRequest
from kvflow.routing_headers import PROFILE
from kvflow.tokenizer import Tokenizer, prompt_token_ids

LORA_HEADER = "x-lora"
_MM_PARTS = {"image_url": "url", "input_audio": "data", "video_url": "url", "audio_url": "url"}


@dataclass(frozen=True, slots=True)
class Incoming:
    """One request as an entry received it: what ``Router.route`` decides on."""

    body: Mapping[str, Any]
    """The OpenAI body, parsed and checked by ``kvflow.request_body.client_body``."""
    headers: Mapping[str, str]
    """Its headers, lower-case, with the routing headers a client may not send stripped."""
    request_id: str
    size: int
    """The raw body's length in bytes: a body this large may be tokenized in a worker thread."""
    priority: int = 0
    """``SchedulingRequest.priority``: the gateway's (an API key's, or an allowed
    ``x-kvflow-priority``), the ext_proc server's from that header; batch lines below 0."""


@dataclass(frozen=True, slots=True)
class PoolNames:
    """What a pool serves: its base model and the LoRA adapters it knows (served names)."""

    model: str
    adapters: Collection[str] = frozenset()


def scheduling_request(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    token_ids: list[int],
    *,
    request_id: str,
    names: PoolNames | None = None,
    max_prompt_tokens: int | None = None,
    priority: int = 0,
) -> SchedulingRequest:
    """The request the router schedules; ``token_ids`` are the prompt's (``tokens_off_loop``).

    ``names`` are the pool's (None: whatever the body names is the model, as behind an EPP that
    serves one pool). A prompt longer than ``max_prompt_tokens`` is a 400, as vLLM answers it.
    """
    if max_prompt_tokens is not None and len(token_ids) > max_prompt_tokens:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_prompt_tokens} tokens. However, your request has "
            f"{len(token_ids)} input tokens. Please reduce the length of the input messages.",
            param="messages" if "messages" in body else "prompt",
        )
    asked = body.get("model")
    model = asked if isinstance(asked, str) else ""
    lora = None
    if names is not None:
        if model in names.adapters:
            lora = model
        elif headers.get(LORA_HEADER) in names.adapters:
            lora = headers[LORA_HEADER]
        if names.model and (not model or model == lora):
            model = names.model  # an adapter is scheduled in its base model's pool
    elif headers.get(LORA_HEADER):
        lora = headers[LORA_HEADER]
    salt = body.get("cache_salt")
    return SchedulingRequest(
        request_id=request_id,
        model=model,
        token_ids=token_ids,
        headers=headers,
        lora=lora,
        cache_salt=salt if isinstance(salt, str) and salt else None,
        mm_hashes=multimodal_hashes(body),
        profile=headers.get(PROFILE) or None,
        priority=priority,
    )


def multimodal_hashes(body: Mapping[str, Any]) -> tuple[str, ...]:
    """A digest of each image/audio/video a chat request carries, in order.

    vLLM keys the blocks that cover a multimodal item on the item's own hash; the router cannot
    reproduce its preprocessing, but the digests keep two prompts with the same text and
    different images from looking like one cached prefix.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()
    found: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _MM_PARTS:
                continue
            item = part.get(part["type"])
            source = item.get(_MM_PARTS[part["type"]]) if isinstance(item, dict) else item
            found.append(hashlib.sha256(str(source).encode()).hexdigest()[:32])
    return tuple(found)


async def tokens_off_loop(tokenizer: Tokenizer, body: Mapping[str, Any], size: int,
                          offload_bytes: int | None = None) -> list[int]:
    """The prompt's token ids, computed in a worker thread when the body is ``size`` >=
    ``offload_bytes`` bytes (by default the tokenizer's own threshold, ``Tokenizer.offload_bytes``:
    past it the thread's encoding lets the event loop run meanwhile)."""
    if size >= (tokenizer.offload_bytes if offload_bytes is None else offload_bytes):
        return await asyncio.to_thread(prompt_token_ids, tokenizer, body)
    return prompt_token_ids(tokenizer, body)
