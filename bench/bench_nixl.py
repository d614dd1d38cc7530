"""NIXL READ latency and bandwidth between two processes, by block size and block count.

A *target* process owns one NIXL agent per model shape (as a prefill pod does) and a loopback
TCP server over the same buffers; this process owns the matching *initiator* agents (a decode
pod) and READs n blocks — ``2 × layers × n`` descriptors, without a notification (the decode
pod notifies separately, as vLLM 0.32 does). Each row is compared with a same-process numpy copy
of the same blocks (``np.copyto`` between two pools allocated as the agents' are: huge-page
advised, pre-faulted) and with a loopback TCP copy of the same bytes. Every kind is warmed up,
then sampled in turn, so a noisy neighbour slows all alike; ``--stat min`` keeps the best sample.

    python bench/bench_nixl.py [--repeat 15] [--shapes tiny,llama-3.2-1b,llama-3.1-8b]
    python bench/bench_nixl.py --idle      # CPU of idle `kvflow sim --kv-transfer nixl` pods

``nixl ms``/``nixl GB/s`` are seen from the event loop (what a pull's READ waits); ``in-thread``
is the READ alone, from posting to completion on the NIXL thread; ``+verify`` is the READ with
the decode pod's content check of every block (run on the NIXL thread), seen from the loop.
``memcpy`` copies the same blocks between pools backed like the agents' (2 MiB pages);
``memcpy 4K`` copies the same bytes between two contiguous malloc'ed arrays (4 KiB pages).
Prints a table and the load average; no assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from kvflow.procs import ProcessGroup, kvflow_argv
from kvflow.sim.nixl_agent import NixlAgent, ProgressConfig, map_buffer
from kvflow.sim.nixl_layout import (
    MODEL_SHAPES,
    KVLayout,
    as_regions,
    block_digests,
    mismatched_blocks,
    write_blocks,
)

POOL_BYTES = 64 << 20
COUNTS = (1, 8, 32, 128, 2048)
MIB = 1 << 20
WARMUP = 3
TOKENS_PER_BLOCK = 16


def layout_for(shape: str) -> KVLayout:
    probe = KVLayout.for_model(shape, 1)
    return KVLayout.for_model(shape, POOL_BYTES // probe.bytes_per_block)


# -- the target process ---------------------------------------------------------------------

def _serve_tcp(listener: socket.socket, buffers: list[np.ndarray]) -> None:
    """Answer ``(buffer index, nbytes)`` with that many bytes from the buffer's start."""
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while header := conn.recv(12, socket.MSG_WAITALL):
                index, nbytes = struct.unpack("!iq", header)
                conn.sendall(memoryview(buffers[index])[:nbytes])


def target_main(shapes: list[str], pipe: Connection) -> None:
    async def run() -> None:
        agents = [NixlAgent(f"bench-target-{s}", layout_for(s)) for s in shapes]
        for agent in agents:
            await agent.start()
            agent.busy_holds = 1  # a prefill pod with blocks to hand out progresses promptly
            ids = list(range(agent.layout.num_blocks))
            write_blocks(agent.regions, ids, pool_digests(len(ids)))
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_serve_tcp, args=(listener, [a.buffer for a in agents]), daemon=True).start()
        pipe.send(([(a.metadata, a.region_bases) for a in agents], listener.getsockname()[1]))
        await asyncio.to_thread(pipe.recv)  # wait for "stop"
        for agent in agents:
            await agent.stop()

    asyncio.run(run())


def pool_digests(num_blocks: int) -> list[bytes]:
    """The target's block content: block i holds the stamp of tokens 0 .. 16(i+1) - 1."""
    return block_digests(range(num_blocks * TOKENS_PER_BLOCK), TOKENS_PER_BLOCK, num_blocks)


# -- measurements ---------------------------------------------------------------------------

def tcp_copy(sock: socket.socket, index: int, into: np.ndarray, nbytes: int) -> None:
    sock.sendall(struct.pack("!iq", index, nbytes))
    view, got = into.data.cast("B"), 0
    while got < nbytes:
        got += sock.recv_into(view[got:nbytes])


