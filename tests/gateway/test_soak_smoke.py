"""A short run of ``kvflow bench soak``: steady load through the gateway while a pod is killed and
restarted and another is frozen; nothing non-streamed may be lost, and the restarted pod is
routable again. (How fast, and how flat memory stays, are the benchmark's figures, not asserted.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_under_faults_loses_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvflow", "bench", "soak", "--minutes", "0.25", "--faults", "1",
                           "--stop-seconds", "3", "--rss-every", "3", "--rate", "15", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "soak.json").read_text())
    counts = report["counts"]
    assert counts["sent"] >= 100 and counts["lost"] == 0
    assert counts["ok"] + counts["streams_ok"] + counts["streams_cut"] + counts["streams_failed"] == counts["sent"]
    [restart] = report["restarts"]
    assert restart["healthy_at"] is not None and restart["routable_at"] is not None
    assert len(report["rss_mb"]) >= 5 and "| requests sent |" in done.stdout
