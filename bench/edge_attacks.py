"""A compact attack suite for any HTTP front door, run by ``bench_gateway.py`` against every
target (kvflow on each HTTP layer, the peers): the HTTP-level checks of
``tests/gateway/test_edge.py`` (which pins kvflow's own answers exactly), judged by what any
production server should do. Each check says pass or fail; all run at once (the slowest, the
slowloris check, waits ``SLOW_WAIT`` seconds).

    results = asyncio.run(run_attacks("127.0.0.1", 8080, model="m"))   # {"long-url": True, ...}
"""

from __future__ import annotations

import asyncio
import json
import re

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
    }
    results = await asyncio.gather(*checks.values(), return_exceptions=True)
    return {name: result is True for name, result in zip(checks, results)}
