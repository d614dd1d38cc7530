"""Gateway overhead: direct to the pods vs kvflow gateway vs sglang-router vs vllm-router, and
(``--layers``) the kvflow gateway on other HTTP servers and clients.

Everything runs on this machine in one go, against the same simulated pods (``--profile fast``,
so the pods are not the bottleneck): ``wrk`` sends small non-streamed completions, first on one
connection (added latency), then on 64 (throughput). Then a few clients stream long answers
(``--streams``, each token its own chunk, as a decoding pod sends them): what relaying a token
costs. The CPU each router process used per request and per streamed token is read from /proc.
Then every target gets the attack suite of ``edge_attacks.py`` (oversized URL and headers,
slowloris, pipelining, CL+TE smuggling, deep JSON, bad UTF-8).

* ``kvflow`` (the headline) is the gateway as users get it: ``kvflow gateway --model M
  --endpoint ...`` and nothing else (the ``default`` profile, default scrapes and KV events,
  access log on at the default log level);
* ``kvflow-tuned`` is tuned for this benchmark: ``round-robin``, health scrapes once a second
  (round-robin reads no metrics), no KV-event subscription, no access log (the peers log at warn);
  ``kvflow-tuned-2w`` the same with ``--workers 2`` (as the Rust peers run two worker threads);
* ``kvflow-envoy`` is kvflow's endpoint picker behind a real Envoy 1.40 (``kvflow router`` as its
  ext_proc server, the bootstrap ``kvflow.router.envoy_config`` renders), every answer's body
  streamed through the picker (``FULL_DUPLEX_STREAMED``, as the Inference Extension's gateways
  configure it); ``kvflow-envoy-lean`` the same with ``response_bodies=False`` (Envoy relays
  answers itself and ends the ext_proc stream when one ends). Their CPU is Envoy's and the
  picker's together; the picker runs the default profile, as the ``kvflow`` row;
* the peers use round-robin;
* ``--layers`` adds the tuned gateway on uvicorn (ASGI) and granian (RSGI) instead of kvflow's
  server, and with aiohttp or pyreqwest instead of kvflow's upstream client
  (``gateway_layers.py``): how the HTTP layer was chosen (docs/gateway.md).

    python bench/bench_gateway.py                   # ~90 s: 2 interleaved rounds, the table shows medians
    python bench/bench_gateway.py --layers          # + the HTTP-layer comparison
    python bench/bench_gateway.py --only kvflow     # one target

The peers are installed on first use into their own venv, ``.kvflow/peers/venv`` (gitignored).
Needs ``wrk`` (Debian: ``apt-get install wrk``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import time
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvflow.endpoints import Endpoint
from kvflow.local.procs import ProcessGroup, kvflow_argv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_attacks import run_attacks  # noqa: E402 - a sibling module of this script
from kvbench.pods import Pod  # noqa: E402
from kvbench.routers import ENVOY, RouterSpec, envoy_stack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".kvflow" / "peers" / "venv"
MODEL = "bench-model"
BODY = json.dumps({"model": MODEL, "prompt": "Say hello to the benchmark", "max_tokens": 4})
STREAM_BODY = {"model": MODEL, "prompt": "Say hello to the benchmark", "max_tokens": 256, "stream": True,
               "ignore_eos": True}

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
local addrs = {}
local n = 0
function setup(thread)
  -- 'direct' spreads the threads over the pods; with one address this is a no-op
  if #addrs == 0 then
    for _, hp in ipairs({%s}) do
      for _, a in ipairs(wrk.lookup(hp[1], hp[2])) do table.insert(addrs, a) end
    end
  end
  n = n + 1
  thread.addr = addrs[(n - 1) %% #addrs + 1]
end
"""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Row:
    target: str
    p50_c1_ms: float
    p99_c1_ms: float
    rps_c64: float
    p50_c64_ms: float
    cpu_us_per_req: float | None
    errors: int
    attacks: dict[str, bool] | None = None
    stream_tokens_s: float | None = None
    stream_itl_p50_ms: float | None = None
    stream_itl_p99_ms: float | None = None
    stream_cpu_us_per_token: float | None = None


