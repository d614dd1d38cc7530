"""``kvflow bench NAME``: run ``bench/bench_NAME.py`` from a source checkout (``all`` runs each)."""

from __future__ import annotations

import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def main(argv: Sequence[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvflow bench NAME|all [args...]\nbenchmarks: " + (", ".join(names) or "(none: not a source checkout)"))
        return 0
    name, rest = argv[0], list(argv[1:])
    if name == "all":
        return max((subprocess.call([sys.executable, str(BENCH_DIR / f"bench_{n}.py")]) for n in names), default=0)
    if name not in names:
        print(f"kvflow bench: no benchmark {name!r}; have: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [f"bench_{name}.py", *rest]
    sys.path.insert(0, str(BENCH_DIR))  # as ``python bench/bench_NAME.py`` would: the harness imports
    runpy.run_path(str(BENCH_DIR / f"bench_{name}.py"), run_name="__main__")
    return 0
