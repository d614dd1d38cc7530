"""vLLM /metrics text → EngineMetrics, with vLLM v1's metric names and labels; the one fetch
that the router's scraper and the operator's lifecycle round both use."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from kvflow.local.procs import free_port
from kvflow.protocol.vllm_metrics import MAX_LABEL, fetch_metrics, parse_metrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 400.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="c"} 1.6e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",enable_prefix_caching="True"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
"""


def test_parse_vllm_metrics() -> None:
    m = parse_metrics(VLLM_TEXT)
    assert (m.running, m.waiting, m.kv_usage) == (3, 5, 0.25)
    assert (m.prefix_queries, m.prefix_hits) == (1000.0, 400.0)
    assert (m.running_loras, m.waiting_loras, m.max_loras) == (frozenset({"a", "b"}), frozenset(), 2)
    assert (m.block_size, m.num_blocks, m.models) == (16, 2048, frozenset({"tiny"}))


def test_families_sharing_a_prefix_are_not_mistaken_for_the_wanted_ones() -> None:
    text = VLLM_TEXT + 'vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
    assert parse_metrics(text).waiting == 5


@pytest.mark.parametrize(
    "sample",
    ["nan", "+Inf", "-Inf", "-1", "1e13", "not-a-number", ""],
    ids=["nan", "inf", "minus-inf", "negative", "absurdly-large", "text", "missing"],
)
def test_a_pod_cannot_send_numbers_out_of_range(sample: str) -> None:
    m = parse_metrics(f'vllm:num_requests_waiting{{model_name="m"}} {sample}\nvllm:num_requests_running 2\n')
    assert (m.waiting, m.running, m.rejected) == (0, 2, 1)
    assert math.isfinite(m.kv_usage)


def test_a_pod_cannot_send_huge_labels_or_usage_over_one() -> None:
    big = "x" * (MAX_LABEL + 1)
    m = parse_metrics(
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{big}",waiting_lora_adapters=""}} 1.0\n'
        "vllm:kv_cache_usage_perc 3.5\n"
        'vllm:cache_config_info{block_size="-16",num_gpu_blocks="99999999999999999"} 1.0\n'
    )
    assert (m.running_loras, m.rejected, m.kv_usage) == (frozenset(), 1, 1.0)
    assert (m.block_size, m.num_blocks) == (None, None)


def test_legacy_names_and_empty_text() -> None:
    m = parse_metrics("vllm:gpu_cache_usage_perc 0.5\nvllm:gpu_prefix_cache_hits_total 7\n")
    assert (m.kv_usage, m.prefix_hits, m.running) == (0.5, 7.0, 0)
    assert parse_metrics("") == parse_metrics("# nothing\n")


def test_generated_tokens_are_read_but_do_not_make_a_scrape_look_changed_to_the_scorers() -> None:
    five = parse_metrics('vllm:generation_tokens_total{engine="0"} 2\nvllm:generation_tokens_total{engine="1"} 3\n'
                         "vllm:generation_tokens_created 1.7e9\n")
    assert (five.generated_tokens, five.rejected) == (5.0, 0)
    assert five == parse_metrics("vllm:generation_tokens_total 9\n")


async def test_fetch_gives_metrics_or_none_when_the_pod_did_not_answer() -> None:
    def answer(response: web.Response) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            return response
        return handler

    released = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await released.wait()  # answers only after the client's timeout gave up on it
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", answer(web.Response(text=VLLM_TEXT)))
    app.router.add_get("/500", answer(web.Response(status=500, text=VLLM_TEXT)))
    app.router.add_get("/not-utf8", answer(web.Response(body=b"vllm:num_requests_running \xff\n",
                                                        content_type="text/plain", charset="utf-8")))
    app.router.add_get("/hang", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    closed = free_port("127.0.0.1")  # nothing listens there
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            base = f"http://127.0.0.1:{port}"
            assert await fetch_metrics(session, f"{base}/metrics") == parse_metrics(VLLM_TEXT)
            for url in (f"{base}/500", f"{base}/not-utf8", f"{base}/hang", f"http://127.0.0.1:{closed}/metrics"):
                assert await fetch_metrics(session, url) is None, url
    finally:
        released.set()
        await runner.cleanup()


async def test_a_metrics_body_over_the_cap_is_not_heard_and_not_read_to_its_end() -> None:
    """A pod answering /metrics with an endless body costs the scraper at most about the cap."""
    sent = 0
    dropped = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = b"vllm:num_requests_running 1\n" * 4096
        try:
            while True:
                await response.write(line)
                sent += len(line)
        except (ConnectionError, RuntimeError, asyncio.CancelledError):
            # the scraper hung up: a write fails, or (handler_cancellation) aiohttp cancels the
            # handler when it sees the connection lost while a write waits for the buffer to drain
            dropped.set()
            raise

    app = web.Application()
    app.router.add_get("/metrics", endless)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            assert await fetch_metrics(session, f"http://127.0.0.1:{port}/metrics", max_bytes=1 << 20) is None
        await asyncio.wait_for(dropped.wait(), 10)
        assert sent < 64 << 20  # the cap and what the sockets' buffers held, not the 30 s a reader would take
    finally:
        await runner.cleanup()
