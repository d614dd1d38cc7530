"""NIXL READ latency and bandwidth between two processes, by block size and block count.

A *target* process owns one NIXL agent per model shape (as a prefill pod does) and a loopback
TCP server over the same buffers; this process owns the matching *initiator* agents (a decode
pod) and READs n blocks — ``2 × layers × n`` descriptors, without a notification (the decode
pod notifies separately, as vLLM 0.32 does). Each row is compared with same-process copies of
the same bytes (a plain memcpy, and a copy of the very blocks between pools like the agents'),
with the kernel's cross-process copy of the same blocks, and with a loopback TCP copy. Every
kind is warmed up, then sampled in turn, so a noisy neighbour slows all alike; ``--stat min``
keeps the best sample. Before each sample every cache level is evicted (a pass over a buffer
four times the last-level cache), so every kind starts from the same state; by default the kind
then runs once on a spare block, so its code is warm and the measured blocks are cold
(``--caches``). The loop is uvloop's, as in the pods.

    python bench/bench_nixl.py [--repeat 15] [--shapes tiny,llama-3.2-1b,llama-3.1-8b]
    python bench/bench_nixl.py --idle      # CPU of idle `kvflow sim --kv-transfer nixl` pods

``READ`` is the transfer as NIXL's telemetry times it, from posting to completion (what vLLM
0.32 reports as ``vllm:nixl_xfer_time_seconds``); ``+prep`` adds building the transfer handle
(``make_prepped_xfer``); ``pull`` is the READ as a pull's coroutine waits for it on the event
loop (NIXL thread hand-offs included); ``+verify`` is the pull with the decode pod's content
check of every block (run on the NIXL thread). ``cma`` copies the same blocks straight from the
target with one ``process_vm_readv`` (the kernel copy under UCX's CMA transport, the only
zero-copy path between processes here: the ceiling for any READ on this host). ``memcpy`` is
a plain same-process memcpy of the same number of bytes between two contiguous arrays (4 KiB
pages); ``memcpy blk`` copies the very blocks, region by region, between two pools allocated
as the agents' are (2 MiB pages, pre-faulted) — a stricter baseline: chunks of at most a
region's run stay under glibc's non-temporal-store threshold and huge pages spare TLB misses.
Prints a table and the load average; no assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
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
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvflow.local.procs import ProcessGroup, kvflow_argv
from kvflow.protocol.kv_transfer import remote_decode_request
from kvflow.sim.nixl.agent import NixlAgent, ProgressConfig, map_buffer
from kvflow.sim.nixl.layout import (
    MODEL_SHAPES,
    KVLayout,
    as_regions,
    block_digests,
    mismatched_blocks,
    write_blocks,
)

T = TypeVar("T")
CACHES = {
    "data-cold": "caches evicted, then the same kind run on a spare block: code warm, the measured blocks cold "
                 "(a busy pod pulling blocks it has not touched)",
    "cold": "caches evicted: code and blocks cold (a first pull after a pause)",
    "warm": "the same kind run on the same blocks first: the bytes in cache (back-to-back transfers)",
}
POOL_BYTES = 64 << 20
TCP_HEADER = struct.Struct("!iqq")  # buffer index, offset, byte count
EVICT_BYTES = 128 << 20
"""Written over before every cold sample: four times this machine's 32 MiB last-level cache."""
COUNTS = (1, 8, 32, 128, 2048)
MIB = 1 << 20
WARMUP = 3
TOKENS_PER_BLOCK = 16


