"""/metrics conformance: vLLM's metric families with vLLM's types and labels, and their meanings."""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .targets import GOLDEN as GOLDEN_DIR
from .targets import Target

OPTIONAL = ("vllm:lora_requests_info",)  # only with LoRA enabled


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def scrape(target: Target) -> dict[str, Any]:
    with urllib.request.urlopen(target.url + "/metrics", timeout=10) as r:
        return families(r.read().decode())


def value(fams: dict[str, Any], sample_name: str, **labels: str) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for sample in fams[family].samples:
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    raise KeyError(f"{sample_name}{labels}")


GOLDEN_FAMILIES = families((GOLDEN_DIR / "vllm_metrics.txt").read_text())


@pytest.mark.parametrize("name", sorted(n for n in GOLDEN_FAMILIES if n not in OPTIONAL))
def test_every_vllm_family_exists_with_its_type_and_labels(target: Target, name: str) -> None:
    got = scrape(target)
    assert name in got
    want = GOLDEN_FAMILIES[name]
    assert got[name].type == want.type
    assert got[name].documentation == want.documentation
    label_sets = {frozenset(s.labels) for s in got[name].samples}
    assert label_sets == {frozenset(s.labels) for s in want.samples}


def test_cache_config_info_reports_block_size_and_pool(target: Target) -> None:
    [sample] = scrape(target)["vllm:cache_config_info"].samples
    assert (sample.labels["block_size"], sample.labels["num_gpu_blocks"], sample.value) == (
        str(target.block_size), str(target.num_blocks), 1.0)


def complete(target: Target, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": target.model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(target.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_counters_mean_what_vllm_means(target: Target) -> None:
    bs = target.block_size
    start = random.Random().randrange(10, 1500)
    prompt = [start + i for i in range(3 * bs + 4)]  # 3 full blocks and a partial one
    before = scrape(target)
    for _ in range(3):
        complete(target, prompt, 4)
    after = scrape(target)
    labels = {"model_name": target.model, "engine": "0"}

    def delta(name: str, **extra: str) -> float:
        return value(after, name, **labels, **extra) - value(before, name, **labels, **extra)

    n = len(prompt)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens_total") == 3 * n
    assert delta("vllm:generation_tokens_total") == 12
    assert delta("vllm:prefix_cache_queries_total") == 3 * n
    assert delta("vllm:prefix_cache_hits_total") == 2 * 3 * bs  # the repeats hit 3 full blocks
    assert delta("vllm:prompt_tokens_cached_total") == 2 * 3 * bs
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == 3 * n
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3


def test_gauges_are_zero_when_idle(target: Target) -> None:
    fams = scrape(target)
    labels = {"model_name": target.model, "engine": "0"}
    assert value(fams, "vllm:num_requests_running", **labels) == 0
    assert value(fams, "vllm:num_requests_waiting", **labels) == 0
    assert value(fams, "vllm:kv_cache_usage_perc", **labels) == 0
