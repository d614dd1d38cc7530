"""The ``kvflow`` command: one subcommand per component, each parsed by its own module.

Each component exposes ``main(argv) -> int``; this file only dispatches, so importing the
CLI never drags in a component's dependencies.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvflow.local.up", "start the local stack: simulated or real vLLM pods, router and gateway"),
    "sim": ("kvflow.sim.cli", "run one vLLM-compatible simulated model server"),
    "router": ("kvflow.router.cli", "run the endpoint picker (Envoy ext_proc server)"),
    "gateway": ("kvflow.gateway.cli", "run the OpenAI-compatible gateway"),
    "operator": ("kvflow.operator.cli", "run the Kubernetes operator, or render its objects"),
    "batch": ("kvflow.batchcli", "submit a JSONL file to the gateway's Batch API, watch it, get results"),
    "status": ("kvflow.statuscli", "show pods, routing decisions and batches (kubectl-style tables)"),
    "tokenizer": ("kvflow.tokenizer_fetch", "fetch a hub model's tokenizer files (routers' init container)"),
    "bench": ("kvflow.local.benchcli", "run a benchmark from bench/"),
}


def usage() -> str:
    lines = ["usage: kvflow <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "Run 'kvflow <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from kvflow import __version__

        print(f"kvflow {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvflow: unknown command {name!r} (try 'kvflow --help')", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a mistake in what was asked is one line; KVFLOW_TRACEBACK=1 shows where
        if not mistake(exc) or os.environ.get("KVFLOW_TRACEBACK"):
            raise
        print(f"kvflow {name}: {one_line(exc)}", file=sys.stderr)
        return 2


def mistake(exc: BaseException) -> bool:
    """What a wrong option, a missing or malformed file, or a taken port raises: ValueError
    (pydantic's ValidationError and JSON errors are ones), OSError, and YAML's errors."""
    return isinstance(exc, ValueError | OSError) or type(exc).__module__.startswith("yaml")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return text[:500]


if __name__ == "__main__":
    sys.exit(main())
