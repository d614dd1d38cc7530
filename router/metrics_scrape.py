"""vLLM ``/metrics`` text → an ``EngineMetrics`` snapshot. Pure: no I/O here.

A vLLM scrape is hundreds of lines (histograms mostly), and the router scrapes every pod 20
times a second, so lines of metrics nobody reads are dropped before prometheus-client's text
parser sees them. Names are vLLM v1's (``vllm/v1/metrics/loggers.py``); the older
``gpu_cache_usage_perc`` / ``gpu_prefix_cache_*`` spellings are accepted too.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from kvflow.router.model import EngineMetrics

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = (RUNNING, WAITING, *KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS, LORA_INFO, CACHE_CONFIG)
_PREFIXES = tuple(_WANTED) + tuple(f"# HELP {n}" for n in _WANTED) + tuple(f"# TYPE {n}" for n in _WANTED)


def relevant_lines(text: str) -> str:
    """Only the samples and HELP/TYPE lines of the metrics the scheduler reads."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES)) + "\n"


def _csv(value: str | None) -> frozenset[str]:
    return frozenset(x for x in (value or "").split(",") if x)


def parse_metrics(text: str) -> EngineMetrics:
    """Sum over engines (data-parallel ranks) and models; the latest LoRA info sample wins."""
    sums: dict[str, float] = {}
    lora_ts = -1.0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras = 0
    block_size: int | None = None
    num_blocks: int | None = None
    models: set[str] = set()
    for family in text_string_to_metric_families(relevant_lines(text)):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            # By sample, not family: a counter's family loses "_total" only when typed.
            name = sample.name.removesuffix("_total")
            if "model_name" in sample.labels:
                models.add(sample.labels["model_name"])
            if name == LORA_INFO:
                if sample.value >= lora_ts:
                    lora_ts = sample.value
                    running_loras = _csv(sample.labels.get("running_lora_adapters"))
                    waiting_loras = _csv(sample.labels.get("waiting_lora_adapters"))
                    max_loras = int(sample.labels.get("max_lora") or 0)
            elif name == CACHE_CONFIG:
                block_size = _int(sample.labels.get("block_size"))
                num_blocks = _int(sample.labels.get("num_gpu_blocks"))
            else:
                sums[name] = sums.get(name, 0.0) + sample.value
    return EngineMetrics(
        running=int(sums.get(RUNNING, 0)),
        waiting=int(sums.get(WAITING, 0)),
        kv_usage=_first(sums, KV_USAGE),
        prefix_queries=_first(sums, PREFIX_QUERIES),
        prefix_hits=_first(sums, PREFIX_HITS),
        running_loras=running_loras,
        waiting_loras=waiting_loras,
        max_loras=max_loras,
        block_size=block_size,
        num_blocks=num_blocks,
        models=frozenset(models),
    )


def _first(sums: dict[str, float], names: Iterable[str]) -> float:
    for name in names:
        if name in sums:
            return sums[name]
    return 0.0


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None
