"""Prefill/decode orchestration in the protocol vLLM's NixlConnector speaks.

1. The prefill pod gets the request with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params = {do_remote_decode: true, ...}``; it computes the prompt's KV blocks,
   keeps them, and answers with ``kv_transfer_params`` naming them (``do_remote_prefill: true``,
   ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ...).
2. The decode pod gets the original request plus those ``kv_transfer_params``; it pulls the
   blocks over NIXL and generates, streaming as the client asked.

The fields are ``kvflow.protocol.kv_transfer``'s. The two builders are pure; ``prefill`` is the
one I/O step. Both requests carry the same ``X-Request-Id``. A prefill that fails is not fatal:
the decode pod then computes the prompt itself (aggregated), which costs time but drops nothing.
A prefill pod's params that a decode pod could not pull with (a field of the wrong type or
missing) are such a failure (``prefill_bad_params``): they are not forwarded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvflow.endpoints import Endpoint
from kvflow.gateway.proxy import AttemptFailed, Upstream
from kvflow.protocol.kv_transfer import InvalidKvTransferParams, parse_prefill_answer, remote_decode_request

PREFILL_KV_PARAMS: Mapping[str, Any] = remote_decode_request()

# Sampling limits a one-token prefill cannot honour; the decode request keeps them.
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request the prefill pod gets: one token, no stream, 'keep the KV for a remote decode'."""
    out = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The original request plus what the prefill pod returned (unchanged when it returned none)."""
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    else:
        out.pop("kv_transfer_params", None)
    return out


def kv_params_of(response_body: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` from a prefill pod's JSON answer, as sent, if it sent any;
    ``InvalidKvTransferParams`` if a decode pod could not pull with them."""
    try:
        data = json.loads(response_body)
    except ValueError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params:
        return None
    parse_prefill_answer(params)
    return params  # forwarded verbatim, as vLLM's proxies do: fields a newer vLLM adds reach decode


def encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def prefill(upstream: Upstream, endpoint: Endpoint, path: str, body: Mapping[str, Any],
                  headers: Mapping[str, str]) -> dict[str, Any] | None:
    """Run the prefill step; the KV params for the decode pod, or AttemptFailed."""
    response = await upstream.send(endpoint, path, encode(prefill_body(body)), headers, upstream.timeouts.prefill)
    raw = await upstream.read_body(endpoint, response)  # read to the end and released
    if response.status != 200:
        raise AttemptFailed(f"prefill_status_{response.status}",
                            f"{endpoint.id}: prefill answered HTTP {response.status}: {raw[:200]!r}")
    try:
        return kv_params_of(raw)
    except InvalidKvTransferParams as exc:
        raise AttemptFailed("prefill_bad_params", f"{endpoint.id}: {exc}") from None
