"""The package layout: components under kvflow.*, nothing shadows the standard library."""

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]


@pytest.mark.parametrize("flags", [[], ["-S"]])  # -S: not even site has imported operator yet
def test_stdlib_operator_is_not_shadowed_from_the_repository_root(flags):
    out = subprocess.run(
        [sys.executable, *flags, "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert not out.strip().startswith(str(ROOT))


@pytest.mark.parametrize("component", ["sim", "router", "gateway", "sidecar", "operator", "beam"])
def test_components_live_in_top_level_folders_mapped_by_pyproject(component):
    folder = ROOT / PACKAGE_DIR[f"kvflow.{component}"]
    assert folder.parent == ROOT and (folder / "__init__.py").is_file()
    assert importlib.import_module(f"kvflow.{component}").__file__ == str(folder / "__init__.py")


def test_every_package_folder_is_listed_for_the_wheel():
    """setuptools gets an explicit package list: a folder of modules missing from it would be left out."""
    found = set()
    for name, folder in PACKAGE_DIR.items():
        for init in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in init.parts:
                continue
            sub = init.parent.relative_to(ROOT / folder).parts
            if name == "kvflow" and sub and f"kvflow.{sub[0]}" in PACKAGE_DIR:
                continue
            found.add(".".join((name, *sub)))
    assert sorted(found) == sorted(SETUPTOOLS["packages"]), "pyproject.toml [tool.setuptools] packages"
    assert not [p.name for p in (ROOT / "kvflow").iterdir() if p.is_symlink()]


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
    for name in ("hashing", "tokenizer", "endpoints", "errors", "openai_api", *protocols):
        source = (ROOT / "kvflow" / f"{name}.py").read_text()
        for component in ("kvflow.sim", "kvflow.router", "kvflow.gateway", "kvflow.operator", "kvflow.local"):
            assert component not in source, f"kvflow/{name}.py imports {component}"
    importlib.import_module("kvflow.cli")


def test_no_module_shares_a_name_with_the_standard_library():
    clashes = [
        str(path.relative_to(ROOT))
        for folder in PACKAGE_DIR.values()
        for path in (ROOT / folder).rglob("*.py")
        if path.stem in sys.stdlib_module_names
    ]
    assert clashes == []
