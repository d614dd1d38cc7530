"""The KV-event wire format, byte for byte against payloads captured from real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.protocol.kv_events import decode_structs, encode_batch
from kvflow.sim.events import is_bind_endpoint

FRAMES = [
    frame
    for run in json.loads((Path(__file__).parent.parent / "golden" / "vllm_kv_events.json").read_text())["runs"]
    for frame in run["frames"]
]


@pytest.mark.parametrize("frame", FRAMES, ids=[f"seq{f['seq']}-{i}" for i, f in enumerate(FRAMES)])
def test_our_structs_reencode_vllms_payloads_identically(frame: dict) -> None:
    payload = bytes.fromhex(frame["payload_hex"])
    batch = decode_structs(payload)
    assert encode_batch(list(batch.events), ts=batch.ts, dp_rank=batch.data_parallel_rank or 0) == payload


@pytest.mark.parametrize(("endpoint", "binds"), [
    ("tcp://*:5557", True),
    ("tcp://[::]:5557", True),
    ("ipc:///tmp/kv", True),
    ("inproc://kv", True),
    ("tcp://127.0.0.1:5557", False),
    ("tcp://router.default.svc:5557", False),
    ("tcp://127.0.0.2:5557", True),  # the pod's own address (its --host): vLLM would connect to itself
])
def test_bind_or_connect_follows_vllm(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint, own_host="127.0.0.2") is binds
