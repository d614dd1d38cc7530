"""Child-process supervision: a child is never started without its group knowing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.local import procs
from kvflow.local.procs import ProcessGroup, signals_deferred


def test_a_signal_inside_the_block_waits_for_its_end() -> None:
    # Python's own SIGINT handler, even where the runner inherited SIGINT ignored (a job started
    # in the background by a non-interactive shell, as CI runners may)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # delivered after the block
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                reached = True  # the interrupt did not cut the block short
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached


def test_the_previous_handlers_come_back() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        with signals_deferred():
            assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_a_child_starts_still_lets_the_group_stop_it(tmp_path: Path, monkeypatch) -> None:
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        child = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives after the fork, before start() records the child
        return child

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(procs.subprocess, "Popen", popen_then_sigterm)
    previous = signal.signal(signal.SIGTERM, interrupt)
    group = ProcessGroup(tmp_path)
    try:
        with pytest.raises(KeyboardInterrupt), group:
            group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [c.name for c in group.children] == ["sleeper"]
    assert not group.children[0].alive()  # the group's exit stopped it
