"""``kvflow batch``: submit a JSONL file to a gateway's Batch API, watch it, fetch the results.

    kvflow batch submit requests.jsonl --wait      # upload, create, show progress until done
    kvflow batch status batch_…                    # one line; --wait follows it
    kvflow batch results batch_… -o out.jsonl      # the output file (errors: out.errors.jsonl)
    kvflow batch cancel batch_…

The gateway is ``--url`` (default ``$KVFLOW_URL`` or http://127.0.0.1:8080, what ``kvflow up``
serves); ``--api-key`` (default ``$KVFLOW_API_KEY``) when it checks keys. A client only: the
standard library's HTTP, no kvflow component imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from kvflow.cliargs import Parser

DONE = ("completed", "failed", "expired", "cancelled")


class CliError(Exception):
    """A one-line message for the user; the command exits 1."""


# --- the progress bar (pure) ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    finished: int


def progress_line(batch: dict[str, Any], first: Sample, now: Sample, width: int = 24) -> str:
    """``[#####-----] 600/1000 done 590 failed 10 48.2/s ETA 0:08 in_progress``."""
    counts = batch.get("request_counts") or {}
    total, ok, failed = int(counts.get("total", 0)), int(counts.get("completed", 0)), int(counts.get("failed", 0))
    finished = ok + failed
    filled = round(width * finished / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    elapsed = now.at - first.at
    rate = (now.finished - first.finished) / elapsed if elapsed > 0 else 0.0
    eta = _clock((total - finished) / rate) if rate > 0 and total > finished else "-"
    return f"[{bar}] {finished}/{total} done {ok} failed {failed} {rate:.1f}/s ETA {eta} {batch.get('status', '?')}"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def summary(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    files = f"output {batch.get('output_file_id') or '-'}, errors {batch.get('error_file_id') or '-'}"
    return (f"{batch['id']} {batch['status']}: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed"
            f" of {counts.get('total', 0)} ({files})")


def endpoint_of(path: Path) -> str:
    """The ``url`` of the file's first request line (a batch has one endpoint)."""
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if isinstance(url, str):
                    return url
                break
    raise CliError(f"{path}: the first line has no 'url'; pass --endpoint")


# --- HTTP -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Client:
    url: str
    api_key: str | None

    def call(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json") -> bytes:
        headers = {"Content-Type": content_type} if body is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        root = self.url.rstrip("/").removesuffix("/v1")  # the gateway's root, or OpenAI's spelling of it
        request = urllib.request.Request(root + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            raise CliError(f"{method} {path}: HTTP {exc.code}: {_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CliError(f"cannot reach the gateway at {self.url} ({exc}); is `kvflow up` running?") from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        raw = self.call(method, path, None if body is None else json.dumps(body).encode())
        data: dict[str, Any] = json.loads(raw)
        return data

    def upload(self, path: Path) -> dict[str, Any]:
        boundary = uuid.uuid4().hex
        body = b"".join([
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n".encode(),
            path.read_bytes(), f"\r\n--{boundary}--\r\n".encode(),
        ])
        data: dict[str, Any] = json.loads(self.call("POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}"))
        return data


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace")


# --- commands ---------------------------------------------------------------------------------

def watch(client: Client, batch_id: str, out: TextIO, interval: float = 1.0) -> dict[str, Any]:
    """Follow a batch until it ends, redrawing one progress line (a new line each time off a TTY)."""
    tty = out.isatty()
    first: Sample | None = None
    last_print = 0.0
    while True:
        batch = client.json("GET", f"/v1/batches/{batch_id}")
        counts = batch.get("request_counts") or {}
        sample = Sample(time.monotonic(), int(counts.get("completed", 0)) + int(counts.get("failed", 0)))
        first = first or sample
        if batch["status"] in DONE or tty or sample.at - last_print >= 10 * interval:
            line = progress_line(batch, first, sample)
            out.write(f"\r{line}\033[K" if tty else line + "\n")
            out.flush()
            last_print = sample.at
        if batch["status"] in DONE:
            if tty:
                out.write("\n")
            return batch
        time.sleep(interval)


def submit(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    endpoint = args.endpoint or endpoint_of(path)
    uploaded = client.upload(path)
    metadata = dict(kv.split("=", 1) for kv in args.metadata) if args.metadata else None
    batch = client.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                "completion_window": args.window, "metadata": metadata})
    print(batch["id"], file=out, flush=True)
    if not args.wait:
        return 0
    batch = watch(client, batch["id"], out, args.interval)
    print(summary(batch), file=out)
    return 0 if batch["status"] == "completed" else 1


def status(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    batch = watch(client, args.id, out, args.interval) if args.wait else client.json("GET", f"/v1/batches/{args.id}")
    print(json.dumps(batch, indent=2) if args.json else summary(batch), file=out)
    return 0


def results(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    batch = client.json("GET", f"/v1/batches/{args.id}")
    if batch["status"] not in DONE:
        raise CliError(f"{args.id} is {batch['status']}: results come when it ends (kvflow batch status --wait)")
    target = Path(args.output)
    errors = Path(args.errors) if args.errors else target.with_name(target.name.removesuffix(".jsonl") + ".errors.jsonl")
    for file_id, where in ((batch.get("output_file_id"), target), (batch.get("error_file_id"), errors)):
        data = client.call("GET", f"/v1/files/{file_id}/content") if file_id else b""
        where.write_bytes(data)
        lines = data.count(b"\n")
        print(f"{where}: {lines} lines", file=out)
    return 0


def cancel(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    print(summary(client.json("POST", f"/v1/batches/{args.id}/cancel")), file=out)
    return 0


def parser() -> Parser:
    p = Parser(prog="kvflow batch", description="Run JSONL request files on a kvflow gateway.")
    p.add_argument("--url", default=os.environ.get("KVFLOW_URL", "http://127.0.0.1:8080"), help="the gateway")
    p.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"), help="an API key the gateway accepts")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", allow_abbrev=False, help="upload FILE and start a batch")
    s.add_argument("file")
    s.add_argument("--endpoint", help="/v1/completions or /v1/chat/completions (default: the first line's url)")
    s.add_argument("--window", default="24h", help="completion window (default 24h)")
    s.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    st = sub.add_parser("status", allow_abbrev=False, help="one batch's status")
    st.add_argument("id")
    st.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    st.add_argument("--json", action="store_true", help="print the whole Batch object")
    r = sub.add_parser("results", allow_abbrev=False, help="download a finished batch's output and error files")
    r.add_argument("id")
    r.add_argument("-o", "--output", required=True, help="where the output file goes")
    r.add_argument("--errors", help="where the error file goes (default: OUTPUT with .errors.jsonl)")
    c = sub.add_parser("cancel", allow_abbrev=False, help="stop a batch: lines not started do not run, finished ones are kept")
    c.add_argument("id")
    for command in (s, st):
        command.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    return p


COMMANDS = {"submit": submit, "status": status, "results": results, "cancel": cancel}


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    client = Client(args.url, args.api_key)
    try:
        return COMMANDS[args.command](client, args, sys.stdout)
    except CliError as exc:
        print(f"kvflow batch: {exc}", file=sys.stderr)
        return 1
