"""vLLM's request schema, body by body: kvflow.openai_api and the gateway refuse what vLLM refuses.

tests/golden/vllm_request_validation.json records how vLLM 0.32's own request models judge a
corpus of bodies (every exactly-declared field with a value of every JSON type, plus the
combinations its before-checks look at), rendered as its HTTP layer renders the refusal
(tests/golden/capture/capture_validation.py). Both of kvflow's validators must answer each body
alike: accepted, or refused with the same type, param and message. pydantic words its messages
per release: with another pydantic than the capture's, the message is not compared.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from kvflow.errors import KvflowError
from kvflow.gateway import validation as gateway
from kvflow.openai_api import validate

from .targets import golden

CORPUS = golden("vllm_request_validation.json")
SAME_PYDANTIC = CORPUS["pydantic_version"] == pydantic.VERSION
ENTRIES = CORPUS["entries"]


def verdict(check: Any, kind: str, body: Any) -> dict[str, Any] | None:
    try:
        check(kind, body)
    except KvflowError as exc:
        got = {"type": exc.type, "message": exc.message, "param": exc.param}
        return got if SAME_PYDANTIC else {**got, "message": None}
    return None


def expected(entry: dict[str, Any]) -> dict[str, Any] | None:
    want = entry["error"]
    return want if want is None or SAME_PYDANTIC else {**want, "message": None}


def test_the_corpus_covers_acceptance_and_refusal() -> None:
    assert {e["error"] is None for e in ENTRIES} == {True, False} and len(ENTRIES) > 1000


@pytest.mark.parametrize("kind", ["completions", "chat", "detokenize"])
def test_kvflow_judges_every_body_as_vllm(kind: str) -> None:
    entries = [e for e in ENTRIES if e["kind"] == kind]
    wrong = [(e["body"], verdict(validate, kind, e["body"]), expected(e)) for e in entries
             if verdict(validate, kind, e["body"]) != expected(e)]
    assert wrong == []


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_gateway_judges_every_body_as_vllm(kind: str) -> None:
    entries = [e for e in ENTRIES if e["kind"] == kind]
    wrong = [(e["body"], verdict(gateway.validate, kind, e["body"]), expected(e)) for e in entries
             if verdict(gateway.validate, kind, e["body"]) != expected(e)]
    assert wrong == []