def ensure_peers() -> Path:
    bin_dir = PEERS / "bin"
    if not (bin_dir / "smg").exists() or not (bin_dir / "vllm-router").exists():
        print("installing sglang-router and vllm-router into", PEERS, file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", "sglang-router", "vllm-router"], check=True)
    return bin_dir


def wrk(url: str, hosts: list[str], *, connections: int, seconds: float) -> dict[str, float]:
    """``hosts`` are HOST:PORT; wrk's threads are spread over them."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        pairs = ", ".join(f'{{"{host}", "{port}"}}' for host, port in (h.rsplit(":", 1) for h in hosts))
        f.write(WRK_SCRIPT % (BODY, pairs))
    threads = max(1, min(connections, len(hosts)))
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", f.name, url],
                         capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return parse_wrk(out)


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def parse_wrk(text: str) -> dict[str, float]:
    def latency(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
        return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in", text)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "p50": latency("50"), "p99": latency("99"), "rps": float(rps.group(1)) if rps else 0.0,
        "requests": float(total.group(1)) if total else 0.0,
        "errors": float(bad.group(1) if bad else 0) + (sum(map(int, errors.groups())) if errors else 0),
    }


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process and its children that were waited for (launchers fork)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            pass
    return total


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            found += [kid, *children(kid)]
    return found


@dataclass
class Streamed:
    tokens: int
    gaps: list[float]
    """Seconds between two tokens reaching a client (0 for the later tokens of one read)."""
    errors: int


async def stream_load(hosts: list[str], streams: int, seconds: float) -> Streamed:
    """``streams`` clients, each asking ``/v1/completions`` for streamed completions back to back
    for ``seconds`` (spread over ``hosts``, HOST:PORT, like wrk's threads)."""
    got = Streamed(0, [], 0)
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, host: str) -> None:
        while time.perf_counter() < deadline:
            async with session.post(f"http://{host}/v1/completions", json=STREAM_BODY) as r:
                if r.status != 200:
                    got.errors += 1
                    await r.read()
                    continue
                last = None
                async for piece in r.content.iter_any():
                    now, n = time.perf_counter(), piece.count(b"data: {")
                    if n and last is not None:
                        got.gaps += [now - last, *[0.0] * (n - 1)]
                    if n:
                        got.tokens, last = got.tokens + n, now

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, hosts[i % len(hosts)]) for i in range(streams)))
    return got


