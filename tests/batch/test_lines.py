"""Batch file formats: which lines run, which become error entries, which files are refused."""

from __future__ import annotations

import json

import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.batch.lines import (
    LineError, check_upload, error_line, parse_file, parse_line, request_line_id, response_line,
)

EP = "/v1/completions"
GOOD = {"custom_id": "a", "method": "POST", "url": EP, "body": {"model": "m", "prompt": "hi"}}


def line(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def test_a_well_formed_line_is_a_request() -> None:
    parsed = parse_line(0, 1, line(), EP)
    assert (parsed.custom_id, parsed.body, parsed.error) == ("a", {"model": "m", "prompt": "hi"}, None)


@pytest.mark.parametrize(("raw", "custom_id", "code"), [
    (b"{not json", None, "invalid_json_line"),
    (b"[1, 2]", None, "invalid_json_line"),
    (line(custom_id=""), None, "missing_custom_id"),
    (json.dumps({"method": "POST", "url": EP, "body": {}}).encode(), None, "missing_custom_id"),
    (line(method="GET"), "a", "invalid_method"),
    (line(url="/v1/chat/completions"), "a", "invalid_url"),
    (line(body="prompt"), "a", "invalid_body"),
    (line(body={"model": "m", "prompt": "x", "stream": True}), "a", "invalid_body"),
    (line(body={"model": "m", "prompt": "x", "stream": 1}), "a", "invalid_body"),
    (line(body={"model": "m", "prompt": "x", "stream": "true"}), "a", "invalid_body"),
], ids=["not-json", "not-an-object", "empty-custom-id", "no-custom-id", "get", "other-endpoint", "body-not-object",
        "stream", "stream-as-1", "stream-as-a-string"])
def test_a_line_that_cannot_run_carries_its_error_and_custom_id(raw: bytes, custom_id: str | None, code: str) -> None:
    parsed = parse_line(3, 7, raw, EP)
    assert (parsed.custom_id, parsed.body) == (custom_id, None)
    assert parsed.error is not None and parsed.error.code == code and parsed.error.message.startswith("line 7: ")


def test_blank_lines_are_skipped_and_indexes_follow_the_remaining_lines() -> None:
    parsed = parse_file(line() + b"\r\n\n  \n" + line(custom_id="b") + b"\n", EP)
    assert [(p.index, p.line_no, p.custom_id) for p in parsed] == [(0, 1, "a"), (1, 4, "b")]


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the file is empty"),
    (b"\n \n", "the file is empty"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"hello\nworld\n", "no line of the file is a JSON request"),
    (line() + b"\n" + line(), "custom_id 'a' is used on lines 1 and 2"),
], ids=["empty", "blank", "binary", "prose", "duplicate-custom-id"])
def test_uploads_that_cannot_run_are_refused_with_the_reason(data: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        check_upload(data)
    assert info.value.status == 400 and info.value.param == "file"


def test_an_upload_with_some_malformed_lines_is_accepted() -> None:
    check = check_upload(line() + b"\n{oops\n" + line(custom_id="b"))
    assert (check.lines, check.malformed) == (3, 1)


def test_output_lines_have_openais_shape_and_pass_the_body_through() -> None:
    body = b'{"id":"cmpl-1","choices":[{"text":"x"}]}'
    out = json.loads(response_line("batch_1", 4, "a", 200, "req-9", body))
    assert out == {"id": request_line_id("batch_1", 4), "custom_id": "a", "error": None,
                   "response": {"status_code": 200, "request_id": "req-9", "body": json.loads(body)}}
    assert out["id"].startswith("batch_req_") and request_line_id("batch_1", 4) != request_line_id("batch_1", 5)


def test_error_lines_carry_code_and_message_and_no_response() -> None:
    out = json.loads(error_line("batch_1", 0, None, LineError("invalid_json_line", "line 1: bad")))
    assert out["response"] is None and out["custom_id"] is None
    assert out["error"] == {"code": "invalid_json_line", "message": "line 1: bad"}


def test_a_non_json_answer_is_kept_as_an_error_body() -> None:
    out = json.loads(response_line("b", 0, "a", 502, "r", b"<html>bad gateway</html>"))
    assert out["response"]["body"]["error"]["message"] == "<html>bad gateway</html>"
