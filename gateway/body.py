"""The gateway's body checks are the core's (``kvflow.request_body``), shared with the sidecar and
the ext_proc server: one parser, one refusal of client ``kv_transfer_params``, one body budget."""

from __future__ import annotations

from kvflow.request_body import (
    KV_PARAMS, BodyBudget, client_body, client_kv_params, parse_json, scrub_answer, too_deep,
)

__all__ = ["KV_PARAMS", "BodyBudget", "client_body", "client_kv_params", "parse_json", "scrub_answer", "too_deep"]
