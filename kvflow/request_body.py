"""Client bodies in, pod answers out: the JSON checks every entry (gateway, sidecar, ext_proc)
makes at its trust boundary, and the budget that bounds how many body bytes a process buffers.

* ``parse_json``: a JSON object or a 400, whatever the bytes (invalid UTF-8, nesting deep enough
  to exhaust the decoder's recursion, nesting over ``max_depth``): never a 500.
* ``client_kv_params``: ``kv_transfer_params`` is the P/D protocol between the gateway (or the
  sidecar) and the pods. A client that sets it could make a pod pull KV from, or push its prompt
  to, an address of its choice, or pin KV blocks for a remote decode that never comes; so it is
  refused with a 400, or removed when configured so. It is looked up in the parsed body, never
  in the bytes: JSON may spell a key with escapes (``"kv_transfer_p\\u0061rams"``).
* ``client_body``: the two above, in the one order every entry applies them.
* ``scrub_answer``: a pod's answer may carry ``kv_transfer_params`` (its engine id, host and port);
  clients never see it.
* ``BodyBudget``: the bytes of request bodies one process holds at once, across all its
  connections or streams. A body is admitted against it (by its declared length, or as its bytes
  arrive) and released when its request is done; one that does not fit is refused with a 503 and
  ``Retry-After`` before it is read, so a crowd of large bodies costs at most the budget.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from kvflow.errors import InvalidRequestError, NoCapacityError

KV_PARAMS = "kv_transfer_params"
KvPolicy = Literal["reject", "strip"]
DEFAULT_MAX_DEPTH = 64
DEFAULT_BUFFERED_BODIES = 256 << 20
"""Bytes of request bodies one process buffers at once: 32 bodies at the 8 MiB default limit."""
_decoder = msgspec.json.Decoder()


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """The body as a JSON object (msgspec: several times cheaper than json.loads), or a 400 saying why not."""
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 in a string: the latter
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"request body is nested deeper than {max_depth} levels") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if too_deep(raw, body, max_depth):
        raise InvalidRequestError(f"request body is nested deeper than {max_depth} levels")
    return body


def too_deep(raw: bytes, value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded from ``raw``) nests containers more than ``limit`` deep.

    Finding its few brackets settles the usual body at once (``bytes.find`` of one byte is
    ``memchr``, vectorised, where ``bytes.count`` is a plain loop over every byte); only a body with more
    brackets than the limit is walked, and then only through its containers."""
    if _brackets_at_most(raw, limit):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if type(node) is dict else node
        kinds = set(map(type, children))
        if dict in kinds or list in kinds:
            stack.extend((child, depth + 1) for child in children if type(child) is dict or type(child) is list)
    return False


def _brackets_at_most(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` holds at most ``limit`` of ``[`` and ``{`` together (stops past it)."""
    seen = 0
    for bracket in (b"[", b"{"):
        at = raw.find(bracket)
        while at >= 0:
            seen += 1
            if seen > limit:
                return False
            at = raw.find(bracket, at + 1)
    return True


def client_kv_params(body: dict[str, Any], policy: KvPolicy) -> bool:
    """Enforce ``policy`` on a client body's ``kv_transfer_params``; whether the body changed."""
    if KV_PARAMS not in body:
        return False
    if body[KV_PARAMS] is not None and policy == "reject":
        raise InvalidRequestError("kv_transfer_params is set by the gateway for prefill/decode, not by clients",
                                  param=KV_PARAMS)
    del body[KV_PARAMS]
    return True


def client_body(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH,
                kv_policy: KvPolicy = "reject") -> tuple[dict[str, Any], bool]:
    """A client's body, parsed and checked as every entry checks it; and whether
    ``kv_policy == "strip"`` removed something (the bytes must then be encoded again)."""
    body = parse_json(raw, max_depth)
    return body, client_kv_params(body, kv_policy)


def scrub_answer(raw: bytes) -> bytes:
    """A pod's JSON answer without the ``kv_transfer_params`` that name its internals."""
    if b'"kv_transfer_params"' not in raw or b'"kv_transfer_params":null' in raw:
        return raw
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    if not isinstance(data, dict) or data.get(KV_PARAMS) is None:
        return raw
    data[KV_PARAMS] = None
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


class BodyBudget:
    """Bytes of request bodies held at once by one server (owned by it; no process-global state).

    ``take(n)`` before buffering ``n`` more bytes, ``give(n)`` once they are dropped; ``take``
    raises ``NoCapacityError`` (503, ``Retry-After``) when they would not fit, and takes nothing
    then. A single body is always admitted into an empty budget, so a budget below the body size
    limit still serves one at a time."""

    __slots__ = ("limit", "held", "refused")

    def __init__(self, limit: int = DEFAULT_BUFFERED_BODIES) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0
        """Bodies refused for want of room (metrics)."""

    def fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.limit

    def take(self, n: int) -> None:
        if not self.fits(n):
            self.refused += 1
            raise NoCapacityError("too many request bodies are being received at once; retry later",
                                  retry_after=1.0)
        self.held += n

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)
