"""``kvflow status``: what the gateway (or a router) is doing, as ``kubectl get`` tables.

    kvflow status                          # pods, last decisions, batches of http://127.0.0.1:8080
    kvflow status --watch                  # redraw every second (Ctrl-C stops)
    kvflow status -o json                  # the status API's document as it came
    kvflow status --url http://router:9090 # a standalone ``kvflow router``'s metrics port

It reads ``/v1/kvflow/status`` (``kvflow.router.status_api``), the document the status page
draws. ``--api-key`` (default ``$KVFLOW_API_KEY``) must be an admin key where the gateway checks
keys. A client only: the standard library's HTTP, no kvflow component imported. Every error is
one line (``kvflow status: ...``) and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO
from kvflow.cliargs import Parser

STATUS_PATH = "/v1/kvflow/status"


class CliError(Exception):
    """A one-line message for the user; the command exits 1."""


# --- the tables (pure) -----------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as ``kubectl get`` lays them out: upper-case headers, left-aligned, three spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = []
    for row in (headers, *rows):
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        lines.append("   ".join(cells).rstrip())
    return lines


def _num(v: Any, unit: str = "", digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def render(doc: dict[str, Any], decisions: int = 5) -> str:
    """The status document as three tables: pods, the last decisions, active batches."""
    now = float(doc.get("time", time.time()))
    pods, picks = [], []
    for m in doc.get("models", []):
        for p in m.get("pods", []):
            kv = p.get("kv_events")
            served = p.get("served")
            health = "-" if p.get("healthy") is None else "Healthy" if p["healthy"] else "Unhealthy"
            pods.append([m["model"], p["id"], p["role"], health, _num(p.get("in_flight")), _num(p.get("running")),
                         _num(p.get("waiting")), _pct(p.get("kv_usage")), _pct(p.get("prefix_hit_rate")),
                         ",".join(p.get("loras") or []) or "-", _num(p.get("last_scrape_s"), "s", 1),
                         "-" if not kv or kv.get("lag_s") is None else f"{1000 * kv['lag_s']:.1f}ms",
                         "-" if served is None else str(served["requests"])])
        for d in m.get("decisions", [])[:decisions]:
            picks.append([m["model"], _age(now - float(d.get("time") or now)), str(d.get("request_id")),
                          d.get("mode") or "error", d.get("pick") or "-", d.get("prefill") or "-",
                          f"{d.get('cached_tokens', 0)}/{d.get('prompt_tokens', 0)}", d.get("reason", "")])
    out = table(["MODEL", "POD", "ROLE", "HEALTH", "IN-FLIGHT", "RUNNING", "WAITING", "KV-CACHE", "PREFIX-HIT",
                 "LORA", "SCRAPED", "KV-LAG", "SERVED"], pods)
    out += ["", *table(["MODEL", "AGE", "REQUEST", "MODE", "POD", "PREFILL", "CACHED", "WHY"], picks)]
    batches = [[b["id"], b["status"], b["endpoint"], f"{b['completed'] + b['failed']}/{b['total']}", str(b["completed"]),
                str(b["failed"])] for b in doc.get("batches", [])]
    if batches:
        out += ["", *table(["BATCH", "STATUS", "ENDPOINT", "PROGRESS", "DONE", "FAILED"], batches)]
    return "\n".join(out)


# --- the one call ----------------------------------------------------------------------------


def fetch(url: str, api_key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + STATUS_PATH)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        hint = " (pass an admin key with --api-key or $KVFLOW_API_KEY)" if exc.code in (401, 403) else ""
        raise CliError(f"{url}: HTTP {exc.code}: {_message(exc.read())}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"cannot reach {url} ({reason}); is `kvflow up` running?") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CliError(f"{url}{STATUS_PATH} did not answer JSON: is it a kvflow gateway or router?") from None
    if not isinstance(doc, dict) or "kvflow_status" not in doc:
        raise CliError(f"{url}{STATUS_PATH} is not a kvflow status document")
    return doc


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace").strip() or "no message"


def show(args: argparse.Namespace, out: TextIO) -> int:
    while True:
        doc = fetch(args.url, args.api_key)
        if args.output == "json":
            out.write(json.dumps(doc, indent=None if args.watch else 2) + "\n")
        else:
            if args.watch and out.isatty():
                out.write("\x1b[H\x1b[2J")  # clear the screen: the tables are redrawn in place
            out.write(render(doc, args.decisions) + "\n")
            if args.watch:
                out.write("\n")
        out.flush()
        if not args.watch:
            return 0
        time.sleep(args.interval)


def parser() -> Parser:
    p = Parser(prog="kvflow status", description="Pods, routing decisions and batches, as tables.")
    p.add_argument("--url", default=os.environ.get("KVFLOW_URL", "http://127.0.0.1:8080"),
                   help="the gateway, or a router's metrics port (default $KVFLOW_URL or http://127.0.0.1:8080)")
    p.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"), help="an admin API key ($KVFLOW_API_KEY)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table", help="table (default) or json")
    p.add_argument("-w", "--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch (default 1)")
    p.add_argument("--decisions", type=int, default=5, help="decisions shown per model (default 5)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    try:
        return show(args, sys.stdout)
    except CliError as exc:
        print(f"kvflow status: {exc}", file=sys.stderr)
        return 1
