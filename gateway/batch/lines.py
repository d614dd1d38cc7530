"""The Batch API's file formats, as pure functions over bytes: no I/O, no clock.

Input lines are vLLM ``run-batch``'s (and OpenAI's) ``{"custom_id", "method", "url", "body"}``;
output and error lines are OpenAI's::

    {"id": "batch_req_…", "custom_id": "…", "response": {"status_code", "request_id", "body"}, "error": null}
    {"id": "batch_req_…", "custom_id": "…", "response": null, "error": {"code", "message"}}

A line whose request got a 2xx answer goes to the output file, every other line to the error
file: HTTP errors keep the answer's status and body under ``response``, and lines that could not
be sent at all (malformed JSON, no ``custom_id``, a wrong ``url``) carry an ``error`` instead.
A file is refused at upload only when nothing in it can run (empty, not UTF-8, no line is a
JSON object) or when its results could not be told apart (a ``custom_id`` used twice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError

ENDPOINTS: dict[str, str] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""Batch endpoints and the gateway's request kind for each."""

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class LineError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class InputLine:
    """One non-blank line of an input file: a request to run, or why it cannot run."""

    index: int
    """0-based among the file's non-blank lines: the order results are written in."""
    line_no: int
    """1-based line number in the file, for messages."""
    custom_id: str | None
    body: dict[str, Any] | None
    error: LineError | None = None


def raw_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) for every non-blank line; ``\\r\\n`` endings are accepted."""
    start, number = 0, 0
    while start <= len(data):  # one line at a time: a file of millions of lines is never split whole
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        number += 1
        line = data[start:end].strip()
        if line:
            yield number, line
        start = end + 1


def parse_line(index: int, line_no: int, raw: bytes, endpoint: str) -> InputLine:
    """The request on one line, checked against the batch's endpoint; never raises."""
    try:
        obj = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        return InputLine(index, line_no, None, None, LineError("invalid_json_line", f"line {line_no}: {exc}"))
    if not isinstance(obj, dict):
        return InputLine(index, line_no, None, None,
                         LineError("invalid_json_line", f"line {line_no}: expected a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _bad(index, line_no, None, "missing_custom_id", "custom_id must be a non-empty string")
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return _bad(index, line_no, custom_id, "invalid_method", f"method must be POST, not {method!r}")
    if url != endpoint:
        return _bad(index, line_no, custom_id, "invalid_url", f"url must be the batch's endpoint {endpoint}, not {url!r}")
    if not isinstance(body, dict):
        return _bad(index, line_no, custom_id, "invalid_body", "body must be a JSON object")
    stream = body.get("stream")
    if stream is not None and stream is not False:  # 1, "yes": not false, so not a batch line either
        why = "stream is not supported in a batch" if stream is True else f"stream must be a boolean, not {stream!r}"
        return _bad(index, line_no, custom_id, "invalid_body", why)
    return InputLine(index, line_no, custom_id, body)


def _bad(index: int, line_no: int, custom_id: str | None, code: str, message: str) -> InputLine:
    return InputLine(index, line_no, custom_id, None, LineError(code, f"line {line_no}: {message}"))


def parse_file(data: bytes, endpoint: str) -> list[InputLine]:
    return [parse_line(i, n, raw, endpoint) for i, (n, raw) in enumerate(raw_lines(data))]


@dataclass(frozen=True, slots=True)
class FileCheck:
    lines: int
    malformed: int
    """Lines that are not JSON objects: each becomes an error-file entry when the batch runs."""


def check_upload(data: bytes, max_lines: int | None = None) -> FileCheck:
    """Whether an uploaded ``purpose=batch`` file can be run (and has at most ``max_lines``
    lines); InvalidRequestError says why not."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the file is not UTF-8 text (byte {exc.start}); upload JSON lines",
                                  param="file") from None
    lines, malformed, first_problem = 0, 0, ""
    seen: dict[str, int] = {}
    for number, raw in raw_lines(data):
        lines += 1
        if max_lines is not None and lines > max_lines:
            raise InvalidRequestError(f"the file has more than {max_lines} lines (line {number}); split it into"
                                      " several batches", param="file")
        try:
            obj = _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            obj, first_problem = None, first_problem or f"line {number}: {exc}"
        if not isinstance(obj, dict):
            malformed += 1
            continue
        custom_id = obj.get("custom_id")
        if isinstance(custom_id, str) and custom_id:
            if custom_id in seen:
                raise InvalidRequestError(f"custom_id {custom_id!r} is used on lines {seen[custom_id]} and {number};"
                                          " each line needs its own", param="file")
            seen[custom_id] = number
    if lines == 0:
        raise InvalidRequestError("the file is empty: a batch file has one JSON request per line", param="file")
    if malformed == lines:
        why = first_problem or "no line is a JSON object"
        raise InvalidRequestError(f"no line of the file is a JSON request ({why})", param="file")
    return FileCheck(lines, malformed)


# --- results -----------------------------------------------------------------------------

def request_line_id(batch_id: str, index: int) -> str:
    """A stable id per line (the same after a restart finalises the batch again)."""
    return "batch_req_" + hashlib.blake2b(f"{batch_id}/{index}".encode(), digest_size=12).hexdigest()


def response_line(batch_id: str, index: int, custom_id: str | None, status: int, request_id: str,
                  body: bytes) -> bytes:
    """A line for a request that got an HTTP answer; ``body`` is the answer's JSON, passed through."""
    try:
        parsed: Any = _decoder.decode(body) if body else None
    except msgspec.DecodeError:
        parsed = {"error": {"message": body[:500].decode(errors="replace"), "type": "UpstreamError",
                            "param": None, "code": status}}
    return _encoder.encode({
        "id": request_line_id(batch_id, index), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": parsed}, "error": None,
    })


def error_line(batch_id: str, index: int, custom_id: str | None, error: LineError) -> bytes:
    """A line for a request that could not be sent (no HTTP answer to report)."""
    return _encoder.encode({
        "id": request_line_id(batch_id, index), "custom_id": custom_id, "response": None,
        "error": {"code": error.code, "message": error.message},
    })


def encode_body(body: dict[str, Any]) -> bytes:
    return _encoder.encode(body)