def measure(name: str, url: str, hosts: list[str], pids: list[int], args: argparse.Namespace,
            warm: bool = False) -> Row:
    """``pids``: the router's processes (Envoy and its picker: both), whose CPU the row counts."""
    def cpu() -> float:
        return sum(cpu_seconds(pid) for pid in pids)

    time.sleep(1.0)  # let the pods finish what the previous run's 64 connections left behind
    if warm:
        wrk(url, hosts, connections=8, seconds=1)  # open connections, fill caches
    c1 = wrk(url, hosts, connections=1, seconds=args.latency_seconds)
    before = cpu()
    c64 = wrk(url, hosts, connections=args.connections, seconds=args.seconds)
    per_request = (cpu() - before) / c64["requests"] * 1e6 if pids and c64["requests"] else None
    row = Row(name, c1["p50"], c1["p99"], c64["rps"], c64["p50"], per_request, int(c1["errors"] + c64["errors"]))
    if args.streams and args.stream_seconds > 0:
        time.sleep(1.0)
        before = cpu()
        streamed = asyncio.run(stream_load(hosts, args.streams, args.stream_seconds))
        if pids and streamed.tokens:
            row.stream_cpu_us_per_token = (cpu() - before) / streamed.tokens * 1e6
        row.stream_tokens_s = streamed.tokens / args.stream_seconds
        if streamed.gaps:
            gaps = statistics.quantiles(streamed.gaps, n=100)
            row.stream_itl_p50_ms, row.stream_itl_p99_ms = gaps[49] * 1e3, gaps[98] * 1e3
        row.errors += streamed.errors
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3.0, help="throughput run per target and round")
    p.add_argument("--latency-seconds", type=float, default=2.0, help="one-connection run per target and round")
    p.add_argument("--only", nargs="*", default=None,
                   help="targets: direct kvflow kvflow-tuned kvflow-tuned-2w kvflow-envoy kvflow-envoy-lean "
                        "sglang-router vllm-router "
                        "(and with --layers: uvicorn+own granian+own own+aiohttp own+pyreqwest)")
    p.add_argument("--layers", action="store_true", help="also the gateway on other HTTP servers and clients")
    p.add_argument("--no-attacks", action="store_true", help="skip the attack suite")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag for kvflow gateway")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the table shows medians")
    p.add_argument("--streams", type=int, default=4, help="streaming clients (0: no streaming run)")
    p.add_argument("--stream-seconds", type=float, default=3.0, help="streaming run per target and round")
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench_gateway needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    wanted = args.only or ["direct", "kvflow", "kvflow-tuned", "kvflow-tuned-2w", *ENVOYS, "sglang-router",
                           "vllm-router", *(LAYERS if args.layers else [])]
    peers = ensure_peers() if {"sglang-router", "vllm-router"} & set(wanted) else None
    pods = [f"127.0.0.{i + 2}:{free_port(f'127.0.0.{i + 2}')}" for i in range(args.pods)]
    urls = [f"http://{h}" for h in pods]
    ports = {name: free_port("127.0.0.1") for name in ("kvflow", "kvflow-tuned", "kvflow-tuned-2w", "sglang-router",
                                                       "vllm-router", "p1", "p2", *LAYERS, *ENVOYS)}
    with ProcessGroup(ROOT / ".kvflow" / "bench-gateway-logs") as group:
        for i, pod in enumerate(pods):
            host, port = pod.rsplit(":", 1)
            group.start(f"pod{i}", kvflow_argv("sim", "--host", host, "--port", port, "--model", MODEL,
                                               "--profile", "fast", "--log-level", "ERROR"),
                        ready_url=f"http://{pod}/health")
        group.wait_ready(60)
        # Round-robin reads no pod metrics and no KV events: scrape only for health, about as
        # often as the peers health-check, and subscribe to nothing.
        router_config = group.log_dir / "router.json"
        router_config.write_text(json.dumps({"scrapeIntervalSeconds": 1.0, "staleAfterSeconds": 5.0,
                                             "kvEvents": {"enabled": False}}))
        endpoints = [a for pod in pods for a in ("--endpoint", pod)]
        tuned = ["--profile", "round-robin", "--router-config", str(router_config), "--no-access-log",
                 "--log-level", "WARNING", *args.gateway_arg]

        def gateway(name: str, *extra: str) -> list[str]:
            return ["gateway", "--host", "127.0.0.1", "--port", str(ports[name]), "--model", MODEL, *endpoints, *extra]

        routers = {
            "kvflow": (kvflow_argv(*gateway("kvflow", *args.gateway_arg)), ports["kvflow"]),  # as users get it
            "kvflow-tuned": (kvflow_argv(*gateway("kvflow-tuned", *tuned)), ports["kvflow-tuned"]),
            "kvflow-tuned-2w": (kvflow_argv(*gateway("kvflow-tuned-2w", *tuned, "--workers", "2")),
                                ports["kvflow-tuned-2w"]),
            **{layer: ([sys.executable, str(ROOT / "bench" / "gateway_layers.py"), "--server", layer.split("+")[0],
                        "--client", layer.split("+")[1], *gateway(layer, *tuned)[1:]], ports[layer])
               for layer in LAYERS},
            "sglang-router": ([str(peers / "smg"), "launch", "--host", "127.0.0.1", "--port", str(ports["sglang-router"]),
                               "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "warn",
                               "--prometheus-port", str(ports["p1"]), "--max-concurrent-requests", "-1"],
                              ports["sglang-router"]) if peers else None,
            "vllm-router": ([str(peers / "vllm-router"), "--host", "127.0.0.1", "--port", str(ports["vllm-router"]),
                             "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "warning",
                             "--prometheus-port", str(ports["p2"]), "--max-concurrent-requests", "100000"],
                            ports["vllm-router"]) if peers else None,
        }
        targets: dict[str, tuple[str, list[str], list[int]]] = {}
        for name in wanted:  # every router runs for the whole benchmark; an idle one costs ~nothing
            if name == "direct":
                targets[name] = (urls[0] + "/v1/completions", pods, [])
                continue
            if name in ENVOYS:
                started = start_envoy(group, name, ports[name], pods, response_bodies=name == "kvflow-envoy")
                targets[name] = (f"http://127.0.0.1:{ports[name]}/v1/completions", [f"127.0.0.1:{ports[name]}"],
                                 started)
                continue
            spec = routers[name]
            assert spec is not None
            child = group.start(name, spec[0], ready_url=f"http://127.0.0.1:{spec[1]}/health")
            group.wait_ready(120, [child])
            targets[name] = (f"http://127.0.0.1:{spec[1]}/v1/completions", [f"127.0.0.1:{spec[1]}"],
                             [child.popen.pid])
        runs: dict[str, list[Row]] = {name: [] for name in wanted}
        for round_ in range(args.rounds):  # interleaved, in a rotating order, against background noise
            order = wanted[round_ % len(wanted):] + wanted[: round_ % len(wanted)]
            for name in order:
                runs[name].append(measure(name, *targets[name], args, warm=round_ == 0))
                print(runs[name][-1], file=sys.stderr)
        rows = [median_row(name, runs[name]) for name in wanted]
        if not args.no_attacks:
            for row in rows:
                url = targets[row.target][0]
                host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
                row.attacks = asyncio.run(run_attacks(host, int(port), MODEL))
                print(row.target, row.attacks, file=sys.stderr)
    print_table(rows)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


