"""Router cost: a scheduling decision as endpoints and the index grow, KV-event ingestion,
per-request cost, index memory.

**Decision cost** (the headline table). An in-process Router (no I/O) with the default config
and profile, as users get them, N endpoints that all publish KV events, and a precise prefix
index of B blocks (random blocks spread over the endpoints, plus the prompt's own blocks, fed
as ``BlockStored`` events, cached fully on 8 endpoints and half on 8 others). Each sample
schedules an 8k-token prompt. ``decide cold`` is ``Router.decide`` for it, everything the
router does for a prompt it never saw: the prefix fingerprints, the walk of the precise index,
the filters and scorers (there is no memo: a prompt seen before costs the same). The loops over
a prompt's blocks run in C (``kvflow._native``, kvflow's own, built by ``pip install`` where a
compiler is); the table says so, and the same grid follows with numpy alone (the fallback
without a compiler, and what the router ran before). ``fingerprints`` is the tokens-to-fingerprints step alone, ``walk`` the precise
index's lookup alone over computed fingerprints, ``fp + walk`` the two together (what grows
with the index, not with the endpoints). ``vLLM hash`` is the peer: the 512 hashes vLLM's way
(``pickle.dumps`` + SHA-256 per block), what a router that keys on vLLM's hashes pays before it
can look anything up. Times are the thread's CPU time (``time.thread_time``), best / median,
so other processes on a shared machine do not count; a target is read on the median.

**KV-event ingestion**: ``BlockStored`` events of 1 to 512 blocks (each chained on the last
block of the one before, as a pod's prefill chunks are), encoded as vLLM encodes them, through
the router's decoder and ``apply`` (validation, fingerprinting, translation, index); then the
same blocks' ``BlockRemoved``; then, stored again, their eviction as vLLM publishes it: one
``BlockRemoved`` per block, as many per batch. CPU microseconds per block; beside it, the peer: the same
events into an index keyed by vLLM's hashes as the events name them (no tokens read, nothing
to translate: what the router paid before it fingerprinted blocks).

**Per-request cost**: ``Router.decide`` and its ``Flight`` (dispatched, answered, finished) per
built-in profile, with 4 and 64 endpoints (scraped metrics set, ``--window`` requests in
flight, 256-token prompts from 64 shared prefixes).

**Index memory**: bytes per (block, endpoint) entry of the precise index, vLLM's hash of each
block (the translation events need) included, filled as KV events fill it, 1.2 M entries from
one pod and 1 M over 1,000 pods: the index's own arrays (``nbytes``) and the process's RSS
growth (after ``malloc_trim``, so freed heap the allocator kept does not count; untrimmed
beside it), beside a dict of sets (the structure the index replaced) filled the same way, as
the peer.

A PNG under ``bench/out/`` plots decision CPU against endpoints and index size, and bytes
per entry.

    .venv/bin/python bench/bench_router.py [--tokens 8192] [--repeat 100] [--table decision|ingest|request|memory|all]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.hashing import hash_fn, hash_request_tokens, none_hash, to_external
from kvflow.router import EngineMetrics, Flight, Router, SchedulingRequest, load_config
from kvflow.router import block_table, fingerprint, framework
from kvflow.router.plugins import max_score
from kvflow.router.block_table import BlockTable
from kvflow.protocol.kv_events import BlockRemoved, BlockStored, KvEvent, decode_runs
from kvflow.router.kv_events import apply
from kvflow.router.prefix_index import DEFAULT_CAPACITY, PrefixIndex
from kvflow.protocol import kv_events as wire

PROFILES = ("round-robin", "least-load", "prefix-approx", "prefix-precise", "default")
GRID = [(4, 10_000), (64, 10_000), (64, 100_000), (64, 1_000_000), (256, 1_000_000), (1000, 1_000_000)]
TARGETS = {64: 1000.0, 1000: 2000.0}
"""Cold-decision CPU budgets (µs) by endpoint count (issue 10)."""
OUT = Path(__file__).resolve().parent / "out"


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"10.{i // 250}.{i % 250}.1", 8000) for i in range(n)]


def build(n_endpoints: int, blocks: int, tokens: list[int]) -> Router:
    """The default config and profile; every endpoint has published KV events, reported its KV
    capacity (as vLLM's ``cache_config_info`` does) and been sent requests that touched its blocks
    lately, so it is full: the TTFT scorer weighs what a new prefix would evict on every pod."""
    eps = endpoints(n_endpoints)
    router = Router(load_config({}), eps)
    router.event_sources.update(ep.id for ep in eps)
    rng = random.Random(0)
    ids = [ep.id for ep in eps]
    per = max(1, blocks // n_endpoints)
    now = time.monotonic()  # the router's clock
    for eid in ids:
        fingerprints = [rng.getrandbits(64) for _ in range(per)]
        router.precise.add(eid, fingerprints, [rng.getrandbits(64) for _ in range(per)])
        router.datastore.record_scrape(eid, EngineMetrics(num_blocks=per, block_size=16), now)
        counter = router.datastore.counter(eid)
        assert counter is not None
        counter.touched(np.array(fingerprints, dtype=np.uint64), now)
    hashes = tuple(to_external(h) for h in hash_request_tokens(tokens, 16))
    half = len(hashes) // 2
    for i, eid in enumerate(ids[:16]):
        stored = BlockStored(hashes, None, 16, tuple(tokens[: 16 * len(hashes)]))
        if i >= 8:
            stored = BlockStored(hashes[:half], None, 16, tuple(tokens[: 16 * half]))
        assert apply(router.precise, eid, [stored]) == 0
    return router


def plain_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's own way: one ``pickle.dumps`` and one SHA-256 per block."""
    fn, parent, out = hash_fn("sha256"), none_hash("0"), []
    for i in range(len(tokens) // 16):
        parent = fn((parent, tuple(tokens[i * 16 : (i + 1) * 16]), None))
        out.append(parent)
    return out


def micros(samples: list[float], digits: int = 0) -> str:
    """Best and median: on a shared machine the best is the uncontended cost."""
    return f"{min(samples) * 1e6:6.{digits}f} / {statistics.median(samples) * 1e6:6.{digits}f}"


@dataclass
class DecisionRow:
    endpoints: int
    blocks: int
    plain: list[float]
    fingerprints: list[float]
    walk: list[float]
    lookup: list[float]
    cold: list[float]

    def line(self) -> str:
        target = TARGETS.get(self.endpoints)
        verdict = "" if target is None else f"  {'met' if statistics.median(self.cold) * 1e6 <= target else 'MISSED'} (<= {target:.0f})"
        cells = (micros(s) for s in (self.plain, self.fingerprints, self.walk, self.lookup, self.cold))
        return f"{self.endpoints:>9} {self.blocks:>9} " + " ".join(f"{c:>15}" for c in cells) + verdict


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """The router's loops over a prompt's blocks in numpy, and its tie-break draws in Python, as
    where ``kvflow._native`` is not built."""
    saved = fingerprint.native, block_table.native, max_score.tie_break
    fingerprint.native = block_table.native = None  # type: ignore[assignment]
    max_score.tie_break = framework.splitmix64_draw
    try:
        yield
    finally:
        fingerprint.native, block_table.native, max_score.tie_break = saved


def decision(n_endpoints: int, blocks: int, n_tokens: int, repeat: int) -> DecisionRow:
    rng = random.Random(1)
    tokens = [rng.randrange(32000) for _ in range(n_tokens)]
    router = build(n_endpoints, blocks, tokens)
    row = DecisionRow(n_endpoints, len(router.precise), [], [], [], [], [])
    matches = router.precise.match(router.fingerprinter.prompt(tokens))
    full, half = min(8, n_endpoints), max(0, min(16, n_endpoints) - 8)
    assert sorted(matches.values()) == [n_tokens // 32] * half + [n_tokens // 16] * full, "the prompt is where stored"
    for i in range(repeat):
        if i < max(5, repeat // 10):
            t = time.thread_time()
            plain_hashes(tokens)
            row.plain.append(time.thread_time() - t)
        t = time.thread_time()
        _ = router.fingerprinter.prompt(tokens).array
        row.fingerprints.append(time.thread_time() - t)
        fingerprints = router.fingerprinter.prompt(tokens).array
        t = time.thread_time()
        router.precise.match(fingerprints)
        row.walk.append(time.thread_time() - t)
        t = time.thread_time()
        router.precise.match(router.fingerprinter.prompt(tokens))
        row.lookup.append(time.thread_time() - t)
        t = time.thread_time()
        result = router.decide(SchedulingRequest(f"c{i}", "m", tokens)).result
        row.cold.append(time.thread_time() - t)
    assert result.cached_tokens == n_tokens  # the pick holds the whole prompt
    return row


# -- KV-event ingestion ------------------------------------------------------------------------


class KeyedByHash:
    """The peer: an index keyed by vLLM's hashes as events name them (what the router did before
    it fingerprinted blocks itself): no tokens read, no translation."""

    def __init__(self) -> None:
        self.table = BlockTable(refresh=False, default_capacity=DEFAULT_CAPACITY)

    def apply(self, endpoint: EndpointId, events: list[KvEvent]) -> int:
        for event in events:
            if isinstance(event, BlockStored):
                self.table.add(endpoint, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.table.remove(endpoint, event.block_hashes)
        return 0


def ingest(blocks_per_event: int, total: int, peer: bool = False) -> tuple[list[float], list[float], list[float]]:
    """CPU seconds per block to store ``total`` blocks in events of ``blocks_per_event``
    (through the wire format and the subscriber's decoder), then to remove them; then to store
    them again and evict them as vLLM does, one ``BlockRemoved`` per block, ``blocks_per_event``
    of them per batch. One sample per 64 batches. ``peer``: into an index keyed by vLLM's
    hashes instead."""
    rng = random.Random(4)
    index = PrefixIndex(fingerprinter=Router(load_config({}), []).fingerprinter)
    keyed = KeyedByHash()
    pod = EndpointId("10.0.0.1:8000")
    hashes = [rng.getrandbits(64) for _ in range(total)]
    tokens = [rng.randrange(32000) for _ in range(16 * total)]
    stored, removed, evicted = [], [], []
    for start in range(0, total, blocks_per_event):
        end = min(total, start + blocks_per_event)
        event = wire.WireBlockStored(
            block_hashes=hashes[start:end], parent_block_hash=hashes[start - 1] if start else None,
            token_ids=tokens[16 * start : 16 * end], block_size=16, lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[None] * (end - start), group_idx=0, kv_cache_spec_kind="full_attention",
        )
        stored.append((end - start, wire.encode_batch([event], ts=1.0)))
        removed.append((end - start, wire.encode_batch([wire.WireBlockRemoved(hashes[start:end], "GPU", 0)], ts=1.0)))
        evictions = [wire.WireBlockRemoved([h], "GPU", 0) for h in hashes[start:end]]
        evicted.append((end - start, wire.encode_batch(evictions, ts=1.0)))  # type: ignore[arg-type]
    samples: tuple[list[float], list[float], list[float]] = ([], [], [])
    # stored, removed, stored again (not reported), evicted
    for out, payloads in zip((samples[0], samples[1], [], samples[2]), (stored, removed, stored, evicted)):
        for at in range(0, len(payloads), 64):
            chunk = payloads[at : at + 64]
            t = time.thread_time()
            if peer:
                skipped = sum(keyed.apply(pod, decode_runs(payload)[0]) for _, payload in chunk)
            else:
                skipped = sum(apply(index, pod, decode_runs(payload)[0]) for _, payload in chunk)
            out.append((time.thread_time() - t) / sum(n for n, _ in chunk))
            assert skipped == 0
    assert len(index) == len(keyed.table) == 0  # every block removed again, by its vLLM hash
    return samples


def ingest_table() -> None:
    print(
        "\nKV-event ingestion (decode, fingerprint, translate, index), CPU microseconds per block, best / median;"
        " peer: an index keyed by vLLM's hashes"
    )
    header = ("BlockStored", "BlockRemoved", "evicted", "peer stored", "peer removed", "peer evicted")
    print(f"{'blocks/event':>12} " + " ".join(f"{h:>13}" for h in header))
    for per in (1, 4, 64, 512):
        total = 32_768 if per > 1 else 8192
        cells = [*ingest(per, total), *ingest(per, total, peer=True)]
        print(f"{per:>12} " + " ".join(f"{micros(c, 1):>13}" for c in cells), flush=True)


def per_request(profile: str, n_endpoints: int, *, requests: int, window: int, batches: int) -> list[float]:
    """CPU microseconds per request (decide, dispatch, first token, finish), one sample per batch."""
    eps = endpoints(n_endpoints)
    router = Router(load_config({"kvEvents": {"enabled": False}}), eps, profile=profile)
    rng = random.Random(2)
    for ep in eps:
        router.datastore.record_scrape(
            ep.id, EngineMetrics(running=rng.randrange(8), waiting=rng.randrange(4), kv_usage=rng.random() / 2), 0.0
        )
    prompts = [[rng.randrange(32000) for _ in range(256)] for _ in range(64)]
    samples = []
    n = 0
    for _ in range(batches):
        live: list[Flight] = []
        t = time.thread_time()
        for _ in range(requests):
            flight = router.decide(SchedulingRequest(f"req-{n}", "m", prompts[n % len(prompts)]))
            n += 1
            flight.dispatch()
            live.append(flight)
            if len(live) > window:
                answered(live.pop(0))
        for flight in live:
            answered(flight)
        samples.append((time.thread_time() - t) / requests)
    return samples


def answered(flight: Flight) -> None:
    flight.prefill_done(ok=True)
    flight.first_token(observe=False)
    flight.finish()


def request_table(requests: int, window: int, batches: int) -> None:
    print(
        f"\nper-request router cost (decide, dispatch, first token, finish), {window} in flight,"
        " 256-token prompts; CPU microseconds per request, best / median"
    )
    print(f"{'profile':<15} {'4 endpoints':>15} {'64 endpoints':>15}")
    for profile in PROFILES:
        cells = [micros(per_request(profile, n, requests=requests, window=window, batches=batches)) for n in (4, 64)]
        print(f"{profile:<15} {cells[0]:>15} {cells[1]:>15}", flush=True)


# -- index memory ------------------------------------------------------------------------------


def rss_bytes(*, trim: bool = False) -> int:
    """Resident bytes; ``trim``: first hand freed heap memory back to the OS (glibc's
    ``malloc_trim``), so growth counts what is live, not what the allocator keeps around."""
    gc.collect()
    if trim:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class DictOfSets:
    """The structure the precise index replaced: hash -> holders, endpoint -> hashes."""

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}
        self.blocks: dict[str, set[int]] = {}

    def add(self, endpoint: str, hashes: list[int], _: object = None) -> None:
        mine = self.blocks.setdefault(endpoint, set())
        for h in hashes:
            mine.add(h)
            self.holders.setdefault(h, set()).add(endpoint)


@dataclass
class MemoryRow:
    layout: str
    entries: int
    structure: str
    nbytes: int | None
    rss: int
    rss_untrimmed: int
    fill_seconds: float

    def line(self) -> str:
        own = "-" if self.nbytes is None else f"{self.nbytes / self.entries:.1f}"
        return (
            f"{self.layout:<22} {self.structure:<14} {self.entries:>9} {own:>12} {self.rss / self.entries:>10.1f}"
            f" {self.rss_untrimmed / self.entries:>10.1f} {self.fill_seconds * 1e6 / self.entries:>10.2f}"
        )


def memory(pods: int, entries: int, structure: str) -> MemoryRow:
    """Fill an index as KV events do (batches of up to 64 blocks per pod) and weigh it."""
    rng = random.Random(3)
    per = entries // pods
    before = rss_bytes(trim=True)
    index: PrefixIndex | DictOfSets = PrefixIndex() if structure == "kvflow" else DictOfSets()
    seconds = 0.0
    for p in range(pods):
        for start in range(0, per, 64):
            n = min(64, per - start)
            keys, hashes = [rng.getrandbits(64) for _ in range(n)], [rng.getrandbits(64) for _ in range(n)]
            t = time.process_time()
            index.add(EndpointId(f"10.0.{p // 250}.{p % 250}:8000"), keys, hashes)
            seconds += time.process_time() - t
    untrimmed = rss_bytes() - before
    grown = rss_bytes(trim=True) - before
    own = index.nbytes() if isinstance(index, PrefixIndex) else None
    layout = f"{pods} pod{'s' if pods > 1 else ''} x {per:,}"
    del index
    gc.collect()
    return MemoryRow(layout, pods * per, structure, own, grown, untrimmed, seconds)


def memory_table(scale: float) -> list[MemoryRow]:
    print(
        "\nprecise index memory, bytes per (block, endpoint) entry, vLLM's hash of each block (the events'"
        " translation) included (RSS: growth of a fresh process, after malloc_trim / as left by the allocator);"
        " fill: CPU us per entry stored in the index (the events' decoding and fingerprints: the ingestion table)"
    )
    header = f"{'own arrays':>12} {'RSS':>10} {'untrimmed':>10} {'fill us':>10}"
    print(f"{'entries':<22} {'structure':<14} {'count':>9} {header}")
    rows = []
    for pods, entries in ((1, 1_200_000), (1000, 1_000_000)):
        for structure in ("kvflow", "dict of sets"):
            # A fresh process each: RSS growth then counts this index alone.
            cmd = [sys.executable, __file__, "--memory-one", f"{pods}:{int(entries * scale)}:{structure}"]
            row = MemoryRow(**json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            rows.append(row)
            print(row.line(), flush=True)
    return rows


# -- the plot --------------------------------------------------------------------------------


def plot(rows: list[DecisionRow], memory_rows: list[MemoryRow], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(no plot: matplotlib is not installed; pip install -e '.[bench]' for {path})")
        return
    fig, axes = plt.subplots(1, 2 if memory_rows else 1, figsize=(12 if memory_rows else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r.endpoints} ep\n{r.blocks / 1e6:.2g}M blk" for r in rows]
    x = range(len(rows))
    curves = (("decide cold", "cold"), ("fp + walk", "lookup"), ("fingerprints", "fingerprints"),
              ("vLLM hash (peer)", "plain"), ("walk", "walk"))
    for name, key in curves:
        ax.plot(x, [min(getattr(r, key)) * 1e6 for r in rows], marker="o", label=name)
    for n, budget in TARGETS.items():
        if any(r.endpoints == n for r in rows):
            ax.axhline(budget, linestyle=":", color="grey")
            ax.annotate(f"target, {n} endpoints", (0, budget), fontsize=8, color="grey")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("CPU µs per decision (best)")
    ax.set_title("8k-token prompt, default profile")
    ax.legend(fontsize=8)
    if memory_rows:
        ax = axes[0][1]
        names = [f"{m.layout}\n{m.structure}" for m in memory_rows]
        ax.bar(range(len(memory_rows)), [m.rss / m.entries for m in memory_rows], color="tab:blue", label="RSS")
        ax.axhline(64, linestyle=":", color="grey")
        ax.set_xticks(range(len(memory_rows)), names, fontsize=7)
        ax.set_ylabel("bytes per (block, endpoint) entry")
        ax.set_title("precise index memory (target <= 64)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=60)
    p.add_argument("--grid", default=None, help="e.g. 64:100000,1000:1000000")
    p.add_argument("--table", choices=("decision", "ingest", "request", "memory", "all"), default="all")
    p.add_argument("--requests", type=int, default=2000, help="requests per batch (request table)")
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--window", type=int, default=32, help="requests kept in flight (request table)")
    p.add_argument("--memory-scale", type=float, default=1.0, help="shrink the memory table's entry counts")
    p.add_argument("--memory-one", help=argparse.SUPPRESS)  # PODS:ENTRIES:STRUCTURE, in a child process
    args = p.parse_args(argv)
    if args.memory_one:
        pods, entries, structure = args.memory_one.split(":")
        print(json.dumps(dataclasses.asdict(memory(int(pods), int(entries), structure))))
        return 0
    rows: list[DecisionRow] = []
    if args.table in ("decision", "all"):
        grid = GRID if not args.grid else [tuple(map(int, x.split(":"))) for x in args.grid.split(",")]
        print(
            f"decision cost, {args.tokens}-token prompt ({args.tokens // 16} blocks), default config and profile;"
            " CPU microseconds, best / median"
        )
        header = ("vLLM hash", "fingerprints", "walk", "fp + walk", "decide cold")
        print(f"{'endpoints':>9} {'blocks':>9} " + " ".join(f"{h:>15}" for h in header))
        loops = "C (kvflow._native)" if fingerprint.native is not None else "numpy (kvflow._native is not built)"
        print(f"-- as installed: the loops over a prompt's blocks in {loops}")
        for n_endpoints, blocks in grid:
            rows.append(decision(n_endpoints, blocks, args.tokens, args.repeat))
            print(rows[-1].line(), flush=True)
        ratio = statistics.median(min(r.fingerprints) / min(r.plain) for r in rows)
        print(f"fingerprinting a prompt takes {ratio:.2f}x the CPU of hashing it vLLM's way (pickle.dumps + SHA-256)")
        if fingerprint.native is not None:
            print("-- numpy alone (no kvflow._native: the fallback without a C compiler)")
            with numpy_only():
                for n_endpoints, blocks in grid:
                    print(decision(n_endpoints, blocks, args.tokens, args.repeat).line(), flush=True)
    if args.table in ("ingest", "all"):
        ingest_table()
    memory_rows = memory_table(args.memory_scale) if args.table in ("memory", "all") else []
    if args.table in ("request", "all"):
        request_table(args.requests, args.window, args.batches)
    if rows:
        plot(rows, memory_rows, OUT / "router_decision.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
