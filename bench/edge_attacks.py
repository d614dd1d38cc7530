"""A compact attack suite for any HTTP front door, run by ``bench_gateway.py`` against every
target (kvflow on each HTTP layer, the peers): the HTTP-level checks of
``tests/gateway/test_edge.py`` (which pins kvflow's own answers exactly), judged by what any
production server should do. Each check says pass or fail; all run at once (the slowest, the
slowloris check, waits ``SLOW_WAIT`` seconds).

    results = asyncio.run(run_attacks("127.0.0.1", 8080, model="m"))   # {"long-url": True, ...}

Run as a script, it measures what the attacks of issue 49 cost a real ``kvflow gateway`` in
front of a real ``kvflow sim`` pod (child processes on 127.0.0.x), and prints one table:

    python bench/edge_attacks.py                      # this checkout
    python bench/edge_attacks.py --pythonpath VIEW    # another (a ``kvflow.local.pkgview`` of it)

* **body crowd**: ``--bodies`` connections (300) without an API key each send an 8 MiB body,
  twice; the gateway's RSS before, at its peak, and after each wave, and the answers' statuses;
* **large answer**: a non-streamed completion of 6,000 tokens with 20 logprobs (3.66 MB);
* **escaped P/D key**: ``"kv_transfer_p\\u0061rams"`` in a body (a 400 where refused);
* **gray failures**: 30 requests, one after another, through a gateway (``--first-byte-timeout
  5``, round-robin) over two healthy pods and one that hangs, or one that serves another model:
  their statuses and how many waited out a timeout;
* **clients that leave before the first token**: 9 streams on a slow pod, their clients gone;
  how many the pod still generates for 5 s later;
* **ext_proc body crowd**: 60 Envoy-like gRPC streams to ``kvflow router`` each sending 8 MiB of
  body without its end: the router's RSS while they hold, and how many were refused.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

SLOW_WAIT = 15.0
"""How long a server may keep a connection whose headers never finish (kvflow: 10 s, nginx 60)."""


def _post(body: bytes, headers: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + headers +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _exchange(host: str, port: int, data: bytes, wait: float = 5.0) -> tuple[bytes, bool]:
    """What the server answered, and whether it closed the connection within ``wait``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return b"", True
    received, closed = b"", False
    try:
        writer.write(data)
        await writer.drain()
        while True:
            chunk = await asyncio.wait_for(reader.read(1 << 20), wait)
            if not chunk:
                closed = True
                break
            received += chunk
    except (TimeoutError, ConnectionError):
        closed = closed or not received
    finally:
        writer.close()
    return received, closed


def _statuses(raw: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3})", raw)]


async def run_attacks(host: str, port: int, model: str) -> dict[str, bool]:
    ok = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()

    async def status_is_4xx(data: bytes) -> bool:
        raw, _ = await _exchange(host, port, data)
        got = _statuses(raw)
        return bool(got) and 400 <= got[0] < 500

    async def slowloris() -> bool:
        _, closed = await _exchange(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n", wait=SLOW_WAIT)
        return closed

    async def pipelined() -> bool:
        raw, _ = await _exchange(host, port, _post(ok) * 2 + _post(ok, b"Connection: close\r\n"), wait=10)
        return _statuses(raw) == [200, 200, 200]

    async def smuggling() -> bool:
        raw, _ = await _exchange(host, port, _post(ok, b"Transfer-Encoding: chunked\r\n") + _post(ok))
        got = _statuses(raw)
        return bool(got) and got[0] == 400 and len(got) == 1

    checks = {
        "long-url": status_is_4xx(_post(ok, path=b"/v1/completions?" + b"a" * 9000)),
        "1-MiB-header": status_is_4xx(_post(ok, b"X-Big: " + b"a" * (1 << 20) + b"\r\n")),
        "10k-headers": status_is_4xx(_post(ok, b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)))),
        "slowloris": slowloris(),
        "pipelining": pipelined(),
        "CL+TE": smuggling(),
        "deep-JSON": status_is_4xx(_post(b'{"model":"%s","prompt":' % model.encode() + b"[" * 100_000 + b"]" * 100_000
                                         + b"}")),
        "bad-UTF-8": status_is_4xx(_post(b'{"model": "%s", "prompt": "\xff\xfe"}' % model.encode())),
        "declared-2-GiB-body": status_is_4xx(_post(b"")[:-len(b"Content-Length: 0\r\n\r\n")]
                                             + b"Content-Length: 2147483648\r\n\r\n"),  # answered unsent
    }
    results = await asyncio.gather(*checks.values(), return_exceptions=True)
    return {name: result is True for name, result in zip(checks, results)}