ENVOYS = ["kvflow-envoy", "kvflow-envoy-lean"]
"""kvflow's picker behind Envoy: every answer through the picker, or (lean) past it."""


def start_envoy(group: ProcessGroup, name: str, port: int, pods: list[str], *, response_bodies: bool) -> list[int]:
    """The routing benchmark's ``kvflow-envoy`` (``[:lean]``) stack in front of ``pods``, Envoy
    on 127.0.0.1:``port``: its picker and Envoy, started; their pids."""
    spec = RouterSpec(ENVOY, response_bodies=response_bodies)
    fleet = [Pod(Endpoint(host, int(p)), "both", "") for host, p in (pod.rsplit(":", 1) for pod in pods)]
    children = [group.start(f"{name}-{process.name}", process.argv, ready_url=process.ready_url)
                for process in envoy_stack(spec, fleet, port, group.log_dir / name, model=MODEL)]
    group.wait_ready(120, children)
    return [child.popen.pid for child in children]


def median_row(name: str, runs: list[Row]) -> Row:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    def med_of(field: str) -> float | None:
        values = [v for r in runs if (v := getattr(r, field)) is not None]
        return med(values) if values else None

    return Row(name, med([r.p50_c1_ms for r in runs]), med([r.p99_c1_ms for r in runs]),
               med([r.rps_c64 for r in runs]), med([r.p50_c64_ms for r in runs]),
               med_of("cpu_us_per_req"), sum(r.errors for r in runs),
               stream_tokens_s=med_of("stream_tokens_s"), stream_itl_p50_ms=med_of("stream_itl_p50_ms"),
               stream_itl_p99_ms=med_of("stream_itl_p99_ms"), stream_cpu_us_per_token=med_of("stream_cpu_us_per_token"))


LAYERS = ["uvicorn+own", "granian+own", "own+aiohttp", "own+pyreqwest"]
"""server+client: the tuned gateway on another HTTP layer (kvflow-tuned is own+own)."""


def print_table(rows: list[Row]) -> None:
    direct = next((r for r in rows if r.target == "direct"), None)
    print(f"| target | p50 1 conn (ms) | added p50 (ms) | p99 1 conn (ms) | req/s {64} conns | p50 64 conns (ms) "
          "| router CPU µs/req | errors | attacks passed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        added = f"{r.p50_c1_ms - direct.p50_c1_ms:+.3f}" if direct and r is not direct else "–"
        cpu = f"{r.cpu_us_per_req:.0f}" if r.cpu_us_per_req is not None else "–"
        attacks = "–"
        if r.attacks is not None:
            failed = [name for name, ok in r.attacks.items() if not ok]
            attacks = f"{len(r.attacks) - len(failed)}/{len(r.attacks)}" + (f" (fails {', '.join(failed)})"
                                                                              if failed else "")
        print(f"| {r.target} | {r.p50_c1_ms:.3f} | {added} | {r.p99_c1_ms:.3f} | {r.rps_c64:.0f} | "
              f"{r.p50_c64_ms:.2f} | {cpu} | {r.errors} | {attacks} |")
    streamed = [r for r in rows if r.stream_tokens_s is not None]
    if not streamed:
        return
    print("\n| target | streamed tokens/s | ITL p50 (ms) | ITL p99 (ms) | router CPU µs/token |")
    print("|---|---:|---:|---:|---:|")

    def num(value: float | None, digits: int) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    for r in streamed:
        print(f"| {r.target} | {r.stream_tokens_s:.0f} | {num(r.stream_itl_p50_ms, 3)} | {num(r.stream_itl_p99_ms, 3)} "
              f"| {num(r.stream_cpu_us_per_token, 1)} |")


if __name__ == "__main__":
    sys.exit(main())
