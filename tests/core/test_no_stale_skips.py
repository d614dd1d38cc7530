"""The rule tests/conftest.py enforces on a full run: no module skipped wholesale without a reason on file."""

from __future__ import annotations

from tests.conftest import wholesale_skips


def test_a_module_skipped_for_an_undocumented_reason_is_reported() -> None:
    outcomes = {
        "tests/a.py": [("skipped", "the gateway is not built yet"), ("skipped", "the gateway is not built yet")],
        "tests/b.py": [("skipped", "needs KVFLOW_REAL_VLLM=1")],
        "tests/c.py": [("skipped", "whatever"), ("passed", "")],
        "tests/d.py": [("skipped", "nixl is not installed (pip install nixl nixl-cu12)")],
    }
    assert wholesale_skips(outcomes) == {"tests/a.py": "the gateway is not built yet"}
