"""Batch fairness between keys, and a batch of bad lines (issue 49).

    kvflow bench batch_fair [--big 30000] [--bad 10001] [--small 10] [--pods 2]

Two simulated pods (``--profile``, default h100-llama8b) behind a gateway in this process with two API keys. For each
case key A's large batch starts first; once it is running, key B submits a small batch, and the
table shows how long B's batch took (upload to completed) and how far A's had got by then; then
A's batch is cancelled and the time until it settles is shown.

* **large batch**: A's ``--big`` lines (16 output tokens each) against B's ``--small`` lines;
* **bad lines**: A's ``--bad`` lines without ``body.model`` (a one-pool gateway runs them, as an
  interactive request without a model would be) against B's 20 lines.

Before the fix (issue 49): B waited 26.5 s behind 30,000 lines, 115 s behind 10,001 bad lines,
and a batch with a line that had no model never settled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from kvflow.gateway.config import GatewayConfig
from kvflow.gateway.server import start_gateway
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv

MODEL = "sim-model"


def lines(prefix: str, n: int, *, model: bool = True) -> bytes:
    body: dict[str, Any] = {"prompt": f"{prefix} prompt", "max_tokens": 16}
    if model:
        body["model"] = MODEL
    return "\n".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body}) for i in range(n)).encode()


async def submit(client: openai.AsyncOpenAI, data: bytes) -> str:
    upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
    return (await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                        completion_window="24h")).id


async def until(client: openai.AsyncOpenAI, batch_id: str, done: Any, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if done(batch) or time.monotonic() > deadline:
            return batch
        await asyncio.sleep(0.05)


async def case(base: str, big: bytes, small: bytes) -> dict[str, Any]:
    a = openai.AsyncOpenAI(base_url=base, api_key="sk-a", max_retries=0)
    b = openai.AsyncOpenAI(base_url=base, api_key="sk-b", max_retries=0)
    large = await submit(a, big)
    await until(a, large, lambda x: x.request_counts is not None and x.request_counts.completed >= 8)
    start = time.monotonic()
    few = await submit(b, small)
    done = await until(b, few, lambda x: x.status in ("completed", "failed", "cancelled", "expired"))
    waited = time.monotonic() - start
    progress = await a.batches.retrieve(large)
    start = time.monotonic()
    await a.batches.cancel(large)
    settled = await until(a, large, lambda x: x.status == "cancelled", timeout=120)
    return {"small": done.status, "small_s": waited, "large_done": progress.request_counts.completed,
            "large_total": progress.request_counts.total, "cancel": settled.status,
            "cancel_s": time.monotonic() - start}


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp) / "logs") as group:
        pods = []
        for i in range(args.pods):
            host = f"127.0.0.{2 + i}"
            port = free_port(host)
            group.start(f"pod-{i}", kvflow_argv("sim", "--host", host, "--port", str(port), "--model", MODEL,
                                                "--profile", args.profile), ready_url=f"http://{host}:{port}/health")
            pods.append(f"{host}:{port}")
        await asyncio.to_thread(group.wait_ready, 60)
        keys = Path(tmp) / "keys.txt"
        keys.write_text("sk-a\nsk-b\n")
        rows = []
        for name, big, small in (("large batch", lines("a", args.big), lines("b", args.small)),
                                 ("bad lines", lines("a", args.bad, model=False), lines("b", 20))):
            cfg = GatewayConfig.model_validate({
                "port": 0, "pools": [{"model": MODEL, "endpoints": pods}], "auth": {"keys_file": str(keys)},
                "max_body_bytes": 64 * 1024 * 1024, "batch": {"dir": str(Path(tmp) / name.replace(" ", "-"))}})
            running = await start_gateway(cfg)
            try:
                rows.append((name, await case(f"http://127.0.0.1:{running.port}/v1", big, small)))
            finally:
                await running.close()
    print("| case | B's batch | B's wait (s) | A's lines done then | A cancelled | settled in (s) |")
    print("|---|---|---:|---:|---|---:|")
    for name, r in rows:
        print(f"| {name} | {r['small']} | {r['small_s']:.1f} | {r['large_done']} / {r['large_total']} |"
              f" {r['cancel']} | {r['cancel_s']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--big", type=int, default=30_000, help="lines of A's large batch")
    p.add_argument("--bad", type=int, default=10_001, help="lines without a model in A's second batch")
    p.add_argument("--small", type=int, default=10, help="lines of B's batch beside the large one")
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--profile", default="h100-llama8b", help="the pods' simulator timing profile")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