def pool_like(layout: KVLayout) -> np.ndarray:
    """A ``[region, block, ...]`` view of a buffer allocated the way an agent allocates its own."""
    return as_regions(np.frombuffer(map_buffer(layout.total_bytes, prefault=True), dtype=np.uint8), layout)


async def measure(agent: NixlAgent, remote: str, ids: list[int], sock: socket.socket, index: int,
                  repeat: int, stat: Callable[[list[float]], float], warm: bool) -> tuple[object, ...]:
    """NIXL READs (alone, and verified), numpy copies and TCP copies of the same blocks, in turn.

    ``warm``: each timed sample follows an untimed run of the same kind, so its bytes are in cache
    (back-to-back transfers); otherwise the other kinds ran in between and evicted them.
    """
    layout = agent.layout
    nbytes = len(ids) * layout.bytes_per_block
    src, dst = pool_like(layout), pool_like(layout)
    src[:] = 1
    flat_src, flat_dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)  # malloc'ed: 4 KiB pages
    n = len(ids)  # ids are 0 .. n-1: the copy takes the same n blocks of every region, as the READ does
    digests = pool_digests(n)

    e2e: list[float] = []

    async def read() -> float:
        start = time.perf_counter()
        result = await agent.read(remote, ids, ids)
        e2e.append(time.perf_counter() - start)
        return result.seconds

    async def read_verified() -> float:
        start = time.perf_counter()
        result = await agent.read(remote, ids, ids, verify=lambda: mismatched_blocks(agent.regions, ids, digests))
        assert result.mismatched == (), result.mismatched
        return time.perf_counter() - start

    async def copy() -> float:
        start = time.perf_counter()
        np.copyto(dst[:, :n], src[:, :n])
        return time.perf_counter() - start

    async def copy_4k() -> float:
        start = time.perf_counter()
        np.copyto(flat_dst, flat_src)
        return time.perf_counter() - start

    async def tcp() -> float:
        start = time.perf_counter()
        tcp_copy(sock, index, dst.reshape(-1).view(np.uint8), nbytes)
        return time.perf_counter() - start

    kinds = (read, read_verified, copy, copy_4k, tcp)
    for _ in range(WARMUP):  # page faults, first-use costs
        for kind in kinds:
            await kind()
    samples: list[list[float]] = [[] for _ in kinds]
    e2e.clear()
    for _ in range(repeat):
        for kind, times in zip(kinds, samples, strict=True):
            if warm:
                await kind()
            times.append(await kind())
    if warm:
        del e2e[::2]  # the untimed runs
    inner, verified, copies, copies_4k, tcps = samples
    t_e2e, t_inner, t_verified, t_copy, t_4k, t_tcp = (stat(x) for x in (e2e, inner, verified, copies, copies_4k, tcps))
    return (agent.name.removeprefix("bench-init-"), layout.bytes_per_block // 1024, n,
            n * layout.num_regions, nbytes / MIB, t_e2e * 1e3, nbytes / t_e2e / 1e9,
            nbytes / t_inner / 1e9, nbytes / t_verified / 1e9, nbytes / t_copy / 1e9, nbytes / t_4k / 1e9,
            nbytes / t_tcp / 1e9, t_copy / t_e2e, t_copy / t_inner, t_4k / t_e2e)


