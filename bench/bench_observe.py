"""Is the simulator changed by being observed? (issue 10, item 1)

    kvflow bench observe [--duration 10] [--rounds 4] [--idle-seconds 30] [--pin]
                         [--skip loaded timeline idle render]

Four tables, and bench/out/observe_cdf.png:

1. A loaded pod as clients see it. One ``kvflow sim`` (h100-llama8b, KV events on, a subscriber
   connected), 64 streaming clients in a load-generator process, with and without a 20 Hz
   /metrics scrape from a process of its own (as a router's would be); rounds alternate the two
   conditions, to spread drift on a busy machine. Client-measured TTFT and inter-token latency
   (mean/p50/p90/p99) and scraped/unscraped ratios, plus what the pod itself reports: engine
   steps, timeline slip (from its /metrics) and CPU. ``--pin`` pins the pod to CPU 0 and the
   clients and scraper to CPU 1 (steadier on a quiet machine, worse on a shared one).
2. The timeline, engine view. The same seeded burst of 256 requests run in-process on the real
   clock (after one warm-up run), while the event loop is kept busy by: nothing; at 20 Hz the
   fast /metrics render, prometheus_client's generate_latest of the same families (what the
   render used to be), a 15 ms stall (the old render's cost on a loaded pod, issue 10); and once a
   second a 150 ms stall (beyond the engine's 96 ms tolerance: the timeline slips, and says so).
   Steps, simulated busy time and every token's simulated time are identical to the undisturbed
   run whenever the stalls stay within the tolerance.
3. Idle cost: an idle pod with KV events on, CPU share over --idle-seconds (/proc/<pid>/stat),
   without and with a 20 Hz scrape.
4. Render cost: CPU per /metrics render after run 2, the fast path against generate_latest.

Figures on a shared machine are preliminary; ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

OUT = Path(__file__).resolve().parent / "out"
HOST = "127.0.0.2"
SCRAPE_HZ = 20.0
SHARED_PREFIXES = 8


# -- workload -----------------------------------------------------------------------------
def prompt(rng: random.Random) -> list[int]:
    """One of a few 512-token shared system prompts, then a unique question of 32-256 tokens."""
    group = rng.randrange(SHARED_PREFIXES)
    question = [rng.randrange(10, 30000) for _ in range(rng.randrange(32, 257))]
    return [1000 + 512 * group + i for i in range(512)] + question


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"mean": statistics.fmean(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


# -- raw keep-alive HTTP (the generator must cost less than the pod) ----------------------------
async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split()[1]), headers


async def scraper(host: str, port: int, deadline: float, latencies: list[float]) -> None:
    """GET /metrics at 20 Hz on a fixed schedule (a slow scrape does not shift the next one)."""
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    tick = time.monotonic()
    try:
        while tick < deadline:
            start = time.monotonic()
            writer.write(request)
            status, headers = await read_head(reader)
            await reader.readexactly(int(headers["content-length"]))
            if status == 200:
                latencies.append(time.monotonic() - start)
            tick += 1 / SCRAPE_HZ
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
    finally:
        writer.close()


async def stream_client(host: str, port: int, index: int, measure_from: float, deadline: float,
                        out: dict[str, list[float]]) -> None:
    """Stream completions back to back; time every SSE event that carries text (one per step)."""
    rng = random.Random(index)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < deadline:
            body = json.dumps({"model": "sim-model", "prompt": prompt(rng), "max_tokens": rng.randrange(64, 193),
                               "stream": True, "ignore_eos": True}).encode()
            start = time.monotonic()
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            status, _ = await read_head(reader)
            if status != 200:
                out["errors"].append(float(status))
                return
            first = last = None
            gaps: list[float] = []
            buf = b""
            while not buf.endswith(b"\r\n0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    out["errors"].append(0.0)
                    return
                now = time.monotonic()
                buf += data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if b'"text":' not in event:
                        continue
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - (last or now))
                    last = now
            if start >= measure_from and first is not None:
                out["ttft"].append(first - start)
                out["itl"].extend(gaps)
    finally:
        writer.close()


async def kv_subscriber(endpoint: str, deadline: float, counter: list[int]) -> None:
    import zmq
    import zmq.asyncio

    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if await sub.poll(timeout=int(left * 1000)):
                await sub.recv_multipart()
                counter[0] += 1
    finally:
        sub.close()


async def generate(cfg: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    measure_from, deadline = start + cfg["warmup"], start + cfg["warmup"] + cfg["duration"]
    out: dict[str, list[float]] = {"ttft": [], "itl": [], "errors": [], "scrapes": []}
    batches = [0]
    tasks = [stream_client(cfg["host"], cfg["port"], cfg["seed"] * 1000 + i, measure_from, deadline, out)
             for i in range(cfg["clients"])]
    tasks.append(kv_subscriber(cfg["kv"], deadline, batches))
    await asyncio.gather(*tasks)
    return {**out, "kv_batches": batches[0], "elapsed": time.monotonic() - start}


def generator_main(cfg_json: str) -> None:
    import uvloop

    cfg = json.loads(cfg_json)
    result = uvloop.run(generate(cfg))
    Path(cfg["out"]).write_text(json.dumps(result))


def scraper_main(cfg_json: str) -> None:
    """A scraper of its own (as a router is): GET /metrics at 20 Hz until the deadline."""
    import uvloop

    cfg = json.loads(cfg_json)
    latencies: list[float] = []
    uvloop.run(scraper(cfg["host"], cfg["port"], time.monotonic() + cfg["seconds"], latencies))
    Path(cfg["out"]).write_text(json.dumps(latencies))


# -- the pod from outside ------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pod_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = {"vllm:iteration_tokens_total_count": "steps", "kvflow_sim:engine_slip_seconds_total": "slip",
            "vllm:generation_tokens_total": "tokens"}
    return {want[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in want}


def pin(cpu: int, args: argparse.Namespace) -> list[str]:
    return ["taskset", "-c", str(cpu)] if args.pin and (os.cpu_count() or 1) >= 2 else []


def start_pod(group: ProcessGroup, args: argparse.Namespace) -> tuple[Any, str, str]:
    port, kv_port = free_port(HOST), free_port()
    pod = group.start("sim", pin(0, args) + kvflow_argv(
        "sim", "--host", HOST, "--port", str(port), "--profile", "h100-llama8b",
        "--kv-events-endpoint", f"tcp://*:{kv_port}", "--kv-events-topic", "kv@bench"),
        ready_url=f"http://{HOST}:{port}/health")
    group.wait_ready(60)
    return pod, f"http://{HOST}:{port}", f"tcp://{HOST}:{kv_port}"


def loaded(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    conditions = {"no scrape": False, "20 Hz scrape": True}
    runs: dict[str, dict[str, Any]] = {c: {"ttft": [], "itl": [], "errors": 0, "scrapes": [], "kv_batches": 0,
                                           "cpu": 0.0, "seconds": 0.0, "steps": 0.0, "slip": 0.0, "tokens": 0.0}
                                       for c in conditions}
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        pod, url, kv = start_pod(group, args)
        port = int(url.rsplit(":", 1)[1])
        warm = {"host": HOST, "port": port, "kv": kv, "clients": args.clients, "warmup": 3.0, "duration": 0.0,
                "scrape": False, "seed": 99, "out": f"{tmp}/warm-up.json"}
        subprocess.run(pin(1, args) + [sys.executable, __file__, "--generate", json.dumps(warm)], check=True,
                       timeout=120)
        for r in range(args.rounds):
            order = list(conditions) if r % 2 == 0 else list(reversed(conditions))
            for name in order:
                cfg = {"host": HOST, "port": port, "kv": kv, "clients": args.clients, "warmup": 2.0,
                       "duration": args.duration, "scrape": conditions[name], "seed": r,
                       "out": f"{tmp}/{r}-{name}.json"}
                before, cpu0 = pod_counters(url), cpu_seconds(pod.popen.pid)
                scrape = None
                if conditions[name]:
                    scrape_cfg = {"host": HOST, "port": port, "seconds": cfg["warmup"] + args.duration,
                                  "out": f"{tmp}/{r}-scrapes.json"}
                    scrape = subprocess.Popen(pin(1, args) + [sys.executable, __file__, "--scrape",
                                                              json.dumps(scrape_cfg)])
                subprocess.run(pin(1, args) + [sys.executable, __file__, "--generate", json.dumps(cfg)], check=True,
                               timeout=args.duration + 120)
                cpu, after = cpu_seconds(pod.popen.pid) - cpu0, pod_counters(url)
                result = json.loads(Path(cfg["out"]).read_text())
                if scrape is not None:
                    scrape.wait(timeout=60)
                    result["scrapes"] = json.loads(Path(scrape_cfg["out"]).read_text())
                run = runs[name]
                run["ttft"] += result["ttft"]
                run["itl"] += result["itl"]
                run["errors"] += len(result["errors"])
                run["scrapes"] += result["scrapes"]
                run["kv_batches"] += result["kv_batches"]
                run["cpu"] += cpu
                run["seconds"] += result["elapsed"]
                for key in ("steps", "slip", "tokens"):
                    run[key] += after.get(key, 0.0) - before.get(key, 0.0)
        if pod.alive() is False:
            raise SystemExit(f"the simulator died:\n{pod.log_tail()}")
    return runs


def print_loaded(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base, scraped = runs["no scrape"], runs["20 Hz scrape"]
    print(f"\n### 1. Loaded pod, client view: h100-llama8b, {args.clients} streaming clients, KV events subscribed; "
          f"{args.rounds} x {args.duration:.0f} s per condition (rounds alternate)\n")
    print("| metric | no scrape | 20 Hz scrape | ratio |\n|---|---|---|---|")
    for what in ("ttft", "itl"):
        a, b = percentiles(base[what]), percentiles(scraped[what])
        for stat in ("mean", "p50", "p90", "p99"):
            ratio = b[stat] / a[stat] if a[stat] else float("nan")
            print(f"| {what.upper()} {stat} (ms) | {1000 * a[stat]:.2f} | {1000 * b[stat]:.2f} | {ratio:.3f} |")

    def row(label: str, f: Any) -> None:
        print(f"| {label} | {f(base)} | {f(scraped)} | |")

    row("requests measured", lambda r: len(r["ttft"]))
    row("errors", lambda r: r["errors"])
    row("pod engine steps/s (its /metrics)", lambda r: f"{r['steps'] / r['seconds']:.1f}")
    row("pod tokens/s", lambda r: f"{r['tokens'] / r['seconds']:.0f}")
    row("pod timeline slip (s)", lambda r: f"{r['slip']:.3f}")
    row("pod CPU", lambda r: f"{r['cpu'] / r['seconds']:.0%}")
    row("KV event batches received", lambda r: r["kv_batches"])
    row("scrapes (mean latency ms)", lambda r: f"{len(r['scrapes'])} ({1000 * statistics.fmean(r['scrapes']):.2f})"
        if r["scrapes"] else "0")


def plot(runs: dict[str, dict[str, Any]]) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(no plot: matplotlib is not installed; pip install -e '.[bench]')")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, title in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        for name, run in runs.items():
            xs = sorted(1000 * x for x in run[what])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel("ms (client-measured)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("kvflow sim (h100-llama8b), 64 streaming clients: with and without a 20 Hz /metrics scrape")
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "observe_cdf.png"
    fig.savefig(path, dpi=110)
    return path


# -- 2. the timeline in-process ----------------------------------------------------------------
def busy_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def timeline_run(kind: str) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvflow.sim.engine import Engine
    from kvflow.sim.kv_transfer import NoTransfer, TransferConfig
    from kvflow.sim.metrics import SimMetrics, cache_config_info
    from kvflow.sim.profiles import PROFILES
    from kvflow.sim.request import BlockHasher, HashConfig, SimRequest
    from kvflow.sim.sampler import Sampler
    from kvflow.sim.scheduler import Scheduler, SchedulerConfig
    from kvflow.tokenizer import load_tokenizer

    config = SchedulerConfig(block_size=16, num_blocks=2048, max_num_seqs=64, max_model_len=4096)
    info = cache_config_info(block_size=16, num_blocks=2048, num_blocks_override=2048, enable_prefix_caching=True,
                             hash_algo="sha256", max_model_len=4096)
    metrics = SimMetrics("sim-model", max_model_len=4096, cache_info=info)
    engine = Engine(Scheduler(config, Sampler(load_tokenizer(None))), PROFILES["h100-llama8b"],
                    transfer=NoTransfer(TransferConfig()), metrics=metrics)
    metrics.bind(engine.gauges())
    reference = CollectorRegistry(auto_describe=False)
    reference.register(metrics.registry)
    stalls = {"nothing": (lambda: None, SCRAPE_HZ), "fast /metrics render, 20 Hz": (metrics.render, SCRAPE_HZ),
              "generate_latest (the old render path), 20 Hz": (lambda: generate_latest(reference), SCRAPE_HZ),
              "a 15 ms stall, 20 Hz": (lambda: busy_for(0.015), SCRAPE_HZ),
              "a 150 ms stall, 1 Hz": (lambda: busy_for(0.150), 1.0)}
    stall, hz = stalls[kind]
    rng = random.Random(42)
    hash_config = HashConfig(16, "0", "sha256")
    reqs = [SimRequest(request_id=f"r{i}", prompt_ids=prompt(rng), max_tokens=rng.randrange(32, 161),
                       hasher=BlockHasher(hash_config, None, None), rng=random.Random(i), arrival=0.0)
            for i in range(256)]
    finished = asyncio.Event()
    left = [len(reqs)]

    def on_token(req: SimRequest) -> None:
        if req.finished:
            left[0] -= 1
            if not left[0]:
                finished.set()

    async def disturb() -> None:
        tick = time.monotonic()
        while True:
            tick += 1 / hz
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            stall()

    await engine.start()
    disturber = asyncio.get_running_loop().create_task(disturb())
    wall = time.monotonic()
    for req in reqs:
        req.notify = lambda req=req: on_token(req)  # type: ignore[misc]
        engine.submit(req)
    await finished.wait()
    wall = time.monotonic() - wall
    disturber.cancel()
    await engine.stop()
    t0 = reqs[0].arrival
    return {
        "steps": engine.steps, "busy": engine.busy_seconds, "slip": engine.slipped_seconds, "wall": wall,
        "makespan": max(r.finished_at or 0.0 for r in reqs) - t0, "itl": metrics.h_itl.sum / metrics.h_itl.count,
        "tokens": [(round((r.first_token_at or 0) - t0, 6), round((r.finished_at or 0) - t0, 6), len(r.output_ids))
                   for r in reqs],
        "metrics": metrics,
    }


def timeline() -> dict[str, dict[str, Any]]:
    import uvloop

    kinds = ["nothing", "fast /metrics render, 20 Hz", "generate_latest (the old render path), 20 Hz",
             "a 15 ms stall, 20 Hz", "a 150 ms stall, 1 Hz"]
    uvloop.run(timeline_run("nothing"))  # warm-up: imports, allocator, block-hash caches
    results = {kind: uvloop.run(timeline_run(kind)) for kind in kinds}
    base = results["nothing"]
    print("\n### 2. The timeline, engine view: 256 seeded requests in one burst (h100-llama8b, 64 at a time), "
          "in-process on the real clock, the event loop kept busy by ...\n")
    print("| loop busy with | engine steps | simulated busy s | simulated makespan s | engine ITL mean ms "
          "| slip ms | wall s | every token at the same simulated time |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        differ = sum(a != b for a, b in zip(r["tokens"], base["tokens"], strict=True))
        same = "yes" if not differ else f"no ({differ} of 256 requests differ)"
        print(f"| {kind} | {r['steps']} | {r['busy']:.6f} | {r['makespan']:.6f} | {1000 * r['itl']:.4f} "
              f"| {1000 * r['slip']:.1f} | {r['wall']:.2f} | {same} |")
    return results


# -- 3. idle cost; 4. render cost -------------------------------------------------------------
def idle(args: argparse.Namespace) -> None:
    import uvloop

    seconds = args.idle_seconds
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        pod, url, _ = start_pod(group, args)
        port = int(url.rsplit(":", 1)[1])
        time.sleep(1.0)
        for label, scrape in (("no scrape", False), ("20 Hz scrape", True)):
            latencies: list[float] = []
            cpu0, t0 = cpu_seconds(pod.popen.pid), time.monotonic()
            if scrape:
                uvloop.run(scraper(HOST, port, time.monotonic() + seconds, latencies))
            else:
                time.sleep(seconds)
            share = (cpu_seconds(pod.popen.pid) - cpu0) / (time.monotonic() - t0)
            rows.append((label, share, len(latencies)))
    print(f"\n### 3. Idle pod (h100-llama8b, KV events on), CPU share over {seconds:.0f} s from /proc/<pid>/stat\n")
    print("| condition | pod CPU (% of a core) | scrapes |\n|---|---|---|")
    for label, share, n in rows:
        print(f"| {label} | {100 * share:.2f} | {n} |")


def render_cost(metrics: Any) -> None:
    from prometheus_client import generate_latest

    from kvflow.sim.metrics import runtime_registry

    reference = runtime_registry()  # prometheus_client's own collectors, as the render used to use them
    reference.register(metrics.registry)

    def cpu_ms(f: Any, n: int = 200) -> float:
        f()
        start = time.process_time()
        for _ in range(n):
            f()
        return 1000 * (time.process_time() - start) / n

    def changed() -> None:
        for family in metrics.registry.families:  # one new observation in every histogram: no cached text
            for child in getattr(family, "children", {}).values():
                if hasattr(child, "observe") and hasattr(child, "counts"):
                    child.observe(0.5)
        metrics.render()

    size = len(metrics.render())
    print(f"\n### 4. /metrics render cost, CPU ms per render ({size / 1024:.0f} KB, after run 2)\n")
    print("| renderer | CPU ms | vs generate_latest |\n|---|---|---|")
    slow = cpu_ms(lambda: generate_latest(reference))
    for label, ms in (("prometheus_client generate_latest (same families)", slow),
                      ("fast path, nothing changed since the last render", cpu_ms(metrics.render)),
                      ("fast path, every histogram changed", cpu_ms(changed))):
        print(f"| {label} | {ms:.3f} | {ms / slow:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per loaded round and condition")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--skip", nargs="*", default=[], choices=("loaded", "timeline", "idle", "render"))
    p.add_argument("--pin", action="store_true", help="pin the pod to CPU 0 and the clients and scraper to CPU 1")
    p.add_argument("--generate", help=argparse.SUPPRESS)
    p.add_argument("--scrape", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        generator_main(args.generate)
        return
    if args.scrape:
        scraper_main(args.scrape)
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (preliminary on a shared machine)")
    if "loaded" not in args.skip:
        runs = loaded(args)
        print_loaded(runs, args)
        path = plot(runs)
        if path is not None:
            print(f"\nplot: {path}")
    if "timeline" not in args.skip:
        results = timeline()
        if "render" not in args.skip:
            render_cost(results["nothing"]["metrics"])
    if "idle" not in args.skip:
        idle(args)


if __name__ == "__main__":
    main()
