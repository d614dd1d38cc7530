"""Real ``kvflow sim`` pods with ``--kv-transfer nixl``, and a client speaking vLLM's two-step P/D protocol."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvflow.local.procs import Child, ProcessGroup, kvflow_argv
from tests.conftest import free_port
from tests.pd.conftest import side_channel_port

MODEL = "sim-model"


@dataclass
class Pod:
    role: str
    host: str
    port: int
    side_channel: int
    child: Child

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def start_pod(group: ProcessGroup, role: str, host: str, *extra: str, env: dict[str, str] | None = None,
              port: int | None = None, side_channel: int | None = None) -> Pod:
    """Start one pod (not waiting for it); the same ports again restart it in place."""
    port = port or free_port(host)
    side_channel = side_channel or side_channel_port(host)
    argv = kvflow_argv("sim", "--host", host, "--port", str(port), "--role", role, "--profile", "instant",
                       "--kv-transfer", "nixl", "--nixl-side-channel-port", str(side_channel), *extra)
    env = {"KVFLOW_NIXL_HANDSHAKE_TIMEOUT": "1.0", "KVFLOW_NIXL_TRANSFER_TIMEOUT": "2.0", **(env or {})}
    child = group.start(f"{role}-{host}-{port}-{len(group.children)}", argv, env=env,
                        ready_url=f"http://{host}:{port}/health")
    return Pod(role, host, port, side_channel, child)


async def completion(session: aiohttp.ClientSession, pod: Pod, prompt: str, max_tokens: int,
                     kv_transfer_params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "kv_transfer_params": kv_transfer_params}
    async with session.post(pod.url + "/v1/completions", json=body) as response:
        return response.status, await response.json()


async def prefill(session: aiohttp.ClientSession, pod: Pod, prompt: str) -> dict[str, Any]:
    """Step one: prefill only; the answer's ``kv_transfer_params`` say where the KV is."""
    status, body = await completion(session, pod, prompt, 1, {"do_remote_decode": True})
    assert status == 200, body
    params: dict[str, Any] = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True, params
    params["prompt_tokens"] = body["usage"]["prompt_tokens"]
    return params


async def decode(session: aiohttp.ClientSession, pod: Pod, prompt: str, params: dict[str, Any],
                 max_tokens: int = 4) -> tuple[int, dict[str, Any]]:
    """Step two: decode with the prefill pod's parameters (it pulls the KV instead of computing it)."""
    return await completion(session, pod, prompt, max_tokens, {k: v for k, v in params.items() if k != "prompt_tokens"})


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([-+\deE.naNInf]+)$")


async def metrics(session: aiohttp.ClientSession, pod: Pod) -> dict[str, float]:
    """``/metrics`` summed over label sets: ``{name: value}`` and ``{name{reason=...}: value}`` per series."""
    async with session.get(pod.url + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        out[name] = out.get(name, 0.0) + value
        for label in re.findall(r'(?:reason|cause|result)="([^"]+)"', labels):
            out[f"{name}[{label}]"] = out.get(f"{name}[{label}]", 0.0) + value
    return out
