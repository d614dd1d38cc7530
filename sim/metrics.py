"""``/metrics`` with vLLM's metric names, labels, help texts and histogram buckets.

The exposition is what real vLLM 0.32's API server writes (tests/golden/vllm_metrics.txt), in
its order: prometheus_client's ``python_gc_*``, ``python_info`` and ``process_*`` families (of
this process), the engine's ``vllm:*`` families, then prometheus-fastapi-instrumentator's
``http_request*`` families (``kvflow.sim.http_metrics``).

Every engine metric carries ``model_name`` (the first served model name) and ``engine`` ("0"),
as vLLM's ``PrometheusStatLogger`` writes them. Counters are declared without ``_total``; the
exposition appends it, as prometheus_client does for vLLM. Scheduler state (running, waiting,
KV usage, prefix-cache totals) is read at scrape time; reading it changes nothing in the engine.
``vllm:lora_requests_info`` exists only with LoRA enabled: a gauge set to the scrape time, with
the running/waiting adapter names as labels (one series per label combination, as vLLM does).

What vLLM counts when: prompt tokens, TTFT and inter-token gaps as tokens are produced; the
per-request families (``request_success``, e2e, queue/prefill/decode/inference times, token
histograms) when a request finishes in the engine. A request the client aborted is dropped by
vLLM's output processor (``OutputProcessor.abort_requests`` records no finished stats), so it
counts in none of the per-request families; here the engine does not call ``on_finished`` for it.

The ``vllm:*`` and ``http_*`` families live in ``kvflow.exposition`` (cheap to update,
sub-millisecond to render), and so do the runtime families (``Runtime``: what prometheus_client's
GC, platform and process collectors export, read and written on the fast path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvflow.exposition import Counter, CounterChild, Gauge, Histogram, HistogramChild, Registry, Runtime
from kvflow.sim.http_metrics import HttpMetrics
from kvflow.sim.request import SimRequest

CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

_HELP = {
    "running": "Number of requests in model execution batches.",
    "waiting": "Number of requests waiting to be processed.",
    "waiting_by_reason": "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
    "reasons equals vllm:num_requests_waiting.",
    "sleep": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    "cached_by_source": "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
    "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
    "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
}


def buckets_1_2_5(max_value: int) -> list[float]:
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


OFFLOAD_DIRECTIONS = ("CPU_to_GPU", "GPU_to_CPU")


def cache_config_info(*, block_size: int, num_blocks: int, num_blocks_override: int | None,
                      enable_prefix_caching: bool, hash_algo: str, max_model_len: int,
                      kv_offloading_size: float | None = None) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM dumps every CacheConfig field as a string
    (``kv_offloading_size`` in GiB as given, ``num_cpu_blocks`` stays None: the connector sizes
    its CPU pool itself)."""
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": str(enable_prefix_caching),
        "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": f"{(num_blocks - 1) * block_size / max_model_len:.1f}",
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(num_blocks * block_size),
        "kv_offloading_backend": "native", "kv_offloading_size": str(kv_offloading_size), "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_blocks), "num_gpu_blocks_override": str(num_blocks_override),
        "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": hash_algo, "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """Callables the metrics read at scrape time."""

    running: Callable[[], float]
    waiting: Callable[[], float]
    deferred: Callable[[], float]
    kv_usage: Callable[[], float]
    prefix_queries: Callable[[], int]
    prefix_hits: Callable[[], int]
    external_queries: Callable[[], int]
    external_hits: Callable[[], int]
    preemptions: Callable[[], int]
    lora_running: Callable[[], Iterable[str]]
    lora_waiting: Callable[[], Iterable[str]]
    slipped_seconds: Callable[[], float]
    offload_stored_tokens: Callable[[], int] = lambda: 0
    """Tokens written to the CPU offload tier so far."""


def runtime_registry() -> CollectorRegistry:
    """prometheus_client's process/python collectors, in the order vLLM's registry lists them
    (what ``Runtime`` renders on the fast path; ``kvflow bench observe`` compares the two)."""
    registry = CollectorRegistry(auto_describe=False)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    ProcessCollector(registry=registry)
    return registry


class SimMetrics:
    def __init__(self, model_name: str, *, max_model_len: int, cache_info: dict[str, str],
                 max_loras: int | None = None, runtime: bool = True,
                 offload_bytes: tuple[int, float] | None = None) -> None:
        """``offload_bytes``: with CPU offloading, (KV bytes per token, copy bytes/s): the
        connector's transfer counters are then rendered."""
        self.model_name = model_name
        self.registry = r = Registry()
        self.runtime = Runtime() if runtime else None
        names = ["model_name", "engine"]
        values = [model_name, "0"]
        self._max_loras = max_loras

        def counter(name: str, doc: str) -> CounterChild:
            return Counter(name, doc, names, registry=r).labels(*values)

        def counters_by(name: str, doc: str, label: str, keys: Iterable[str]) -> dict[str, CounterChild]:
            family = Counter(name, doc, [*names, label], registry=r)
            return {k: family.labels(*values, k) for k in keys}

        def hist(name: str, doc: str, buckets: Iterable[float]) -> HistogramChild:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        for what in ("flops", "read_bytes", "write_bytes"):
            verb = {"flops": "floating point operations", "read_bytes": "bytes read from memory",
                    "write_bytes": "bytes written to memory"}[what]
            counter(f"vllm:estimated_{what}_per_gpu",
                    f"Estimated number of {verb} per GPU (for Model Flops Utilization calculations).")
        self.g_running = gauge("vllm:num_requests_running", _HELP["running"]).labels(*values)
        self.g_waiting = gauge("vllm:num_requests_waiting", _HELP["waiting"]).labels(*values)
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", _HELP["waiting_by_reason"], [*names, "reason"],
                          registry=r)
        self.g_capacity, self.g_deferred = by_reason.labels(*values, "capacity"), by_reason.labels(*values, "deferred")
        sleep = Gauge("vllm:engine_sleep_state", _HELP["sleep"], [*names, "sleep_state"], registry=r)
        for state in SLEEP_STATES:
            sleep.labels(*values, state).set(1 if state == "awake" else 0)
        self.g_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*values)
        self.c_prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.c_prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.c_external_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.")
        self.c_external_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance "
            "cache sharing, in terms of number of cached tokens.")
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.c_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counters_by(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source", PROMPT_SOURCES)
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.cached_by_source = counters_by(
            "vllm:prompt_tokens_cached_by_source", _HELP["cached_by_source"], "source", CACHE_SOURCES)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counters_by(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason", FINISH_REASONS)
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=r)
        for reason in ADMISSION_REASONS:
            rejections.labels(model_name, reason)
        tokens = buckets_1_2_5(max_model_len)
        self.h_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.h_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.h_iteration = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.h_max_generation = hist("vllm:request_max_num_generation_tokens",
                                     "Histogram of maximum number of requested generation tokens.", tokens)
        self.h_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.h_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.h_ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.h_itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.h_tpot = hist("vllm:request_time_per_output_token_seconds",
                           "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.h_e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.h_queue = hist("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.h_inference = hist("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.h_prefill = hist("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.h_decode = hist("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.h_preemptions = hist("vllm:request_num_preemptions",
                                  "Histogram of the number of times a request was preempted.", PREEMPTION_BUCKETS)
        self.h_prefill_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                       "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                       tokens)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     sorted([*cache_info, "engine"]), registry=r)
        info_labels = {**cache_info, "engine": "0"}
        info.labels(*(info_labels[k] for k in info.labelnames)).set(1)
        self.g_lora: Gauge | None = None
        if max_loras is not None:
            self.g_lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.pd_fallbacks = counter("kvflow_sim:kv_pull_failures", "P/D decode requests whose KV pull failed and "
                                    "fell back to local prefill (simulator only).")
        self.engine_slip = counter("kvflow_sim:engine_slip_seconds", "Simulated time the engine skipped because "
                                   "the process fell too far behind its timeline (simulator only; 0 when every "
                                   "step ran on its modelled schedule).")
        self.offload_bytes = offload_bytes
        self.offload_total_bytes: dict[str, CounterChild] = {}
        self.offload_total_time: dict[str, CounterChild] = {}
        if offload_bytes is not None:  # the OffloadingConnector's stats, by transfer direction
            self.offload_total_bytes = counters_by(
                "vllm:kv_offload_total_bytes", "Number of bytes transferred by the KV offloading connector.",
                "transfer_type", OFFLOAD_DIRECTIONS)
            self.offload_total_time = counters_by(
                "vllm:kv_offload_total_time", "Seconds spent in KV offloading transfers.",
                "transfer_type", OFFLOAD_DIRECTIONS)
        self.http = HttpMetrics(r)
        self._gauges: EngineGauges | None = None
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0, "ext_queries": 0, "ext_hits": 0, "slip": 0.0,
                      "stored": 0}

    def bind(self, gauges: EngineGauges) -> None:
        self._gauges = gauges
        waiting = gauges.waiting
        self.g_running.set_function(gauges.running)
        self.g_waiting.set_function(waiting)
        self.g_capacity.set_function(lambda: waiting() - gauges.deferred())
        self.g_deferred.set_function(gauges.deferred)
        self.g_usage.set_function(gauges.kv_usage)

    def refresh(self) -> None:
        """Bring the counters that mirror the engine's running totals up to date (at scrape time)."""
        g = self._gauges
        if g is None:
            return
        self._advance(self.c_prefix_queries, "queries", g.prefix_queries())
        self._advance(self.c_prefix_hits, "hits", g.prefix_hits())
        self._advance(self.c_external_queries, "ext_queries", g.external_queries())
        self._advance(self.c_external_hits, "ext_hits", g.external_hits())
        self._advance(self.c_preemptions, "preemptions", g.preemptions())
        self._advance(self.engine_slip, "slip", g.slipped_seconds())
        if self.offload_bytes is not None:
            stored = g.offload_stored_tokens()
            new = stored - self._seen["stored"]
            if new > 0:
                per_token, bandwidth = self.offload_bytes
                self.offload_total_bytes["GPU_to_CPU"].inc(new * per_token)
                self.offload_total_time["GPU_to_CPU"].inc(new * per_token / bandwidth)
                self._seen["stored"] = stored
        if self.g_lora is not None:
            self.g_lora.labels(
                str(self._max_loras), ",".join(g.lora_waiting()), ",".join(g.lora_running())
            ).set(time.time())

    def render(self) -> bytes:
        self.refresh()
        head = self.runtime.render() if self.runtime is not None else ""
        return (head + self.registry.render()).encode()

    def _advance(self, counter: CounterChild, key: str, total: float) -> None:
        """Counters mirror the scheduler's running totals (the scheduler knows no Prometheus)."""
        delta = total - self._seen[key]
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = total

    # -- per step / per request ------------------------------------------------------------
    def on_step(self, num_tokens: int, num_generated: int) -> None:
        if num_tokens:
            self.h_iteration.observe(num_tokens)
        if num_generated:
            self.generation_tokens.inc(num_generated)

    def on_offload_load(self, num_tokens: int, seconds: float) -> None:
        """A step copied ``num_tokens`` tokens' KV back from the CPU tier."""
        if self.offload_bytes is not None:
            self.offload_total_bytes["CPU_to_GPU"].inc(num_tokens * self.offload_bytes[0])
            self.offload_total_time["CPU_to_GPU"].inc(seconds)

    def on_first_token(self, req: SimRequest) -> None:
        """At the end of a request's prefill (vLLM counts prompt tokens there, not at the end).
        CPU-tier hits come through the connector: external to vLLM's counters, ``host`` by tier."""
        cached, pulled, computed = _prompt_sources(req)
        host = req.offloaded_tokens
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(cached - host)
        self.prompt_by_source["external_kv_transfer"].inc(pulled + host)
        self.prompt_tokens_cached.inc(cached + pulled)
        self.cached_by_source["device"].inc(cached - host)
        self.cached_by_source["host"].inc(host)
        self.cached_by_source["p2p"].inc(pulled)
        if req.first_token_at is not None:
            self.h_ttft.observe(max(0.0, req.first_token_at - req.arrival))

    def on_token_gaps(self, gaps: dict[float, int]) -> None:
        """Inter-token gaps of one step: gap in seconds -> number of requests."""
        for seconds, n in gaps.items():
            self.h_itl.observe(seconds, n)

    def on_finished(self, req: SimRequest) -> None:
        """A request the engine finished (stop or length); vLLM's ``update_from_finished_request``."""
        self.request_success[req.finish_reason or "stop"].inc()
        generated = len(req.output_ids)
        self.h_prompt.observe(req.num_prompt_tokens)
        self.h_generation.observe(generated)
        self.h_max_generation.observe(generated)  # the most any of the request's n choices generated
        self.h_max_tokens.observe(req.max_tokens)
        self.h_n.observe(1)
        self.h_preemptions.observe(req.num_preemptions)
        self.h_prefill_computed.observe(_prompt_sources(req)[2])
        end = req.finished_at or req.arrival
        self.h_e2e.observe(max(0.0, end - req.arrival))
        if req.scheduled_at is not None:
            self.h_queue.observe(max(0.0, req.scheduled_at - req.arrival))
            self.h_inference.observe(max(0.0, end - req.scheduled_at))
            if req.first_token_at is not None:
                self.h_prefill.observe(max(0.0, req.first_token_at - req.scheduled_at))
        if req.first_token_at is not None:
            self.h_decode.observe(max(0.0, end - req.first_token_at))
            self.h_tpot.observe((end - req.first_token_at) / (generated - 1) if generated > 1 else 0.0)


def _prompt_sources(req: SimRequest) -> tuple[int, int, int]:
    """Prompt tokens from the local prefix cache, pulled from a prefill pod, and computed here."""
    cached = req.cached_tokens
    pulled = req.num_prompt_tokens - cached if req.pull_ok else 0
    return cached, pulled, req.num_prompt_tokens - cached - pulled