# -- the script: what the attacks cost a real gateway ----------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _send_body(host: str, port: int, body: memoryview, headers: bytes = b"") -> int:
    """One request with ``body``, written in 64 KiB pieces (the client holds no copy); its status."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return 0
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + headers +
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for at in range(0, len(body), 1 << 16):
            writer.write(body[at:at + (1 << 16)])
            await writer.drain()
        got = _statuses(await asyncio.wait_for(reader.read(4096), 120))
        return got[0] if got else 0
    except (OSError, TimeoutError):  # reset or closed before an answer came
        return 0
    finally:
        writer.close()


async def _crowd(host: str, port: int, pid: int, n: int, size: int) -> tuple[float, float, collections.Counter[int]]:
    """``n`` bodies of ``size`` bytes at once: the peak RSS while they ran, the RSS 2 s after, statuses."""
    body = memoryview(b'{"model":"tiny","prompt":"' + b"x" * (size - 30) + b'"}')
    peak = 0.0
    tasks = [asyncio.ensure_future(_send_body(host, port, body)) for _ in range(n)]
    while not all(t.done() for t in tasks):
        peak = max(peak, _rss_mb(pid))
        await asyncio.sleep(0.05)
    statuses = collections.Counter(t.result() for t in tasks)
    await asyncio.sleep(2.0)
    return peak, _rss_mb(pid), statuses


async def _completion(host: str, port: int, body: dict[str, object], key: str, timeout: float) -> tuple[int, int, float]:
    """(status, answer bytes, seconds) of one non-streamed request."""
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_post(raw, b"Authorization: Bearer %s\r\nConnection: close\r\n" % key.encode()))
    try:
        answer = await asyncio.wait_for(reader.read(-1), timeout)
    except TimeoutError:
        answer = b""
    writer.close()
    got = _statuses(answer)
    head, _, payload = answer.partition(b"\r\n\r\n")
    return (got[0] if got else 0), len(payload), time.perf_counter() - start


async def _measure(args: argparse.Namespace, gw_port: int, gw_pid: int, key: str) -> list[tuple[str, str]]:
    host = "127.0.0.1"
    rows = [("gateway RSS at start", f"{_rss_mb(gw_pid):.0f} MB")]
    for wave in (1, 2):
        peak, after, statuses = await _crowd(host, gw_port, gw_pid, args.bodies, args.body_mib << 20)
        rows.append((f"body crowd, wave {wave}: {args.bodies} x {args.body_mib} MiB without a key",
                     f"peak {peak:.0f} MB, after {after:.0f} MB; " +
                     ", ".join(f"{s or 'reset'}: {c}" for s, c in sorted(statuses.items()))))
    status, size, seconds = await _completion(
        host, gw_port, {"model": "tiny", "prompt": "hi", "max_tokens": 6000, "logprobs": 20}, key, args.answer_timeout)
    rows.append(("non-streamed 6,000 tokens with 20 logprobs", f"{status} in {seconds:.2f} s ({size / 1e6:.2f} MB)"))
    status, _, seconds = await _completion(
        host, gw_port, {"model": "tiny", "prompt": "hi", "max_tokens": 1, "kv_transfer_p\u0061rams": {"x": 1}},
        key, 30)
    rows.append(('"kv_transfer_p\\u0061rams" in a body', f"{status}"))
    for name, port in (("a pod that hangs", args.ports["hang"]), ("a pod serving another model", args.ports["model"])):
        statuses, slow, seconds = await _gray(port, 30)
        rows.append((f"30 requests, 2 healthy pods and {name}",
                     ", ".join(f"{s or 'timeout'}: {c}" for s, c in sorted(statuses.items())) +
                     f"; {slow} waited a 5 s timeout; {seconds:.1f} s in all"))
    with_them, after = await _leavers(args.ports["slow"], args.slow_pod, 9)
    rows.append(("9 streams whose clients left before the first token",
                 f"the pod ran {with_them}; 5 s after they left: {after}"))
    before, peak, refused = await _extproc_crowd(args.ports["extproc"], args.extproc_pid, 60, 8 << 20)
    rows.append(("ext_proc: 60 streams x 8 MiB of body, never ended",
                 f"router RSS {before:.0f} MB -> peak {peak:.0f} MB; {refused} refused"))
    return rows


_FROM_VIEW = ("import os, runpy, sys; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]; "
              "sys.meta_path[:] = [f for f in sys.meta_path if not "
              "getattr(f, '__module__', type(f).__module__).startswith('__editable__')]; "
              "sys.argv[0] = 'kvflow'; runpy.run_module('kvflow', run_name='__main__')")
"""``python -m kvflow`` from ``PYTHONPATH`` rather than this checkout's editable install."""


