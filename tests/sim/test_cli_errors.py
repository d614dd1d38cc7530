"""``kvflow sim`` mistakes end in one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvflow.local.procs import free_port


def run_sim(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow", "sim", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_nixl_transfer_without_nixl_is_one_line(tmp_path: Path) -> None:
    """A P/D pod on an image without NIXL (the default image; kvflow-nixl has it) says so."""
    stand_in = tmp_path / "nixl"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text('raise ImportError("No module named nixl_cu12")\n')
    port = free_port("127.0.0.1")
    result = run_sim("--host", "127.0.0.1", "--port", str(port), "--role", "prefill", "--kv-transfer", "nixl",
                     env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("kvflow sim: --kv-transfer nixl needs NIXL") and "kvflow-nixl" in lines[0]
