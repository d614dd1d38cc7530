"""A batch's life, as a pure state machine, and the OpenAI objects the API returns.

::

    validating ──► in_progress ──► finalizing ──► completed
        │  │             │  └────────(expiry)───► finalizing ──► expired
        │  └──► failed   │
        └────────────────┴──► cancelling ──► cancelled

``validating``: the input file is read into per-line rows. ``in_progress``: replicas claim and
run lines. ``finalizing``: every line has a result; the output and error files are being
written. ``cancelling``: no new line starts; lines already running finish and are kept. A batch
past its ``expires_at`` stops like a cancelled one, its unrun lines reported as
``batch_expired`` errors. Each step stamps its ``*_at`` field, as OpenAI's Batch object has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvflow.errors import InvalidRequestError


class Status(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)


_NEXT: dict[Status, frozenset[Status]] = {
    Status.VALIDATING: frozenset({Status.IN_PROGRESS, Status.FAILED, Status.CANCELLING}),
    Status.IN_PROGRESS: frozenset({Status.FINALIZING, Status.CANCELLING}),
    Status.FINALIZING: frozenset({Status.COMPLETED, Status.EXPIRED}),
    Status.CANCELLING: frozenset({Status.CANCELLED}),
}

STAMP: dict[Status, str] = {
    Status.IN_PROGRESS: "in_progress_at", Status.FINALIZING: "finalizing_at", Status.COMPLETED: "completed_at",
    Status.FAILED: "failed_at", Status.EXPIRED: "expired_at", Status.CANCELLING: "cancelling_at",
    Status.CANCELLED: "cancelled_at",
}
"""The timestamp field each status sets when a batch enters it."""


def can_move(current: Status, to: Status) -> bool:
    return to in _NEXT.get(current, frozenset())


def sources(to: Status) -> frozenset[Status]:
    """The statuses a batch may enter ``to`` from (the store's conditional updates use these)."""
    return frozenset(s for s, nexts in _NEXT.items() if to in nexts)


def cancellable(current: Status) -> bool:
    """Cancelling twice is allowed (and changes nothing); a finished batch cannot be cancelled."""
    return current in (Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    stamps: dict[str, int] = field(default_factory=dict)
    """``in_progress_at``, ``completed_at``, … for the statuses it went through."""

    def moved(self, to: Status, now: int) -> BatchRecord:
        if not can_move(self.status, to):
            raise ValueError(f"a batch cannot go from {self.status} to {to}")
        return replace(self, status=to, stamps={**self.stamps, STAMP[to]: now})


def batch_object(rec: BatchRecord) -> dict[str, Any]:
    """The batch as OpenAI's API returns it (``openai.types.Batch``)."""
    obj: dict[str, Any] = {
        "id": rec.id, "object": "batch", "endpoint": rec.endpoint, "errors": None,
        "input_file_id": rec.input_file_id, "completion_window": rec.completion_window,
        "status": rec.status.value, "output_file_id": rec.output_file_id, "error_file_id": rec.error_file_id,
        "created_at": rec.created_at, "expires_at": rec.expires_at,
        "request_counts": {"total": rec.total, "completed": rec.completed, "failed": rec.failed},
        "metadata": rec.metadata,
    }
    for name in STAMP.values():
        obj[name] = rec.stamps.get(name)
    if rec.errors:
        obj["errors"] = {"object": "list", "data": rec.errors}
    return obj


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int


def file_object(rec: FileRecord) -> dict[str, Any]:
    """The file as OpenAI's API returns it (``openai.types.FileObject``)."""
    return {"id": rec.id, "object": "file", "bytes": rec.bytes, "created_at": rec.created_at,
            "filename": rec.filename, "purpose": rec.purpose, "status": "processed",
            "expires_at": None, "status_details": None}


_WINDOW = re.compile(r"(\d+)(h|d)")
MAX_WINDOW_S = 366 * 86400
"""The longest window taken: a year (and a leap day). Longer ones would outlive any deployment,
and unbounded digits would not fit the store's 64-bit integers."""


def window_seconds(window: Any) -> int:
    """``completion_window`` in seconds: OpenAI accepts ``24h``; kvflow also takes other hours or days,
    up to ``MAX_WINDOW_S``."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None or not match[1].strip("0"):
        raise InvalidRequestError(f"completion_window must look like '24h', not {str(window)[:40]!r}",
                                  param="completion_window")
    digits = match[1].lstrip("0")
    seconds = int(digits) * (3600 if match[2] == "h" else 86400) if len(digits) <= 9 else MAX_WINDOW_S + 1
    if seconds > MAX_WINDOW_S:
        raise InvalidRequestError(f"completion_window must be at most 366d, not {window[:40]!r}",
                                  param="completion_window")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
    ):
        raise InvalidRequestError("metadata must map at most 16 strings (keys up to 64 characters, values up"
                                  " to 512) to strings", param="metadata")
    return dict(metadata)
