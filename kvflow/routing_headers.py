"""Headers that choose where a request goes: the router's to set, never a client's.

The endpoint picker tells Envoy where to send a request with ``x-gateway-destination-endpoint``
(and the decode pod's sidecar where to prefill with ``x-prefiller-host-port``); kvflow's own
``x-kvflow-*`` headers choose a scheduling profile or a priority. A client that could set any of
them would choose its own destination (server-side request forgery) or jump the queue, so every
edge removes them on ingress: the gateway, the sidecar, the ext_proc server, and the Envoy
bootstrap kvflow renders. ``x-kvflow-profile`` and ``x-kvflow-priority`` may be allowed back by
configuration (per API key on the gateway); the destination headers never are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping

from kvflow.errors import InvalidRequestError

DESTINATION = "x-gateway-destination-endpoint"
PREFILLER = "x-prefiller-host-port"
PICKED = "x-kvflow-endpoint"
"""A response header naming the picked pod: for debugging only, off by default."""
PROFILE = "x-kvflow-profile"
PRIORITY = "x-kvflow-priority"
EXPLAIN = "x-kvflow-explain"
"""A request that sends it (where allowed) is answered with ``x-kvflow-route``: its pod, its
mode (aggregated or pd), the prefill pod and the prompt tokens the router expected cached."""
ROUTE = "x-kvflow-route"

NEVER_FROM_CLIENTS = frozenset({
    DESTINATION, PREFILLER, PICKED,
    "x-gateway-destination-endpoint-served", "x-prefiller-url",  # llm-d's other spellings
})
"""Routing headers no configuration lets a client send."""
ALLOWABLE = frozenset({PROFILE, PRIORITY, EXPLAIN})
"""kvflow's own routing headers that configuration may let a client send."""
KVFLOW_PREFIX = "x-kvflow-"


def is_routing(name: str) -> bool:
    """Whether a (lower-case) header name steers routing."""
    return name in NEVER_FROM_CLIENTS or name.startswith(KVFLOW_PREFIX)


def strip_client_routing(headers: MutableMapping[str, str], allowed: Collection[str] = ()) -> list[str]:
    """Remove, in place, every routing header except ``allowed`` ones; the names removed.

    ``headers`` has lower-case names (as kvflow's HTTP server and ext_proc give them)."""
    found = [name for name in headers
             if name in NEVER_FROM_CLIENTS or (name.startswith(KVFLOW_PREFIX) and name not in allowed)]
    for name in found:
        del headers[name]
    return found


def check_allowable(names: Collection[str]) -> list[str]:
    """Header names a client may be allowed to send (lower-cased): only kvflow's profile,
    priority and explain headers; a ValueError names the others."""
    lowered = [n.lower() for n in names]
    bad = sorted(set(lowered) - ALLOWABLE)
    if bad:
        raise ValueError(f"clients may only be allowed {', '.join(sorted(ALLOWABLE))}, not {', '.join(bad)}")
    return lowered


def header_priority(headers: Mapping[str, str], name: str = PRIORITY) -> int:
    """The integer priority a request's ``name`` header sets (0 without one); a value that is
    not an integer is a 400, on every entry that reads it."""
    text = headers.get(name)
    if text is None:
        return 0
    try:
        return int(text)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer", param="priority") from None
