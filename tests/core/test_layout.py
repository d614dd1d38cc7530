"""The package layout: components under kvflow.*, nothing shadows the standard library."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_operator_is_not_shadowed_from_the_repository_root():
    out = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert not out.strip().startswith(str(ROOT))


@pytest.mark.parametrize("folder", ["operator", "gateway", "router", "sim", "beam"])
def test_components_live_in_top_level_folders(folder):
    link = ROOT / "kvflow" / folder
    assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve()


def test_cli_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "kvflow", "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("up", "sim", "router", "gateway", "operator", "batch", "bench"):
        assert f"  {name} " in out


def test_unknown_subcommand_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "kvflow", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "kvflow: unknown command 'frobnicate' (try 'kvflow --help')"


def test_core_does_not_import_components():
    protocols = [f"protocol/{path.stem}" for path in (ROOT / "kvflow" / "protocol").glob("*.py")]
    for name in ("hashing", "tokenizer", "endpoints", "errors", "openai_api", "procs", *protocols):
        source = (ROOT / "kvflow" / f"{name}.py").read_text()
        for component in ("kvflow.sim", "kvflow.router", "kvflow.gateway", "kvflow.operator"):
            assert component not in source, f"kvflow/{name}.py imports {component}"
    importlib.import_module("kvflow.cli")


def test_no_module_shares_a_name_with_the_standard_library():
    clashes = [
        str(path.relative_to(ROOT))
        for folder in ("kvflow", "sim", "router", "gateway", "operator", "beam")
        for path in (ROOT / folder).rglob("*.py")
        if path.stem in sys.stdlib_module_names
    ]
    assert clashes == []
