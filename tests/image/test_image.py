"""The container image, built here with buildah (`make image`), runs kvflow's roles.

`kvflow sim` and `kvflow gateway` run inside the image (``buildah run``, host network) and serve
a completion to a client outside it; `kvflow operator --help` and `kvflow router --help` work
there; the image runs as a numeric non-root user and carries its OCI labels. The image is built
once per session (``scripts/image.sh build kvflow``): buildah's layer cache and a hash of the
sources make a rebuild of an unchanged tree free and a rebuild after a change a few steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvflow
from kvflow.local.procs import ProcessGroup, free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "image.sh"
IMAGE = "localhost/kvflow:dev"
CAN_INSTALL = os.geteuid() == 0 and shutil.which("apt-get") is not None  # scripts/image.sh installs mmdebstrap
pytestmark = [
    pytest.mark.skipif(shutil.which("buildah") is None or (shutil.which("mmdebstrap") is None and not CAN_INSTALL),
                       reason="buildah (and mmdebstrap) not installed: `make image` installs them (apt-get install "
                              "buildah mmdebstrap, as root), after which `make test` builds the image and runs this test"),
    pytest.mark.timeout(1800),  # a first build downloads the dependencies; later ones reuse layers
]


def buildah(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), "buildah", *args], capture_output=True, text=True, check=check,
                          timeout=timeout)


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    """A working container of the freshly built image (removed afterwards)."""
    build = subprocess.run([str(SCRIPT), "build", "kvflow"], capture_output=True, text=True, timeout=1700)
    assert build.returncode == 0, build.stdout + build.stderr
    name = buildah("from", "--pull-never", IMAGE).stdout.strip()
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_in(container: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--network", "host", container, "--", *argv, check=False)


def test_sim_and_gateway_in_the_image_serve_a_client_outside(container: str, tmp_path: Path) -> None:
    from openai import OpenAI

    sim_port, gateway_port = free_port(), free_port()
    run = [str(SCRIPT), "buildah", "run", "--network", "host", container, "--", "kvflow"]
    with ProcessGroup(tmp_path) as group:
        group.start("sim", [*run, "sim", "--host", "127.0.0.1", "--port", str(sim_port), "--model", "sim-model"],
                    ready_url=f"http://127.0.0.1:{sim_port}/health")
        group.start("gateway", [*run, "gateway", "--host", "127.0.0.1", "--port", str(gateway_port),
                                "--model", "sim-model", "--endpoint", f"127.0.0.1:{sim_port}"],
                    ready_url=f"http://127.0.0.1:{gateway_port}/health")
        group.wait_ready(timeout=90)
        client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused")
        completion = client.completions.create(model="sim-model", prompt="San Francisco is a", max_tokens=8)
        assert completion.model == "sim-model" and completion.choices[0].text
        assert completion.usage is not None and completion.usage.completion_tokens == 8
    # Both servers ran inside the image, not from this checkout's venv: the image has no /work.
    assert run_in(container, "test", "-e", str(ROOT)).returncode == 1


@pytest.mark.parametrize("role", ["operator", "router", "gateway", "sim"])
def test_every_role_answers_help(container: str, role: str) -> None:
    result = run_in(container, "kvflow", role, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kvflow {role}")


def test_the_image_runs_as_a_numeric_non_root_user(container: str) -> None:
    assert run_in(container, "id", "-u").stdout.strip() == "65532"
    config = json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)["OCIv1"]["config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["kvflow"]


def test_oci_labels_and_version_come_from_one_place(container: str) -> None:
    labels = json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)["OCIv1"]["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == kvflow.__version__
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert run_in(container, "kvflow", "--version").stdout.strip() == f"kvflow {kvflow.__version__}"
    # `make image` also tags the name the chart and the operator default to.
    assert buildah("inspect", "--type", "image", kvflow.IMAGE, check=False).returncode == 0
