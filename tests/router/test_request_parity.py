"""One request path: the gateway's router and the ext_proc router behind a real Envoy see the same
request for the same body (tokens, LoRA, cache salt, block hashes) and decide the same way."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvflow.endpoints import Endpoint
from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import start_gateway
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv
from kvflow.router import Router, load_config
from kvflow.router.envoy_config import Listener, envoy_binary, render

MODEL, ADAPTER = "sim-model", "sql"
PROMPT = "You are a careful assistant who answers in full sentences. " * 12
BODIES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("salted", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "cache_salt": "tenant-a"}, {}),
    ("lora-by-model", {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 2}, {}),
    ("lora-by-header", {"model": MODEL, "prompt": PROMPT + " again", "max_tokens": 2}, {"x-lora": ADAPTER}),
    ("chat-with-tools", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "What is the weather?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    }, {}),
    ("token-ids", {"model": MODEL, "prompt": list(range(100, 400)), "max_tokens": 2}, {}),
    ("plain-repeat", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, {}),
]
SEEN = ("model", "lora", "cache_salt", "mm_hashes", "prompt_tokens", "tokens_digest", "block_hashes_digest")
DECIDED = ("profile", "targets", "prefill", "cached_tokens")


@dataclass
class Stack:
    config: Path
    envoy: str
    router_http: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("parity")
    with ProcessGroup(tmp / "logs") as group:
        pods = []
        for i in range(3):
            host = f"127.0.0.{150 + i}"
            port = free_port(host)
            argv = kvflow_argv("sim", "--host", host, "--port", str(port), "--profile", "fast", "--model", MODEL,
                               "--lora-modules", f"{ADAPTER}=/adapters/{ADAPTER}",
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # tools, as vLLM
            group.start(f"sim{i}", argv, env={"PYTHONHASHSEED": "0"}, ready_url=f"http://{host}:{port}/health")
            pods.append(Endpoint(host, port))
        # both routers: the same pool, and a profile that depends on nothing but what each has routed;
        # the pods' adapters are declared, so neither router's choice waits on what it has scraped
        config = tmp / "router.yaml"
        config.write_text(yaml.safe_dump({
            "kvEvents": {"enabled": False},
            "loraPaths": {ADAPTER: f"/adapters/{ADAPTER}"},
            "pool": {"model": MODEL, "endpoints": [{"address": p.id, "models": [MODEL, ADAPTER]} for p in pods]},
            "schedulingProfiles": [{"name": "parity", "plugins": [
                {"pluginRef": "model-filter"}, {"pluginRef": "prefix-approx", "weight": 1}, {"pluginRef": "max-score"},
            ]}],
            "defaultProfile": "parity",
        }))
        grpc_port, http_port = free_port(), free_port()
        group.start("router", kvflow_argv("router", "--config", str(config), "--port", str(grpc_port),
                                          "--metrics-port", str(http_port), "--grpc-health-port", "0",
                                          "--no-secure-serving"),  # Envoy speaks plaintext here
                    ready_url=f"http://127.0.0.1:{http_port}/healthz")
        listener, admin = free_port(), free_port()
        bootstrap = render([Listener("127.0.0.1", listener)], ("127.0.0.1", grpc_port), pods, admin=("127.0.0.1", admin))
        (tmp / "envoy.json").write_text(json.dumps(bootstrap))
        group.start("envoy", [str(envoy_binary()), "-c", str(tmp / "envoy.json"), "--disable-hot-restart",
                              "-l", "warning"], ready_url=f"http://127.0.0.1:{admin}/ready")
        group.wait_ready(60)
        yield Stack(config, f"http://127.0.0.1:{listener}", f"http://127.0.0.1:{http_port}")


def pick(entry: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: entry.get(k) for k in keys}


async def test_gateway_and_ext_proc_build_and_route_the_same_requests(stack: Stack) -> None:
    router = Router(load_config(stack.config), profile="parity")
    gateway = GatewayConfig.model_validate(
        {"port": 0, "pools": [{"model": MODEL, "endpoints": [], "loras": [ADAPTER]}]}
    )
    running = await start_gateway(gateway, {MODEL: router})
    try:
        async with aiohttp.ClientSession() as session:
            for name, body, headers in BODIES:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                for base in (f"http://127.0.0.1:{running.port}", stack.envoy):
                    hdrs = {"x-request-id": f"parity-{name}", **headers}
                    async with session.post(base + path, json=body, headers=hdrs) as r:
                        assert r.status == 200, (name, base, await r.text())
                        await r.read()
    finally:
        await running.close()
    via_gateway = {e["request_id"]: e for e in router.explain(50)}
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(stack.router_http + "/debug/decisions?n=50", timeout=10).read()
    )
    via_envoy = {e["request_id"]: e for e in json.loads(text)}
    for name, _, _ in BODIES:
        rid = f"parity-{name}"
        assert pick(via_gateway[rid], SEEN) == pick(via_envoy[rid], SEEN), name
        assert pick(via_gateway[rid], DECIDED) == pick(via_envoy[rid], DECIDED), name
    assert via_gateway["parity-salted"]["cache_salt"] == "tenant-a"
    assert via_gateway["parity-lora-by-model"]["lora"] == via_gateway["parity-lora-by-header"]["lora"] == ADAPTER
    assert via_gateway["parity-lora-by-model"]["model"] == MODEL
    # the salt and the adapter key the hashes: the same prompt hashes three ways
    digests = {via_gateway[f"parity-{n}"]["block_hashes_digest"] for n in ("salted", "lora-by-model", "plain-repeat")}
    assert len(digests) == 3
