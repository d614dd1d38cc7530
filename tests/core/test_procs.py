"""Child-process supervision: a child is never started without its group knowing it."""

from __future__ import annotations

import os
import signal
import socket
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


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice(monkeypatch) -> None:
    # outgoing connections take their ports from the ephemeral range: none can steal these
    # between the pick and the child's bind
    monkeypatch.setattr(procs, "_ephemeral_low", lambda: 32768)  # Linux's default
    ports = [procs.free_port("127.0.0.1") for _ in range(200)]
    low, high = procs._LISTEN_PORTS
    assert all(low <= p < high for p in ports)
    assert high + 1000 < 32768  # the pick + 1000 (a NIXL side channel) is outside it too
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free, as promised


def test_free_port_skips_a_port_someone_listens_on(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        draws = iter([busy, busy, free])

        class Rigged:
            def randrange(self, low: int, high: int) -> int:
                return next(draws)

        monkeypatch.setattr(procs.random, "SystemRandom", Rigged)
        monkeypatch.setattr(procs, "_LISTEN_PORTS", (1024, 65535))
        monkeypatch.setattr(procs, "_ephemeral_low", lambda: 65535 + 2000)
        assert procs.free_port("127.0.0.1") == free
