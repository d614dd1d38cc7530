"""Multipart uploads: the bodies the official openai SDK and `kvflow batch` send parse back exactly."""

from __future__ import annotations

import httpx2
import openai
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.batch.forms import parse_form

DATA = b'{"custom_id": "a"}\r\n{"custom_id": "b"}\n\r\n--not-the-boundary\n'


def sdk_upload(data: bytes, filename: str) -> tuple[str, bytes]:
    """What ``client.files.create`` puts on the wire."""
    seen: dict[str, object] = {}

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen["type"], seen["body"] = request.headers["content-type"], request.read()
        return httpx2.Response(200, json={"id": "file-1", "object": "file", "bytes": 1, "created_at": 1,
                                          "filename": filename, "purpose": "batch", "status": "processed"})

    client = openai.OpenAI(base_url="http://gateway/v1", api_key="k",
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    client.files.create(file=(filename, data), purpose="batch")
    return str(seen["type"]), bytes(seen["body"])  # type: ignore[arg-type]


def test_the_sdks_upload_parses_to_its_file_and_purpose() -> None:
    content_type, body = sdk_upload(DATA, "my requests.jsonl")
    form = parse_form(content_type, body)
    assert form["purpose"].data == b"batch"
    assert (form["file"].filename, form["file"].data) == ("my requests.jsonl", DATA)


def test_kvflow_batch_uploads_parse_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvflow.batchcli import Client

    sent: dict[str, object] = {}

    class Capture(Client):
        def call(self, method: str, path: str, body: bytes | None = None, content_type: str = "") -> bytes:
            sent["type"], sent["body"] = content_type, body
            return b'{"id": "file-1"}'

    path = tmp_path / "in.jsonl"
    path.write_bytes(DATA)
    Capture("http://gateway", None).upload(path)
    form = parse_form(str(sent["type"]), bytes(sent["body"]))  # type: ignore[arg-type]
    assert (form["purpose"].data, form["file"].filename, form["file"].data) == (b"batch", "in.jsonl", DATA)


@pytest.mark.parametrize(("content_type", "body", "message"), [
    ("application/json", b"{}", "multipart/form-data"),
    ("multipart/form-data", b"", "multipart/form-data"),
    ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nx", "incomplete"),
    ("multipart/form-data; boundary=b", b"--b\r\nno separator--b--", "separator"),
    ("multipart/form-data; boundary=b", b"--b\r\nX: y\r\n\r\nx\r\n--b--", "Content-Disposition"),
], ids=["json", "no-boundary", "unterminated", "no-header-end", "no-disposition"])
def test_bodies_that_are_not_forms_are_a_400(content_type: str, body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_form(content_type, body)
