"""Soak under faults: steady load through the gateway over 3 simulated pods while pods die and freeze.

``kvflow bench soak`` runs, for ``--minutes`` (default 10), an open-loop load of ``--rate``
requests a second (half streamed) through ``kvflow gateway`` as users get it (default profile,
scrapes, access log), in front of 3 ``kvflow sim`` pods on 127.0.0.x. ``--faults`` times (default
2), evenly spread, it SIGKILLs one pod and starts it again, and SIGSTOPs another for
``--stop-seconds`` (default 10) before SIGCONT. It reports:

* requests sent; requests lost (a non-streamed request that did not get a 200); streams cut (a
  stream that ended with an error event or broke off) and streams that failed before a byte;
* the gateway's RSS every 10 s (the router runs inside it), and how flat it stays after warm-up
  (the first fifth of the run);
* for each restart, the time from the pod's first good health check until the gateway's router
  counts it routable again (``kvflow_router_endpoint_healthy``), and until it serves a request.

Targets (issue 12): nothing lost, RSS flat within 10 % after warm-up, back in rotation within
2 s of the first good health check. Writes ``bench/out/soak.json`` (and ``soak.png`` with
matplotlib installed). Everything stays on 127.0.0.x and stops at the end.

    kvflow bench soak                       # 10 minutes
    kvflow bench soak --minutes 1 --faults 1 --stop-seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from kvflow.local.procs import Child, ProcessGroup, free_port, kvflow_argv

ROOT = Path(__file__).resolve().parent.parent
MODEL = "soak-model"


@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    lost: int = 0
    """Non-streamed requests that did not get a 200."""
    streams_ok: int = 0
    streams_cut: int = 0
    """Streams that began and then ended with an error event or broke off."""
    streams_failed: int = 0
    """Streams refused before their first byte (the client would simply retry)."""
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


@dataclass
class Restart:
    pod: str
    killed_at: float
    healthy_at: float | None = None
    """The pod's first good health check after its restart."""
    routable_at: float | None = None
    """The gateway's router counts it routable again (``kvflow_router_endpoint_healthy`` 1)."""
    first_request_at: float | None = None
    """It served a request again (when the scheduler chose it: a cache-affine profile may not
    send it anything for a while, which is a routing choice, not an outage)."""

    @property
    def back_after_s(self) -> float | None:
        if self.healthy_at is None or self.routable_at is None:
            return None
        return max(0.0, self.routable_at - self.healthy_at)


@dataclass
class Report:
    minutes: float
    rate: float
    counts: Counts
    rss_mb: list[tuple[float, float]]
    """(seconds since start, gateway RSS in MiB) every 10 s."""
    rss_growth_after_warmup: float | None
    restarts: list[Restart]
    stops: list[tuple[str, float]]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


_rng = random.Random(0)
PROMPTS = [f"tenant {t % 20} says " + " ".join(_rng.choices([f"w{i}" for i in range(300)], k=_rng.randint(5, 60)))
           for t in range(500)]
"""A fixed set of prompts, drawn at random: the router's prefix index and hash memo and the
built-in tokenizer's piece cache hold what they have seen up to their caps, so endless new
prompts would read as memory growth until those caps are reached (a cache filling, not a leak)."""


async def one_request(session: aiohttp.ClientSession, url: str, counts: Counts, stream: bool, n: int) -> None:
    body = {"model": MODEL, "prompt": random.choice(PROMPTS), "max_tokens": 16, "stream": stream}
    counts.sent += 1
    try:
        async with session.post(url, json=body) as r:
            if not stream:
                await r.read()
                if r.status == 200:
                    counts.ok += 1
                else:
                    counts.lost += 1
                    counts.error(f"status_{r.status}")
                return
            if r.status != 200:
                counts.streams_failed += 1
                counts.error(f"stream_status_{r.status}")
                return
            text = (await r.read()).decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as exc:
        if stream:
            counts.streams_cut += 1
        else:
            counts.lost += 1
        counts.error(type(exc).__name__)
        return
    if '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
        counts.streams_cut += 1
        counts.error("stream_error_event")
    else:
        counts.streams_ok += 1