async def bench(shapes: list[str], repeat: int, stat: Callable[[list[float]], float],
                warm: bool) -> list[tuple[object, ...]]:
    parent, child = mp.Pipe()
    target = mp.get_context("spawn").Process(target=target_main, args=(shapes, child), daemon=True)
    target.start()
    rows: list[tuple[object, ...]] = []
    try:
        peers, tcp_port = await asyncio.to_thread(parent.recv)
        sock = socket.create_connection(("127.0.0.1", tcp_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index, (shape, (metadata, bases)) in enumerate(zip(shapes, peers, strict=True)):
            layout = layout_for(shape)
            agent = NixlAgent(f"bench-init-{shape}", layout, ProgressConfig())
            await agent.start()
            remote = await agent.add_remote(metadata, bases, layout.num_blocks)
            for count in COUNTS:
                if count > layout.num_blocks:
                    continue
                ids = list(range(count))
                rows.append(await measure(agent, remote, ids, sock, index, repeat, stat, warm))
            await agent.stop()
        sock.close()
    finally:
        parent.send("stop")
        target.join(10)
        if target.is_alive():
            target.kill()
    return rows


# -- idle CPU ------------------------------------------------------------------------------------
# Idle pods: a prefill and two decode `kvflow sim --kv-transfer nixl` pods after two P/D requests
# (UCX connections up) and the post-handshake busy window; for contrast a modelled pod and a bare
# nixl_agent with NIXL's default progress thread. CPU = utime + stime from /proc/<pid>/stat.

HANDSHAKE_BUSY_S = 10.0
DEFAULT_AGENT = ("import time, numpy as np; from nixl._api import nixl_agent; a = nixl_agent('default');"
                 "b = np.zeros(1 << 20, np.uint8); a.register_memory([(b.ctypes.data, b.nbytes, 0, '')], 'DRAM');"
                 "time.sleep(3600)")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def pd_request(prefill: str, decode: str, prompt: str) -> None:
    first = post(prefill + "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})
    post(decode + "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 2,
                                      "kv_transfer_params": first["kv_transfer_params"]})


def measure_idle(seconds: float) -> None:
    pods = [("prefill", "127.0.0.2", 18401, "nixl"), ("decode", "127.0.0.3", 18402, "nixl"),
            ("decode", "127.0.0.4", 18403, "nixl"), ("both", "127.0.0.5", 18404, "modelled")]
    with tempfile.TemporaryDirectory() as logs, ProcessGroup(Path(logs)) as group:
        children = {}
        for i, (role, host, port, kind) in enumerate(pods):
            argv = kvflow_argv("sim", "--host", host, "--port", str(port), "--role", role, "--profile", "instant",
                               "--kv-transfer", kind, "--nixl-side-channel-port", str(21400 + i))
            children[f"sim {role} ({kind}) {host}"] = group.start(f"pod{i}", argv, ready_url=f"http://{host}:{port}/health")
        children["bare nixl_agent, default config"] = group.start("agent", [sys.executable, "-c", DEFAULT_AGENT])
        group.wait_ready(60)
        for i, decode in enumerate(("http://127.0.0.3:18402", "http://127.0.0.4:18403")):
            pd_request("http://127.0.0.2:18401", decode, f"warm up the connection number {i} " * 4)
        time.sleep(HANDSHAKE_BUSY_S + 1)
        before = {name: cpu_seconds(c.popen.pid) for name, c in children.items()}
        time.sleep(seconds)
        after = {name: cpu_seconds(c.popen.pid) for name, c in children.items()}
    print(f"{'process':<42} | {'CPU, % of a core':>17}   (idle, over {seconds:g} s)")
    print("-" * 66)
    for name in children:
        print(f"{name:<42} | {100 * (after[name] - before[name]) / seconds:>17.1f}")



def print_table(rows: list[tuple[object, ...]]) -> None:
    head = ("shape", "KiB/blk", "blocks", "descs", "MiB", "nixl ms", "nixl GB/s", "in-thread", "+verify",
            "memcpy GB/s", "memcpy 4K", "tcp GB/s", "nixl/memcpy", "in-thr/memcpy", "nixl/4K")
    print("| " + " | ".join(head) + " |")  # markdown, as docs/pd.md shows it
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [str(c) if isinstance(c, (str, int)) else f"{c:.3f}" for c in row]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--shapes", default="tiny,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--warm", action="store_true",
                        help="time each sample right after an untimed one of its kind (bytes in cache)")
    parser.add_argument("--idle", action="store_true", help="measure idle pods' CPU instead")
    parser.add_argument("--seconds", type=float, default=10.0, help="idle measurement window")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per-row statistic; min resists noisy neighbours on a shared machine")
    args = parser.parse_args(argv)
    logging.getLogger("kvflow.sim.nixl_agent").setLevel(logging.ERROR)  # slow-call notes would garble the table
    if args.idle:
        measure_idle(args.seconds)
        return 0
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in MODEL_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; have {sorted(MODEL_SHAPES)}")
    load_before = os.getloadavg()
    rows = asyncio.run(bench(shapes, args.repeat, min if args.stat == "min" else statistics.median, args.warm))
    print_table(rows)
    print(f"{args.stat} of {args.repeat}, {'warm' if args.warm else 'cold'} caches; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
