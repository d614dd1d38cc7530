"""What two answers to the same request must share: the facts the conformance suite compares.

Standard library only (the golden capture script imports cases.py beside it). Sampled text is
random, so answers are compared by status, the error object (exactly), the JSON shape (keys in
order and value types), choices and their indexes, finish reasons, usage, token counts, prompt
token ids, logprob shapes, echoes and, for streams, how each choice's chunks look and interleave.

One fact is a set compared by inclusion (``SUBSET_FACTS``): the shapes of a stream's middle
chunks. vLLM merges the deltas of a choice when the HTTP writer falls behind the engine, so a
live answer may have fewer (even no) middle chunks than the capture, never other ones; for the
same reason whether several choices' chunks interleave (``TIMING_FACTS``) is only compared for
the simulator.
"""

from __future__ import annotations

import json
from typing import Any

from .cases import CHAT, Case

SUBSET_FACTS = ("mid_shapes",)
TIMING_FACTS = ("interleaved",)
"""Facts of a live vLLM's answer that depend on its timing (the capture keeps the canonical one)."""


def shape(value: Any) -> Any:
    """Keys in order and JSON types, recursively; data-keyed dicts (token -> logprob) by one value."""
    if isinstance(value, dict):
        if value and _data_keyed(value):
            return {"*": shape(next(iter(value.values())))}
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        # a list of scalars (token ids, bytes, offsets) may be empty by chance: its shape is "list";
        # a list of objects takes its fullest item's shape
        items = [shape(v) for v in value if isinstance(v, (dict, list))]
        return [max(items, key=lambda s: len(repr(s)))] if items else "list"
    return type(value).__name__


def _data_keyed(d: dict[str, Any]) -> bool:
    """A top-logprobs dict (token text -> float) or a prompt-logprobs dict (token id -> logprob)."""
    values = list(d.values())
    return all(isinstance(v, float) for v in values) or all(isinstance(v, dict) and "rank" in v for v in values)


def facts(case: Case, status: int, content_type: str, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status}
    if text:
        out["media"] = content_type.split(";")[0].strip()
    if text.startswith("data: "):
        out.update(_stream(case, text))
        return out
    try:
        body = json.loads(text) if text else text
    except ValueError:
        return {**out, "body": text}
    if isinstance(body, dict) and ("error" in body or "detail" in body):
        return {**out, "body": body}
    if case.path in ("/v1/completions", CHAT):
        return {**out, **_answer(case, body)}
    if case.path == "/v1/models":
        return {**out, "shape": shape(body), "ids": [m["id"] for m in body["data"]]}
    return {**out, "body": body}


def _expected_echo(case: Case) -> str | None:
    body = case.body
    if case.path == CHAT:
        content = body["messages"][-1].get("content")
        return content if isinstance(content, str) else None
    return body["prompt"] if isinstance(body.get("prompt"), str) else None


def _answer(case: Case, body: dict[str, Any]) -> dict[str, Any]:
    chat = case.path == CHAT
    choices = body["choices"]
    out: dict[str, Any] = {
        "shape": shape(body),
        "choices": [(c["index"], c["finish_reason"], c["stop_reason"]) for c in choices],
        "usage": body["usage"],
        "prompt_token_ids": body.get("prompt_token_ids") if chat else [c["prompt_token_ids"] for c in choices],
        "token_id_counts": [None if c["token_ids"] is None else len(c["token_ids"]) for c in choices],
    }
    if chat:
        out["roles"] = [c["message"]["role"] for c in choices]
    prefix = _expected_echo(case)
    if prefix and case.body.get("echo"):
        texts = [c["message"]["content"] if chat else c["text"] for c in choices]
        out["echoed"] = [t.startswith(prefix) for t in texts]
    out["logprobs"] = [_logprobs(case, c["logprobs"], chat) for c in choices]
    prompt_logprobs = body.get("prompt_logprobs") if chat else choices[0].get("prompt_logprobs")
    out["prompt_logprobs"] = _prompt_logprobs(case, prompt_logprobs)
    return out


def _k(case: Case, chat: bool) -> int:
    return int(case.body.get("top_logprobs") or 0) if chat else int(case.body.get("logprobs") or 0)