async def load(url: str, rate: float, seconds: float, counts: Counts) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < seconds:
            task = asyncio.ensure_future(one_request(session, url, counts, stream=n % 2 == 1, n=n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=150)


async def health_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            return r.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def requests_seen(session: aiohttp.ClientSession, url: str) -> float:
    """Requests a pod has admitted since it started (its own counter)."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


async def routable(session: aiohttp.ClientSession, gateway: str, pod: str) -> bool:
    needle = f'endpoint="{pod.removeprefix("http://")}"'
    try:
        async with session.get(gateway + "/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError):
        return False
    return any(line.startswith("kvflow_router_endpoint_healthy{") and needle in line and line.endswith(" 1.0")
               for line in text.splitlines())


async def watch_restart(restart: Restart, url: str, gateway: str, t0: float, seconds: float) -> None:
    async with aiohttp.ClientSession() as session:
        while not await health_ok(session, url):
            await asyncio.sleep(0.02)
        restart.healthy_at = time.monotonic() - t0
        end = t0 + seconds
        while time.monotonic() < end and (restart.routable_at is None or restart.first_request_at is None):
            now = time.monotonic() - t0
            if restart.routable_at is None and await routable(session, gateway, url):
                restart.routable_at = now
            if restart.first_request_at is None and await requests_seen(session, url) > 0:
                restart.first_request_at = now
            await asyncio.sleep(0.05)


async def faults(group: ProcessGroup, pods: list[Child], urls: list[str], gateway: str, args: argparse.Namespace,
                 t0: float, report: Report) -> None:
    seconds = args.minutes * 60
    for k in range(args.faults):
        await asyncio.sleep(max(0.0, t0 + seconds * (k + 1) / (args.faults + 1) - time.monotonic()))
        victim, frozen = k % len(pods), (k + 1) % len(pods)
        pods[victim].popen.send_signal(signal.SIGKILL)
        pods[victim].popen.wait()
        restart = Restart(urls[victim], killed_at=time.monotonic() - t0)
        report.restarts.append(restart)
        pods[victim] = group.start(f"pod{victim}-restart{k}", pods[victim].argv)
        watcher = asyncio.ensure_future(watch_restart(restart, urls[victim], gateway, t0, seconds))
        os.kill(pods[frozen].popen.pid, signal.SIGSTOP)
        report.stops.append((urls[frozen], time.monotonic() - t0))
        await asyncio.sleep(args.stop_seconds)
        os.kill(pods[frozen].popen.pid, signal.SIGCONT)
        await watcher


async def sample_rss(pid: int, t0: float, seconds: float, report: Report, every: float) -> None:
    while time.monotonic() - t0 < seconds:
        report.rss_mb.append((round(time.monotonic() - t0, 1), round(rss_mb(pid), 1)))
        await asyncio.sleep(every)
    report.rss_mb.append((round(time.monotonic() - t0, 1), round(rss_mb(pid), 1)))


async def run(args: argparse.Namespace, group: ProcessGroup) -> Report:
    pods, urls = [], []
    for i in range(3):
        host = f"127.0.0.{80 + i}"
        port = free_port(host)
        urls.append(f"http://{host}:{port}")
        pods.append(group.start(f"pod{i}", kvflow_argv("sim", "--host", host, "--port", str(port), "--model", MODEL,
                                                       "--profile", args.profile, "--log-level", "ERROR"),
                                ready_url=urls[-1] + "/health"))
    group.wait_ready(60)
    port = free_port()
    gateway = group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", MODEL,
                                                 *[a for u in urls for a in ("--endpoint", u[7:])]),
                          ready_url=f"http://127.0.0.1:{port}/health")
    group.wait_ready(60, [gateway])
    report = Report(args.minutes, args.rate, Counts(), [], None, [], [])
    seconds = args.minutes * 60
    t0 = time.monotonic()
    await asyncio.gather(
        load(f"http://127.0.0.1:{port}/v1/completions", args.rate, seconds, report.counts),
        faults(group, pods, urls, f"http://127.0.0.1:{port}", args, t0, report),
        sample_rss(gateway.popen.pid, t0, seconds, report, args.rss_every),
    )
    warm = [mb for t, mb in report.rss_mb if t >= seconds / 5]
    if len(warm) >= 2:
        report.rss_growth_after_warmup = round(max(warm) / min(warm) - 1, 4)
    return report


def print_report(r: Report) -> None:
    c = r.counts
    backs = [x.back_after_s for x in r.restarts]
    print(f"Soak: {r.minutes:g} min at {r.rate:g} req/s (half streamed), {len(r.restarts)} kill+restart, "
          f"{len(r.stops)} SIGSTOP\n")
    print("| requests sent | ok | lost | streams ok | streams cut | streams refused | RSS growth after warm-up "
          "| back in rotation after first good health check (s) | first request after it (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    growth = "–" if r.rss_growth_after_warmup is None else f"{r.rss_growth_after_warmup * 100:+.1f} %"
    back = ", ".join("never" if b is None else f"{b:.2f}" for b in backs) or "–"
    first = ", ".join("none" if x.first_request_at is None or x.healthy_at is None
                      else f"{x.first_request_at - x.healthy_at:.2f}" for x in r.restarts) or "–"
    print(f"| {c.sent} | {c.ok} | {c.lost} | {c.streams_ok} | {c.streams_cut} | {c.streams_failed} | {growth} "
          f"| {back} | {first} |")
    if c.errors:
        print("\nerrors: " + ", ".join(f"{k} {v}" for k, v in sorted(c.errors.items())))
    print("\n| t (s) | gateway RSS (MiB) |\n|---:|---:|")
    for t, mb in r.rss_mb:
        print(f"| {t:.0f} | {mb:.1f} |")


def plot(r: Report, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([t for t, _ in r.rss_mb], [mb for _, mb in r.rss_mb], marker="o")
    for restart in r.restarts:
        ax.axvline(restart.killed_at, color="red", linestyle="--", linewidth=0.8)
    for _, at in r.stops:
        ax.axvspan(at, at + 10, color="orange", alpha=0.2)
    ax.set_xlabel("seconds")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_title("kvflow gateway under faults (red: SIGKILL + restart, orange: SIGSTOP)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=20.0, help="requests a second, half of them streamed")
    p.add_argument("--faults", type=int, default=2, help="kill+restart and SIGSTOP rounds")
    p.add_argument("--stop-seconds", type=float, default=10.0)
    p.add_argument("--rss-every", type=float, default=10.0)
    p.add_argument("--profile", default="fast", help="the simulated pods' timing profile")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args(argv)
    with ProcessGroup(ROOT / ".kvflow" / "bench-soak-logs") as group:
        report = asyncio.run(run(args, group))
    print_report(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    data["restarts"] = [{**asdict(x), "back_after_s": x.back_after_s} for x in report.restarts]
    (out / "soak.json").write_text(json.dumps(data, indent=2))
    plot(report, out / "soak.png")
    return 0 if report.counts.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
