"""How many streamed requests per second one ``kvflow sim`` process sustains on one core.

Starts one simulator (``--profile fast``: ~0.5 ms steps, so the figure is the server's own
overhead, not modelled compute) pinned to one CPU, and a load generator in a separate process
(pinned to another CPU when there is one): C concurrent aiohttp clients, each streaming
completions of 16 tokens back to back for D seconds. Prints one row per concurrency.

    python bench/bench_sim.py [--concurrency 64 256] [--duration 10] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv


async def _client(url: str, body: bytes, deadline: float, lat: list[float], ttft: list[float],
                  errors: list[str]) -> int:
    import aiohttp

    done = 0
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as session:
        while time.monotonic() < deadline:
            start = time.monotonic()
            first = None
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    if r.status != 200:
                        errors.append(str(r.status))
                        continue
                    async for chunk in r.content.iter_any():
                        if first is None:
                            first = time.monotonic()
                        if chunk.endswith(b"data: [DONE]\n\n"):
                            break
            except aiohttp.ClientError as exc:
                errors.append(type(exc).__name__)
                continue
            end = time.monotonic()
            lat.append(end - start)
            ttft.append((first or end) - start)
            done += 1
    return done


async def _raw_client(url: str, body: bytes, deadline: float, lat: list[float], ttft: list[float],
                      errors: list[str]) -> int:
    """A minimal keep-alive HTTP/1.1 client: the generator must cost less CPU than the server."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    request = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    done = 0
    try:
        while time.monotonic() < deadline:
            start = time.monotonic()
            writer.write(request)
            first: float | None = None
            head, tail = True, b""
            while not tail.endswith(b"\r\n0\r\n\r\n"):  # chunked encoding's last chunk
                data = await reader.read(65536)
                if not data or (head and not data.startswith(b"HTTP/1.1 200")):
                    errors.append(data[9:12].decode() if data else "closed")
                    return done
                head = False
                if first is None and b"data: " in data:
                    first = time.monotonic()
                tail = (tail + data)[-16:]
            end = time.monotonic()
            lat.append(end - start)
            ttft.append((first or end) - start)
            done += 1
    finally:
        writer.close()
    return done


async def _generate(url: str, concurrency: int, duration: float, max_tokens: int, raw: bool) -> dict[str, float]:
    body = json.dumps({"model": "sim-model", "prompt": "the quick brown fox jumps over the lazy dog",
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    _client_fn = _raw_client if raw else _client
    lat: list[float] = []
    ttft: list[float] = []
    errors: list[str] = []
    warmup = time.monotonic() + 1.0
    await asyncio.gather(*(_client_fn(url, body, warmup, [], [], []) for _ in range(concurrency)))
    start = time.monotonic()
    counts = await asyncio.gather(*(_client_fn(url, body, start + duration, lat, ttft, errors)
                                    for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    lat.sort()
    return {
        "requests": sum(counts),
        "req_per_s": sum(counts) / elapsed,
        "tok_per_s": sum(counts) * max_tokens / elapsed,
        "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else 0.0,
        "errors": len(errors),
        "generator_cpu": (resource.getrusage(resource.RUSAGE_SELF).ru_utime
                          + resource.getrusage(resource.RUSAGE_SELF).ru_stime) / (elapsed + 1.0),
    }


def generator_main(args: argparse.Namespace) -> None:
    """The load generator process: print one JSON line of results."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_generate(args.url, args.concurrency[0], args.duration, args.max_tokens,
                                   args.client == "raw"))
    print(json.dumps(result), flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(cpu: int) -> list[str]:
    """A taskset prefix pinning a child to one CPU (nothing when there is only one)."""
    if (os.cpu_count() or 1) < 2:
        return []
    return ["taskset", "-c", str(cpu)]


def run(args: argparse.Namespace) -> None:
    host = "127.0.0.2"
    port = free_port(host)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        sim = group.start("sim", pin(0) + kvflow_argv(
            "sim", "--host", host, "--port", str(port), "--profile", args.profile,
            "--max-num-seqs", "1024", "--max-model-len", "4096"), ready_url=f"http://{host}:{port}/health")
        group.wait_ready(30)
        for c in args.concurrency:
            cmd = pin(1) + [sys.executable, __file__, "--generate", "--url", f"http://{host}:{port}/v1/completions",
                            "--concurrency", str(c), "--duration", str(args.duration), "--max-tokens",
                            str(args.max_tokens), "--client", args.client]
            cpu_before = cpu_seconds(sim.popen.pid)
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 60, check=False)
            cpu = cpu_seconds(sim.popen.pid) - cpu_before
            if out.returncode != 0:
                raise SystemExit(f"load generator failed:\n{out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            # requests per CPU-second of the sim (warm-up included in both): robust to a busy machine
            warm_requests = result["requests"] * (args.duration + 1.0) / args.duration
            result["per_core"] = warm_requests / cpu if cpu else 0.0
            result["sim_cpu"] = cpu / (args.duration + 1.0)
            rows.append((c, result))
        if sim.alive() is False:
            raise SystemExit(f"the simulator died:\n{sim.log_tail()}")
    print(f"\nkvflow sim, profile {args.profile}, {args.max_tokens} streamed tokens per request, "
          f"{args.duration:.0f} s per row, sim pinned to CPU 0, {args.client} load generator on CPU 1")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; 'req/CPU-s' = requests per second of "
          "CPU the sim used, the rate one dedicated core sustains")
    print(f"{'concurrency':>11} {'requests':>9} {'req/s':>8} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'TTFT p50':>9} {'sim CPU':>8} {'gen CPU':>8} {'req/CPU-s':>10} {'errors':>7}")
    for c, r in rows:
        print(f"{c:>11} {r['requests']:>9} {r['req_per_s']:>8.0f} {r['tok_per_s']:>9.0f} {r['p50_ms']:>8.1f} "
              f"{r['p99_ms']:>8.1f} {r['ttft_p50_ms']:>9.1f} {r['sim_cpu']:>8.0%} {r['generator_cpu']:>8.0%} "
              f"{r['per_core']:>10.0f} "
              f"{r['errors']:>7}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--profile", default="fast")
    p.add_argument("--client", choices=("raw", "aiohttp"), default="raw",
                   help="load generator: a minimal keep-alive HTTP/1.1 client (default) or aiohttp's")
    p.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        generator_main(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