def _logprobs(case: Case, lp: dict[str, Any] | None, chat: bool) -> Any:
    if lp is None:
        return None
    k = _k(case, chat)
    if chat:
        content = lp["content"]
        return {"count": len(content), "top_sizes": sorted({len(c["top_logprobs"]) for c in content}),
                "chosen_first": all(c["top_logprobs"][0]["token"] == c["token"] for c in content if c["top_logprobs"]),
                "bytes": all(c["bytes"] == list(c["token"].encode("utf-8", errors="replace")) for c in content)}
    tokens, offsets, tops = lp["tokens"], lp["text_offset"], lp["top_logprobs"]
    return {"count": len(tokens),
            "aligned": len(tokens) == len(lp["token_logprobs"]) == len(offsets) == len(tops),
            "nulls": sum(v is None for v in lp["token_logprobs"]),
            "offsets": offsets == [sum(len(t) for t in tokens[:i]) + offsets[0] for i in range(len(tokens))],
            "top_sizes_ok": all(t is None or 1 <= len(t) <= k + 1 for t in tops),
            "chosen_first": all(t is None or next(iter(t)) == tok for t, tok in zip(tops, tokens, strict=True))}


def _prompt_logprobs(case: Case, plp: list[Any] | None) -> Any:
    if plp is None:
        return None
    k = int(case.body.get("prompt_logprobs") or case.body.get("logprobs") or case.body.get("top_logprobs") or 0)
    return {"count": len(plp), "first_null": plp[0] is None,
            "sizes_ok": all(1 <= len(d) <= k + 1 for d in plp[1:]),
            "fields": sorted({tuple(v) for d in plp[1:] for v in d.values()})}


def _stream(case: Case, text: str) -> dict[str, Any]:
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    out: dict[str, Any] = {"done": events[-1] == "[DONE]"}
    chunks = [json.loads(e) for e in events[:-1]]
    if chunks and "error" in chunks[0]:
        return {**out, "error_event": chunks[0], "events": len(events)}
    chat = case.path == CHAT
    per_index: dict[int, list[dict[str, Any]]] = {}
    order = []
    for c in chunks:
        if c["choices"]:
            i = c["choices"][0]["index"]
            per_index.setdefault(i, []).append(c)
            order.append(i)
    tail = chunks[-1] if chunks and not chunks[-1]["choices"] else None
    out["ids"] = len({c["id"] for c in chunks}) == 1
    out["usage_chunk"] = None if tail is None else {"shape": shape(tail), "usage": tail["usage"]}
    out["indexes"] = sorted(per_index)
    out["interleaved"] = _interleaved(order)
    out["choices"] = {i: _choice_stream(case, cs, chat) for i, cs in per_index.items()}
    return out


def _interleaved(order: list[int]) -> bool:
    """True when some choice's chunk comes between two chunks of another."""
    seen_done: set[int] = set()
    last = None
    for i in order:
        if i != last and i in seen_done:
            return True
        if last is not None and i != last:
            seen_done.add(last)
        last = i
    return False


def _choice_stream(case: Case, cs: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    first, last = cs[0], cs[-1]
    choice0, choice_last = first["choices"][0], last["choices"][0]
    out: dict[str, Any] = {
        "first_shape": shape(first) if chat else None, "last_shape": shape(last),
        "mid_shapes": frozenset(json.dumps(shape(c)) for c in cs[1:-1] if not chat or c is not cs[1]),
        "finish": (choice_last["finish_reason"], choice_last.get("stop_reason")),
        "fingerprint_on_last_only": ["system_fingerprint" in c for c in cs] == [False] * (len(cs) - 1) + [True],
        "usage_on_every_chunk": all("usage" in c for c in cs),
        "token_id_total": sum(len(c["choices"][0].get("token_ids") or []) for c in cs),
    }
    if chat:
        out["role"] = choice0["delta"].get("role")
        out["prompt_token_ids"] = first.get("prompt_token_ids")
        if case.body.get("echo"):
            out["echo"] = cs[1]["choices"][0]["delta"].get("content") if len(cs) > 1 else None
        out["logprob_tokens"] = sum(len((c["choices"][0].get("logprobs") or {}).get("content") or []) for c in cs)
    else:
        out["prompt_token_ids"] = choice0.get("prompt_token_ids")
        prefix = _expected_echo(case)
        if prefix and case.body.get("echo"):
            out["echoed"] = choice0["text"].startswith(prefix)
        out["logprob_tokens"] = sum(len((c["choices"][0].get("logprobs") or {}).get("tokens") or []) for c in cs)
    if "usage" in last:
        out["last_usage"] = last["usage"]
    return out


def same(got: Any, want: Any, *, live: bool = False) -> bool:
    """Fact for fact equality, except that a ``SUBSET_FACTS`` set may be smaller than the one wanted
    (and, for a live vLLM, ``TIMING_FACTS`` are not compared)."""
    if isinstance(got, dict) and isinstance(want, dict):
        if got.keys() != want.keys():
            return False
        return all(got[k] <= want[k] if k in SUBSET_FACTS else (live and k in TIMING_FACTS)
                   or same(got[k], want[k], live=live) for k in got)
    return bool(got == want)