def layout_for(shape: str) -> KVLayout:
    """``POOL_BYTES`` of blocks, plus a spare one that primes code paths without touching them."""
    probe = KVLayout.for_model(shape, 1)
    return KVLayout.for_model(shape, POOL_BYTES // probe.bytes_per_block + 1)


# -- the target process ---------------------------------------------------------------------

def _serve_tcp(listener: socket.socket, buffers: list[np.ndarray]) -> None:
    """Answer ``(buffer index, offset, nbytes)`` with those bytes of the buffer."""
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while header := conn.recv(TCP_HEADER.size, socket.MSG_WAITALL):
                index, offset, nbytes = TCP_HEADER.unpack(header)
                conn.sendall(memoryview(buffers[index])[offset:offset + nbytes])


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
        pipe.send(([(a.metadata, a.region_bases) for a in agents], listener.getsockname()[1], os.getpid()))
        await asyncio.to_thread(pipe.recv)  # wait for "stop"
        for agent in agents:
            await agent.stop()

    run_on_uvloop(run())


def pool_digests(num_blocks: int) -> list[bytes]:
    """The target's block content: block i holds the stamp of tokens 0 .. 16(i+1) - 1."""
    return block_digests(range(num_blocks * TOKENS_PER_BLOCK), TOKENS_PER_BLOCK, num_blocks)


# -- measurements ---------------------------------------------------------------------------

def tcp_copy(sock: socket.socket, index: int, into: np.ndarray, offset: int, nbytes: int) -> None:
    """``nbytes`` of the target's buffer ``index`` from ``offset``, into ``into`` at the same offset."""
    sock.sendall(TCP_HEADER.pack(index, offset, nbytes))
    view, got = into.data.cast("B")[offset:offset + nbytes], 0
    while got < nbytes:
        got += sock.recv_into(view[got:])


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_reader(pid: int, into: np.ndarray, bases: list[int], layout: KVLayout, first: int, n: int,
               ) -> Callable[[], None]:
    """Blocks ``first .. first + n - 1`` of every region of process ``pid`` copied by one ``process_vm_readv``.

    The kernel call UCX's CMA transport makes for a READ between processes on one host, without
    NIXL or UCX around it: the ceiling for any READ here (no xpmem or knem on this kernel).
    """
    nbytes, skip = n * layout.block_len, first * layout.block_len
    local = (_IOVec * len(bases))(*[_IOVec(into[r, first].ctypes.data, nbytes) for r in range(len(bases))])
    remote = (_IOVec * len(bases))(*[_IOVec(base + skip, nbytes) for base in bases])
    readv = ctypes.CDLL(None, use_errno=True).process_vm_readv  # ctypes releases the GIL around it
    readv.restype = ctypes.c_ssize_t

    def read() -> None:
        got = readv(pid, local, len(bases), remote, len(bases), 0)
        if got != nbytes * len(bases):
            raise OSError(ctypes.get_errno(), f"process_vm_readv moved {got} of {nbytes * len(bases)} bytes")

    return read


def pool_like(layout: KVLayout) -> np.ndarray:
    """A ``[region, block, ...]`` view of a buffer allocated the way an agent allocates its own."""
    return as_regions(np.frombuffer(map_buffer(layout.total_bytes, prefault=True), dtype=np.uint8), layout)


async def measure(agent: NixlAgent, remote: str, peer: tuple[int, list[int]], ids: list[int], sock: socket.socket,
                  index: int, repeat: int, stat: Callable[[list[float]], float], caches: str) -> tuple[object, ...]:
    """NIXL READs (alone, and verified), numpy copies and TCP copies of the same blocks, in turn.

    ``caches`` (see ``CACHES``) sets what each timed sample finds in the CPU caches.
    """
    layout = agent.layout
    evict = np.zeros(EVICT_BYTES, np.uint8)
    n = len(ids)  # ids are 0 .. n-1: the copies take the same n blocks of every region, as the READ does
    nbytes = n * layout.bytes_per_block
    spare = layout.num_blocks - 1  # never measured: priming with it leaves the measured blocks cold
    runs = {"measured": (0, n), "spare": (spare, 1)}
    src, dst = pool_like(layout), pool_like(layout)
    src[:] = 1
    flat_src, flat_dst = (np.ones(layout.total_bytes, np.uint8), np.empty(layout.total_bytes, np.uint8))  # 4 KiB pages
    digests = pool_digests(layout.num_blocks)
    block_ids = {run: list(range(first, first + k)) for run, (first, k) in runs.items()}
    cma_reads = {run: cma_reader(peer[0], dst, peer[1], layout, first, k) for run, (first, k) in runs.items()}
    pulls: list[float] = []
    prepped: list[float] = []
    last_pull = [0.0, 0.0]  # the latest READ as the loop waited for it, and with its handle's preparation

    async def read(run: str) -> float:
        start = time.perf_counter()
        result = await agent.read(remote, block_ids[run], block_ids[run])
        last_pull[:] = time.perf_counter() - start, result.prep_seconds + result.seconds
        return result.seconds

    async def read_verified(run: str) -> float:
        wanted = [digests[i] for i in block_ids[run]]
        start = time.perf_counter()
        result = await agent.read(remote, block_ids[run], block_ids[run],
                                  verify=lambda: mismatched_blocks(agent.regions, block_ids[run], wanted))
        assert result.mismatched == (), result.mismatched
        return time.perf_counter() - start

    async def cma(run: str) -> float:
        start = time.perf_counter()
        cma_reads[run]()
        return time.perf_counter() - start

    async def copy_blocks(run: str) -> float:
        first, k = runs[run]
        start = time.perf_counter()
        np.copyto(dst[:, first:first + k], src[:, first:first + k])
        return time.perf_counter() - start

    async def memcpy(run: str) -> float:
        first, k = runs[run]
        flat = slice(first * layout.bytes_per_block, (first + k) * layout.bytes_per_block)
        start = time.perf_counter()
        np.copyto(flat_dst[flat], flat_src[flat])
        return time.perf_counter() - start

    async def tcp(run: str) -> float:
        first, k = runs[run]
        start = time.perf_counter()
        tcp_copy(sock, index, dst.reshape(-1).view(np.uint8), first * layout.bytes_per_block, k * layout.bytes_per_block)
        return time.perf_counter() - start

    kinds = (read, read_verified, cma, copy_blocks, memcpy, tcp)
    for _ in range(WARMUP):  # page faults, first-use costs
        for kind in kinds:
            await kind("measured")
            await kind("spare")
    samples: list[list[float]] = [[] for _ in kinds]
    for _ in range(repeat):
        for kind, times in zip(kinds, samples, strict=True):
            if caches == "warm":
                await kind("measured")  # the same bytes, just moved: in cache
            else:
                evict += 1  # reads and dirties every line: every kind meets the same cold caches
                if caches == "data-cold":
                    await kind("spare")  # its code paths run again, warm; the measured blocks stay cold
            times.append(await kind("measured"))
            if kind is read:
                pulls.append(last_pull[0])
                prepped.append(last_pull[1])
    reads, verified, cmas, block_copies, memcpys, tcps = samples
    t_pull, t_read, t_prepped, t_verified, t_cma, t_blocks, t_memcpy, t_tcp = (
        stat(x) for x in (pulls, reads, prepped, verified, cmas, block_copies, memcpys, tcps))
    return (agent.name.removeprefix("bench-init-"), layout.bytes_per_block // 1024, n,
            n * layout.num_regions, nbytes / MIB, t_pull * 1e3, nbytes / t_pull / 1e9, nbytes / t_read / 1e9,
            nbytes / t_prepped / 1e9, nbytes / t_verified / 1e9, nbytes / t_cma / 1e9, nbytes / t_memcpy / 1e9,
            nbytes / t_blocks / 1e9, nbytes / t_tcp / 1e9,
            t_memcpy / t_read, t_memcpy / t_pull, t_blocks / t_read, t_blocks / t_cma)


async def bench(shapes: list[str], repeat: int, stat: Callable[[list[float]], float],
                caches: str) -> list[tuple[object, ...]]:
    parent, child = mp.Pipe()
    target = mp.get_context("spawn").Process(target=target_main, args=(shapes, child), daemon=True)
    target.start()
    rows: list[tuple[object, ...]] = []
    try:
        peers, tcp_port, target_pid = await asyncio.to_thread(parent.recv)
        sock = socket.create_connection(("127.0.0.1", tcp_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index, (shape, (metadata, bases)) in enumerate(zip(shapes, peers, strict=True)):
            layout = layout_for(shape)
            agent = NixlAgent(f"bench-init-{shape}", layout, ProgressConfig())
            await agent.start()
            remote = await agent.add_remote(metadata, bases, layout.num_blocks)
            for count in COUNTS:
                if count >= layout.num_blocks:  # the last block is the spare
                    continue
                ids = list(range(count))
                rows.append(await measure(agent, remote, (target_pid, bases), ids, sock, index, repeat, stat, caches))
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
                                               "kv_transfer_params": remote_decode_request()})
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
    head = ("shape", "KiB/blk", "blocks", "descs", "MiB", "pull ms", "pull GB/s", "READ GB/s", "+prep", "+verify",
            "cma GB/s", "memcpy GB/s", "memcpy blk", "tcp GB/s",
            "READ/memcpy", "pull/memcpy", "READ/memcpy blk", "cma/memcpy blk")
    print("| " + " | ".join(head) + " |")  # markdown, as docs/pd.md shows it
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [str(c) if isinstance(c, (str, int)) else f"{c:.3f}" for c in row]
        print("| " + " | ".join(cells) + " |")


def run_on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop, as ``kvflow sim`` does, so loop wake-ups cost what they cost in a pod."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--shapes", default="tiny,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--caches", choices=tuple(CACHES), default="data-cold", help="; ".join(
        f"{name}: {meaning}" for name, meaning in CACHES.items()))
    parser.add_argument("--warm", dest="caches", action="store_const", const="warm",
                        help="the same as --caches warm")
    parser.add_argument("--idle", action="store_true", help="measure idle pods' CPU instead")
    parser.add_argument("--seconds", type=float, default=10.0, help="idle measurement window")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per-row statistic; min resists noisy neighbours on a shared machine")
    args = parser.parse_args(argv)
    logging.getLogger("kvflow.sim.nixl.agent").setLevel(logging.ERROR)  # slow-call notes would garble the table
    if args.idle:
        measure_idle(args.seconds)
        return 0
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in MODEL_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; have {sorted(MODEL_SHAPES)}")
    load_before = os.getloadavg()
    rows = run_on_uvloop(bench(shapes, args.repeat, min if args.stat == "min" else statistics.median, args.caches))
    print_table(rows)
    print(f"{args.stat} of {args.repeat}, caches {args.caches}; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
