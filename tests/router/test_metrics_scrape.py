"""vLLM /metrics text → EngineMetrics, with vLLM v1's metric names and labels."""

from __future__ import annotations

import math

import pytest

from kvflow.router.metrics_scrape import MAX_LABEL, parse_metrics

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
