"""``kvflow tokenizer fetch hf://ORG/NAME DIR``: a model's tokenizer files from the Hugging Face hub.

The operator runs this as an init container of routers and gateways whose model comes from the
hub: the engines download the whole model into their own cache, but the router needs only the
tokenizer (a few hundred kB), and needs it before it starts. Plain HTTPS GETs of the hub's
``resolve`` URLs; ``HF_TOKEN`` (or ``HUGGING_FACE_HUB_TOKEN``) authorises gated models and
``HF_ENDPOINT`` points at a mirror, as for vLLM.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from kvflow.cliargs import Parser

REQUIRED = ("tokenizer.json",)
OPTIONAL = ("tokenizer_config.json", "special_tokens_map.json")
DEFAULT_ENDPOINT = "https://huggingface.co"


def file_url(endpoint: str, repo: str, revision: str, name: str) -> str:
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{name}"


def _get(url: str, token: str | None, timeout: float) -> bytes | None:
    headers = {"User-Agent": "kvflow-tokenizer-fetch"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def fetch(repo: str, out: Path, *, revision: str = "main", endpoint: str | None = None,
          token: str | None = None, timeout: float = 60.0) -> list[str]:
    """Write the tokenizer files of ``repo`` into ``out``; return the names written."""
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    token = token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (*REQUIRED, *OPTIONAL):
        data = _get(file_url(endpoint, repo, revision, name), token, timeout)
        if data is None:
            if name in REQUIRED:
                raise FileNotFoundError(f"{repo}@{revision} has no {name} on {endpoint}")
            continue
        partial = out / f".{name}.partial"
        partial.write_bytes(data)
        partial.replace(out / name)  # a restarted init container never sees half a file
        written.append(name)
    return written


def main(argv: Sequence[str]) -> int:
    parser = Parser(prog="kvflow tokenizer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", allow_abbrev=False, help="download a hub model's tokenizer files into DIR")
    get.add_argument("source", help="hf://ORG/NAME")
    get.add_argument("dir", type=Path)
    get.add_argument("--revision", default="main")
    args = parser.parse_args(list(argv))
    if not args.source.startswith("hf://"):
        print(f"kvflow tokenizer: {args.source!r} is not an hf://ORG/NAME source", file=sys.stderr)
        return 2
    try:
        names = fetch(args.source.removeprefix("hf://"), args.dir, revision=args.revision)
    except (OSError, urllib.error.URLError) as exc:
        print(f"kvflow tokenizer: {exc}", file=sys.stderr)
        return 1
    print(f"kvflow tokenizer: {', '.join(names)} -> {args.dir}")
    return 0
