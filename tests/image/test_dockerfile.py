"""The Dockerfile's own defaults (for a plain `docker build`) are not a second source of truth."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import kvflow
from kvflow import NIXL_VERSION

ROOT = Path(__file__).resolve().parents[2]


def arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, f"the Dockerfile has no default for ARG {name}"
    return match.group(1)


def test_dockerfile_defaults_match_the_package() -> None:
    """The Dockerfile's own defaults (for `docker build` without arguments) are not a second truth."""
    assert arg_default("VERSION") == kvflow.__version__
    assert arg_default("NIXL_VERSION") == NIXL_VERSION
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", arg_default("BASE_IMAGE")), "an official slim Python"
    text = (ROOT / "Dockerfile").read_text()
    assert "USER 65532:65532" in text and 'ENTRYPOINT ["kvflow"]' in text
    assert {"AS kvflow", "AS kvflow-nixl"} <= set(re.findall(r"AS [\w-]+", text))
    assert os.access(ROOT / "scripts" / "image.sh", os.X_OK)


def test_the_build_context_is_an_allow_list() -> None:
    """Only what the wheel needs goes into the context: no .venv, .git, tests or benchmark output."""
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert allowed == {"pyproject.toml", "setup.py", "README.md"} | folders  # every folder the wheel maps