async def _running(url: str) -> int:
    """The pod's ``vllm:num_requests_running``."""
    reader, writer = await asyncio.open_connection(*url.split(":"))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
    text = (await reader.read(-1)).decode(errors="replace")
    writer.close()
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M)
    return int(float(found.group(1))) if found else -1


async def _gray(port: int, n: int) -> tuple[collections.Counter[int], int, float]:
    """``n`` requests in a row: their statuses, how many took over 4 s (a timeout), the seconds in all."""
    statuses: collections.Counter[int] = collections.Counter()
    slow, start = 0, time.perf_counter()
    for _ in range(n):
        status, _, seconds = await _completion("127.0.0.1", port, {"model": "tiny", "prompt": "hi", "max_tokens": 4},
                                               "-", 60)
        statuses[status] += 1
        slow += seconds > 4
    return statuses, slow, time.perf_counter() - start


async def _leavers(port: int, pod: str, n: int) -> tuple[int, int]:
    """``n`` streams whose clients leave before the first token: the pod's running count with them
    there, and 5 s after they left."""
    raw = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}).encode()
    writers = []
    for _ in range(n):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(raw))
        writers.append(writer)
    deadline = time.monotonic() + 30
    while (before := await _running(pod)) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for writer in writers:
        writer.close()
    await asyncio.sleep(5.0)
    return before, await _running(pod)


