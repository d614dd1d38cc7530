"""Processes a test started indirectly (a stack's pods and gateway): found by command line, and
waited for through their pidfds, which turn readable when the process exits."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterable
from pathlib import Path


def pids_with(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (never this test process)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found


def wait_exited(pids: Iterable[int], timeout: float) -> None:
    """Until every process in ``pids`` has exited (one already gone counts as exited)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue
    try:
        deadline = time.monotonic() + timeout
        pending = set(fds)
        while pending:
            ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"{len(pending)} processes still running after {timeout:g}s"
            pending -= set(ready)
    finally:
        for fd in fds:
            os.close(fd)
