"""``multipart/form-data`` bodies (file uploads), parsed from bytes: pure, no I/O.

The gateway's HTTP server hands handlers whole bodies (bounded by ``max_body_bytes``), so
parsing is a scan for the boundary; parts keep their bytes untouched (no charset guessing).
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

from kvflow.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None
    data: bytes


def _params(name: str, value: str) -> tuple[str, dict[str, str]]:
    """A header's value and its parameters (``form-data; name="file"; filename="a.jsonl"``)."""
    msg = Message()
    msg[name] = value
    params = msg.get_params(header=name) or []
    value = params[0][0].lower() if params else ""
    return value, {k.lower(): str(v) for k, v in params[1:]}


def parse_form(content_type: str | None, body: bytes) -> dict[str, Part]:
    """The form's parts by name; InvalidRequestError when the body is not a multipart form."""
    kind, params = _params("content-type", content_type or "")
    boundary = params.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise InvalidRequestError("upload files as multipart/form-data with fields 'file' and 'purpose'")
    delimiter = b"--" + boundary.encode("latin-1")
    chunks = body.split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise InvalidRequestError("the multipart body is incomplete (no closing boundary)")
    parts: dict[str, Part] = {}
    for chunk in chunks[1:-1]:
        head, sep, data = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise InvalidRequestError("a multipart part has no header/body separator")
        headers = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        disposition, dparams = _params("content-disposition", headers.get("content-disposition", ""))
        if disposition != "form-data" or "name" not in dparams:
            raise InvalidRequestError("a multipart part has no 'Content-Disposition: form-data; name=...'")
        parts[dparams["name"]] = Part(dparams["name"], dparams.get("filename"), data.removesuffix(b"\r\n"))
    return parts
