"""The NIXL notifications a decode pod sends a prefill pod, in vLLM 0.32's formats (pull mode).

* done, ``"<remote_request_id>:<tp_size>"``: the decode pod has read the request's blocks (vLLM
  frees them once every decode rank has said so; a simulated pod is one rank);
* heartbeat, ``"HB:<remote_request_id>,<remote_request_id>,…"``: these requests still wait for
  their pull; keep their blocks (renew their leases).

A request id may contain ``:``, so a done message is split at its last colon, and a heartbeat,
recognised by its prefix first, is never split at its colon.
"""

from __future__ import annotations

from collections.abc import Iterable

HEARTBEAT_PREFIX = "HB:"


def done_message(remote_request_id: str, tp_size: int) -> bytes:
    return f"{remote_request_id}:{tp_size}".encode()


def done_request_id(message: str) -> str:
    """The request a done message names."""
    request_id, _, _tp_size = message.rpartition(":")
    return request_id


def heartbeat_message(remote_request_ids: Iterable[str]) -> bytes:
    """vLLM 0.32's lease renewal, ``b"HB:" + ",".join(ids)`` (sorted here: repeatable bytes)."""
    return (HEARTBEAT_PREFIX + ",".join(sorted(remote_request_ids))).encode()


def heartbeat_ids(message: str) -> list[str] | None:
    """The request ids a heartbeat names; None if ``message`` is a done message instead."""
    if not message.startswith(HEARTBEAT_PREFIX):
        return None
    return [request_id for request_id in message[len(HEARTBEAT_PREFIX):].split(",") if request_id]
