"""The no-GPU samples end to end: what the operator renders runs and serves a completion.

Each sim sample is rendered; its InferencePool goes into the emulated API server; every replica of
every engine Deployment becomes a real ``kvflow sim`` process started with the rendered command
line (its host and ports moved to a loopback address of its own, ``$(POD_NAME)`` and the
``fieldRef`` environment filled in as the kubelet would) and a ready Pod carrying the rendered
template's labels; the gateway starts from the rendered gateway ConfigMap and finds the pods as
it does on a cluster, through the InferencePool and a pod watch (a kubeconfig points it at the
emulator). A completion must come back through it; in the P/D sample a long prompt must have
gone through the prefill pod (real NIXL transfers).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from operator_emulator import Cluster, point_kubernetes_clients_at
from operator_tools import SAMPLES

from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import start_gateway
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.operator.render import render
from kvflow.operator.spec import parse

NS = "default"
SIM_SAMPLES = ["sim.yaml", "sim-pd.yaml"]


def engine_deployments(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"].get("kvflow.io/engine")]


def kubelet_env(container: dict[str, Any], pod: str, ip: str) -> dict[str, str]:
    """The container's environment as the kubelet resolves it for one pod."""
    fields = {"metadata.name": pod, "metadata.namespace": NS, "status.podIP": ip}
    out = {}
    for item in container.get("env") or []:
        if "value" in item:
            out[item["name"]] = item["value"]
        elif "fieldRef" in item.get("valueFrom", {}):
            out[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def local_args(container: dict[str, Any], env: dict[str, str], ip: str, port: int, nixl_port: int) -> list[str]:
    """The rendered arguments, bound to this pod's loopback address instead of 0.0.0.0."""
    args = [a.replace("$(POD_NAME)", env["POD_NAME"]) for a in container["args"]]
    for flag, value in (("--host", ip), ("--port", str(port)), ("--nixl-side-channel-port", str(nixl_port))):
        if flag in args:
            args[args.index(flag) + 1] = value
    if "--kv-events-config" in args:  # vLLM binds tcp://*:5557; here each pod binds its own address
        i = args.index("--kv-events-config") + 1
        config = json.loads(args[i])
        config["endpoint"] = f"tcp://{ip}:5557"
        args[i] = json.dumps(config)
    return args


@pytest.fixture
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[kmock.Server]:
    async with Cluster() as k8s, kmock.Server(k8s) as server:
        point_kubernetes_clients_at(str(server.url), tmp_path, monkeypatch)
        yield server


async def post(server: kmock.Server, path: str, obj: dict[str, Any]) -> None:
    async with server.client.post(path, json=obj) as resp:
        assert resp.status < 400, await resp.text()


async def prompt_tokens(http: aiohttp.ClientSession, address: str) -> float:
    """``vllm:prompt_tokens_total`` of one pod: the prompt tokens it computed."""
    async with http.get(f"http://{address}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


@pytest.mark.parametrize("sample", SIM_SAMPLES)
async def test_sim_sample_serves_a_completion_through_its_gateway(sample: str, api: kmock.Server,
                                                                 tmp_path: Path) -> None:
    body = yaml.safe_load((SAMPLES / sample).read_text())
    objs = render(parse(body))
    pool = copy.deepcopy(next(o for o in objs if o["kind"] == "InferencePool"))
    port = free_port("127.0.0.1")
    pool["spec"]["targetPorts"] = [{"number": port}]
    await post(api, f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", pool)

    addresses: dict[str, list[str]] = {}
    with ProcessGroup(tmp_path / "logs") as group:
        children, pods = [], []
        for index, deployment in enumerate(
                (d, i) for d in engine_deployments(objs) for i in range(d["spec"]["replicas"])):
            dep, replica = deployment
            template = dep["spec"]["template"]
            container = template["spec"]["containers"][0]
            name, ip = f"{dep['metadata']['name']}-{replica}", f"127.0.77.{10 + index}"
            env = kubelet_env(container, name, ip)
            assert container["command"] == ["kvflow"]
            args = local_args(container, env, ip, port, free_port(ip))
            children.append(group.start(name, kvflow_argv(*args), env={**env, "UCX_NET_DEVICES": "lo"},
                                        ready_url=f"http://{ip}:{port}/health"))
            addresses.setdefault(template["metadata"]["labels"]["kvflow.io/role"], []).append(f"{ip}:{port}")
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": name, "labels": dict(template["metadata"]["labels"])},
                         "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
        await asyncio.to_thread(group.wait_ready, 120, children)
        for pod in pods:
            await post(api, f"/api/v1/namespaces/{NS}/pods", pod)

        configmap = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-gateway"))
        raw = yaml.safe_load(configmap["data"]["gateway.yaml"])
        raw.update(host="127.0.0.1", port=0, batch={"dir": str(tmp_path / "batches")})
        gateway = await start_gateway(GatewayConfig.model_validate(raw))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                url = f"http://127.0.0.1:{gateway.port}/v1/completions"
                prompt = " ".join(f"word{i}" for i in range(200))  # past sim-pd's 64-token threshold
                request = {"model": body["spec"]["model"]["name"], "prompt": prompt, "max_tokens": 8}
                async with http.post(url, json=request) as resp:
                    answer = await resp.json()
                    assert resp.status == 200, answer
                assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8
                if "prefill" in addresses:  # the prompt was prefilled on the prefill pod
                    assert sum([await prompt_tokens(http, a) for a in addresses["prefill"]]) >= 200
                else:
                    assert set(addresses) == {"both"}
        finally:
            await gateway.close()
