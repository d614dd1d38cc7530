"""The installed package layout as a tree of links, for static tools (mypy, import-linter).

They find modules by walking folders and cannot follow pyproject's ``package-dir`` mapping
(``kvflow.router`` -> ``router/``) as a wheel and the editable install's import finder do.
``python -m kvflow.local.pkgview DIR`` makes ``DIR/kvflow`` the tree a wheel would install, its
files links to the source files (a tool's message naming ``DIR/kvflow/router/x.py`` means
``router/x.py``). ``make lint`` runs mypy and import-linter on ``build/pkgview``.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def component_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """``kvflow.<name>`` -> its folder, for every component pyproject maps outside ``kvflow/``."""
    mapping: dict[str, str] = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items() if name.count(".") == 1}


def build(out: Path) -> Path:
    """Real folders (tools do not walk into linked ones) holding links to the source files."""
    package = out / "kvflow"
    if package.exists():
        shutil.rmtree(package)
    _mirror(ROOT / "kvflow", package)
    for name, folder in component_dirs().items():
        _mirror(folder, package / name.split(".")[1])
    return package


def _mirror(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.is_dir() and entry.name != "__pycache__":
            _mirror(entry, target / entry.name)
        elif entry.suffix in (".py", ".pyi", ".typed"):
            (target / entry.name).symlink_to(entry)


def main(argv: Sequence[str] = sys.argv[1:]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvflow.local.pkgview DIR", file=sys.stderr)
        return 2
    build(Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