async def _extproc_crowd(port: int, pid: int, n: int, size: int) -> tuple[float, float, int]:
    """``n`` ext_proc streams that each send ``size`` body bytes and never end: the router's RSS
    before, at its peak while they hold, and how many it refused."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    hmap = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
                                       ((":path", b"/v1/completions"), (":method", b"POST"))])
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap))
    first.protocol_config.request_body_mode = first.protocol_config.response_body_mode = 4  # FULL_DUPLEX
    piece = b"x" * 62_000
    hold = asyncio.Event()

    async def messages() -> Any:
        yield first
        for _ in range(size // len(piece)):
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=piece, end_of_stream=False))
        await hold.wait()

    before = _rss_mb(pid)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        calls = [stub.Process(messages()) for _ in range(n)]
        refused = 0
        answers = [asyncio.ensure_future(call.read()) for call in calls]
        deadline = time.monotonic() + 20
        peak = before
        while time.monotonic() < deadline:
            peak = max(peak, _rss_mb(pid))
            await asyncio.sleep(0.1)
        refused = sum(1 for a in answers if a.done() and not a.cancelled() and a.exception() is None
                      and a.result() is not grpc.aio.EOF and a.result().HasField("immediate_response"))
        hold.set()
        for call in calls:
            call.cancel()
        for a in answers:
            a.cancel()
    return before, peak, refused


def _argv_in(view: str) -> Callable[..., list[str]]:
    def argv(*args: str) -> list[str]:
        return [sys.executable, "-c", _FROM_VIEW, *args]
    return argv


def main(argv: list[str] | None = None) -> int:
    from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--pythonpath", help="run the gateway and pod from this package view instead")
    p.add_argument("--bodies", type=int, default=300)
    p.add_argument("--body-mib", type=int, default=8)
    p.add_argument("--answer-timeout", type=float, default=90.0)
    args = p.parse_args(argv)
    env = {"PYTHONPATH": args.pythonpath} if args.pythonpath else {}
    command = _argv_in(args.pythonpath) if args.pythonpath else kvflow_argv
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp) / "logs") as group:
        key = "bench-key"
        keys = Path(tmp) / "keys.txt"
        keys.write_text(key + "\n")
        sim_port, gw_port = free_port("127.0.0.5"), free_port()
        group.start("sim", command("sim", "--host", "127.0.0.5", "--port", str(sim_port), "--model", "tiny",
                                       "--profile", "instant", "--max-model-len", "8192"),
                    env=env, ready_url=f"http://127.0.0.5:{sim_port}/health")
        gateway = group.start("gateway", command("gateway", "--host", "127.0.0.1", "--port", str(gw_port),
                                                     "--model", "tiny", "--endpoint", f"127.0.0.5:{sim_port}",
                                                     "--api-keys-file", str(keys)),
                              env={**env, "KVFLOW_BATCH_DIR": tmp}, ready_url=f"http://127.0.0.1:{gw_port}/health")
        pods = {name: (f"127.0.0.{i}", free_port(f"127.0.0.{i}"))
                for i, name in enumerate(("good1", "good2", "hang", "model", "slow"), start=6)}
        extra = {"hang": ("--fault-stall-after", "0"), "model": ("--model", "another-model"),
                 "slow": ("--profile", "h100-llama8b", "--fault-slow-factor", "500")}
        for name, (host, port) in pods.items():
            group.start(name, command("sim", "--host", host, "--port", str(port), "--model", "tiny", "--profile",
                                      "instant", *extra.get(name, ())),
                        env=env, ready_url=f"http://{host}:{port}/health")
        args.ports = {}
        for name, members in (("hang", ("good1", "good2", "hang")), ("model", ("good1", "good2", "model")),
                              ("slow", ("slow",))):
            args.ports[name] = port = free_port()
            endpoints = [a for m in members for a in ("--endpoint", "{}:{}".format(*pods[m]))]
            group.start(f"gateway-{name}", command("gateway", "--host", "127.0.0.1", "--port", str(port), "--model",
                                                   "tiny", *endpoints, "--profile", "round-robin",
                                                   "--first-byte-timeout", "5"),
                        env={**env, "KVFLOW_BATCH_DIR": tmp}, ready_url=f"http://127.0.0.1:{port}/health")
        args.slow_pod = "{}:{}".format(*pods["slow"])
        args.ports["extproc"] = free_port()
        router = group.start("router", command("router", "--host", "127.0.0.1", "--port", str(args.ports["extproc"]),
                                               "--endpoint", "{}:{}".format(*pods["good1"]), "--no-kv-events",
                                               "--no-secure-serving"), env=env)
        args.extproc_pid = router.popen.pid
        group.wait_ready(90)
        rows = asyncio.run(_measure(args, gw_port, gateway.popen.pid, key))
    width = max(len(name) for name, _ in rows)
    print(f"| {'case':<{width}} | result |\n|{'-' * (width + 2)}|---|")
    for name, result in rows:
        print(f"| {name:<{width}} | {result} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
