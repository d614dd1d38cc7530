"""Start, watch and stop kvflow's child processes (the local stack and integration tests).

Every child runs in its own process group, so stopping it also stops anything it spawned;
``ProcessGroup`` is a context manager, so a test or ``kvflow up`` that fails half-way still
stops what it started. This is control-plane code, not the data path: it may block.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType


class StartupError(RuntimeError):
    """A child exited or did not become ready in time; the message ends with its log's tail."""


def kvflow_argv(*args: str) -> list[str]:
    """The command line that runs ``kvflow ARGS`` with this interpreter."""
    return [sys.executable, "-m", "kvflow", *args]


_LISTEN_PORTS = (10_000, 31_000)
"""Where ``free_port`` draws from: below the kernel's ephemeral range (32768-60999 by default),
from which every outgoing connection takes its port, and with room for a pod's port + 1000 (the
simulator's default NIXL side channel, which must stay below 32768)."""
_handed_out: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a child to listen on.

    The kernel's own pick (bind to port 0) comes from its ephemeral range, so in the moment
    before the child binds it, an outgoing connection of a busy test or benchmark could take it
    (a child failing with EADDRINUSE, about one start in 60 under the routing benchmark). A
    port drawn below that range is never taken so; and this process never hands one out twice.
    """
    low, high = _LISTEN_PORTS
    ephemeral = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200 if ephemeral > high + 1000 else 0):
        port = rng.randrange(low, high)
        if (host, port) in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add((host, port))
        return port
    with socket.socket() as s:  # a machine whose ephemeral range leaves no room below it
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_url: str | None = None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """Children started together and stopped together (in reverse order)."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_url: str | None = None,
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with signals_deferred(), log_path.open("wb") as log:  # a Ctrl-C here must not lose the child
            popen = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=full_env, start_new_session=True,
            )
            child = Child(name, list(argv), popen, log_path, ready_url)
            self.children.append(child)
        return child

    def wait_ready(self, timeout: float = 30.0, children: Sequence[Child] | None = None) -> None:
        """Block until every child's ready URL answers 2xx; raise StartupError otherwise."""
        pending = [c for c in (children or self.children) if c.ready_url]
        deadline = time.monotonic() + timeout
        delay = 0.02
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise StartupError(f"{child.name} exited with {child.popen.returncode}:\n{child.log_tail()}")
                if http_ok(child.ready_url or ""):
                    pending.remove(child)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartupError(f"not ready after {timeout:.0f}s: {names}\n{pending[0].log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def stop(self, child: Child, *, grace: float = 5.0, sig: int = signal.SIGTERM) -> None:
        if child.alive():
            stop_process_group(child.popen, grace=grace, sig=sig)
        else:
            _signal_group(child.popen.pid, signal.SIGKILL)  # anything it left behind

    def stop_all(self, grace: float = 5.0) -> None:
        for child in reversed(self.children):
            self.stop(child, grace=grace)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first that came.

    Starting a child and recording it must not be split by an interrupt: a ``KeyboardInterrupt``
    raised inside ``Popen`` (after the fork) or before the child is recorded would leave a
    process that no ``ProcessGroup`` knows to stop. Python handlers can only be set on the main
    thread; elsewhere signals are not handled by Python anyway, so the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum)) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if caught:
            signal.raise_signal(caught[0])


def stop_process_group(popen: subprocess.Popen[bytes], *, grace: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Signal a child started with ``start_new_session=True`` and its whole process group, wait
    ``grace`` seconds, then SIGKILL the group."""
    _signal_group(popen.pid, sig)
    try:
        popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(popen.pid, signal.SIGKILL)
        popen.wait(timeout=5)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
