"""A request body is a JSON object nested at most ``max_depth`` deep, or a 400 saying why not."""

from __future__ import annotations

import json

import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.body import parse_json


def nested(depth: int) -> bytes:
    """A body whose ``user`` field nests objects so that the body is ``depth`` containers deep."""
    return b'{"model":"m","user":' + b'{"a":' * (depth - 1) + b"1" + b"}" * (depth - 1) + b"}"


def test_a_body_as_deep_as_the_limit_is_read_and_one_level_more_is_refused() -> None:
    assert parse_json(nested(8), max_depth=8)["model"] == "m"
    with pytest.raises(InvalidRequestError, match="nested deeper than 8 levels"):
        parse_json(nested(9), max_depth=8)


def test_many_brackets_side_by_side_are_not_depth() -> None:
    # more brackets than the limit, but three deep (the body, its list, their lists): walked, and read
    body = json.dumps({"model": "m", "prompt": [[1, 2]] * 100}).encode()
    assert len(parse_json(body, max_depth=3)["prompt"]) == 100
    with pytest.raises(InvalidRequestError, match="deeper than 3"):
        parse_json(json.dumps({"model": "m", "prompt": [[1, 2]] * 99 + [[[1]]]}).encode(), max_depth=3)


def test_brackets_inside_a_long_prompt_are_text() -> None:
    prompt = "x[{ " * 20_000
    assert parse_json(json.dumps({"model": "m", "prompt": prompt}).encode(), max_depth=2)["prompt"] == prompt


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"not json", b'{"a": 1'])
def test_anything_but_a_json_object_is_a_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_json(raw)
