"""Production traces in Mooncake's public JSONL format, replayed as benchmark ``Trace``s (pure, but ``load``).

One JSON object a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is the arrival in milliseconds from the trace's start, ``hash_ids`` name the
prompt's 512-token blocks in order (the last one may be partial: ``len(hash_ids) ==
ceil(input_length / 512)``). Two requests that share a hash id at the same position share that
block's tokens, and the prefix before it, exactly.

A record becomes a prompt of words ``w<n>`` (one token each for the simulator's tokenizer): block
``h`` is always the same ``block_tokens`` words, drawn from ``h``, and a partial last block is the
first words of its block. So prompts that share hash ids share those tokens, and any prefix
cache that works on blocks of ``block_tokens`` tokens (or a divisor of it, the simulator's 16)
sees the trace's sharing exactly. Scaling keeps that structure: ``scale`` multiplies every token
count (a block of 512 becomes ``round(512 * scale)`` tokens), ``output_scale`` the answers.

Time: a ``TraceWindow`` picks the records arriving in ``[start_s, end_s)`` of trace time and
replays them open loop, each at its timestamp, compressed so that the window's mean rate is the
rate asked for (``replay``): the routing benchmark's rate search then works on a trace as on a
synthetic workload. ``duration`` cuts the replay; seed ``k`` starts ``k`` durations later in
the window, so several seeds are consecutive slices of the same trace (the window repeating
from its start once they pass its end).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvbench.workloads import TRACE_SHAPE, VOCAB, Trace, TraceRequest, Workload

MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake record; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse(lines: Iterable[str], source: str = "trace") -> tuple[TraceRecord, ...]:
    """Records in file order; blank lines skipped. Raises ``TraceFormatError`` on the first bad line."""
    out: list[TraceRecord] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{source}:{n}: not JSON ({exc.msg})") from None
        out.append(_record(raw, f"{source}:{n}"))
    if not out:
        raise TraceFormatError(f"{source}: no records")
    return tuple(out)


def _record(raw: object, where: str) -> TraceRecord:
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in raw:
            raise TraceFormatError(f"{where}: missing {key!r}")
    ts, n_in, n_out, ids = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
        raise TraceFormatError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
    for key, v in (("input_length", n_in), ("output_length", n_out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TraceFormatError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers")
    if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
        raise TraceFormatError(f"{where}: {len(ids)} hash_ids for input_length {n_in} "
                               f"(expected ceil({n_in} / {MOONCAKE_BLOCK_TOKENS}))")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids))


def load(path: Path) -> tuple[TraceRecord, ...]:
    with path.open(encoding="utf-8") as f:
        return parse(f, str(path))


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """A trace file and how to replay it: the benchmark's ``trace`` workload parameters."""

    name: str
    records: tuple[TraceRecord, ...]
    scale: float = 1.0
    """Multiplies every prompt token count (blocks of 512 become ``round(512 * scale)`` tokens)."""
    output_scale: float | None = None
    """Multiplies every output length (default: ``scale``); at least one token each."""
    start_s: float = 0.0
    """The window's start, seconds of trace time."""
    end_s: float | None = None
    """The window's end (default: after the last record)."""
    max_model_len: int = 8192
    """The pods' context: a longer prompt is cut to it, less its answer (a cut keeps a prefix, so
    the sharing of what is left stays exact)."""

    def __post_init__(self) -> None:
        if not self.scale > 0 or round(MOONCAKE_BLOCK_TOKENS * self.scale) < 1:
            raise ValueError(f"trace scale must leave a block at least one token, got {self.scale}")
        if self.output_scale is not None and not self.output_scale > 0:
            raise ValueError(f"trace output scale must be > 0, got {self.output_scale}")
        if self.end_s is not None and not self.end_s > self.start_s:
            raise ValueError(f"trace window end ({self.end_s} s) must be after its start ({self.start_s} s)")

    @property
    def block_tokens(self) -> int:
        return round(MOONCAKE_BLOCK_TOKENS * self.scale)

    def window(self) -> tuple[TraceRecord, ...]:
        """The records arriving in ``[start_s, end_s)``, in arrival order."""
        lo = self.start_s * 1000
        hi = math.inf if self.end_s is None else self.end_s * 1000
        return tuple(sorted((r for r in self.records if lo <= r.timestamp_ms < hi), key=lambda r: r.timestamp_ms))

    def span_s(self, records: tuple[TraceRecord, ...]) -> float:
        """Trace seconds the window covers (to the last record, when it has no end)."""
        end = self.end_s if self.end_s is not None else records[-1].timestamp_ms / 1000 + 1e-3
        return max(end - self.start_s, 1e-3)

    def natural_rate(self) -> float:
        """The window's mean request rate in trace time (requests/s)."""
        records = self.window()
        return len(records) / self.span_s(records) if records else 0.0

    def input_tokens(self, record: TraceRecord) -> int:
        """The record's prompt tokens once scaled: whole blocks, then the scaled partial block."""
        bt, full = self.block_tokens, len(record.hash_ids) - 1
        last = record.input_length - full * MOONCAKE_BLOCK_TOKENS
        return full * bt + min(bt, max(1, round(last * self.scale)))

    def output_tokens(self, record: TraceRecord) -> int:
        scale = self.scale if self.output_scale is None else self.output_scale
        return max(1, round(record.output_length * scale))

    def describe(self) -> str:
        end = "end" if self.end_s is None else f"{self.end_s:g} s"
        out = f", output x{self.output_scale:g}" if self.output_scale is not None else ""
        return (f"trace {self.name} ({len(self.records)} requests), window {self.start_s:g} s-{end}, "
                f"tokens x{self.scale:g} ({self.block_tokens}-token blocks){out}")


def block_words(hash_id: int, n: int, block_tokens: int) -> list[str]:
    """The first ``n`` words of block ``hash_id`` (``block_tokens`` words in all): the same
    words wherever the block appears, so shared hash ids are shared tokens."""
    rng = random.Random(f"mooncake-block/{hash_id}/{block_tokens}")
    return [f"w{rng.randrange(VOCAB)}" for _ in range(n)]


def prompt(window: TraceWindow, record: TraceRecord, max_tokens: int | None = None) -> str:
    """The record's prompt: its blocks' words in order, cut to ``max_tokens`` words."""
    bt = window.block_tokens
    total = window.input_tokens(record)
    if max_tokens is not None:
        total = min(total, max_tokens)
    words: list[str] = []
    for i, h in enumerate(record.hash_ids):
        n = min(bt, total - i * bt)
        if n <= 0:
            break
        words += block_words(h, n, bt)
    return " ".join(words)


def replay(window: TraceWindow, rate: float, duration: float, seed: int = 0) -> Trace:
    """The window replayed open loop at mean rate ``rate``: each record at its timestamp, time
    compressed by ``rate / natural_rate``; the slice of ``duration`` seconds after ``seed``
    earlier slices. A slice covers the window at most once, and one that runs past its end (a
    late seed at a high rate) goes on from its first record, one window span later."""
    records = window.window()
    if not records:
        raise ValueError(f"{window.describe()}: no requests in the window")
    if not rate > 0 or not duration > 0:
        raise ValueError(f"a trace replays at a rate and for a duration > 0, got {rate} req/s for {duration} s")
    span_ms = window.span_s(records) * 1000
    speedup = rate / (len(records) / (span_ms / 1000))
    t0 = window.start_s * 1000 + (seed * duration * speedup * 1000) % span_ms
    requests: list[TraceRequest] = []
    # one pass over the window from t0: its records from there, then (a lap later) those before
    cycle = [(r.timestamp_ms - t0, r) for r in records if r.timestamp_ms >= t0]
    cycle += [(r.timestamp_ms + span_ms - t0, r) for r in records if r.timestamp_ms < t0]
    for offset_ms, r in cycle:
        at = offset_ms / 1000 / speedup
        if at >= duration:
            break
        i = len(requests)
        out = window.output_tokens(r)
        text = prompt(window, r, max_tokens=window.max_model_len - out - 1)  # the tokenizer adds a BOS token
        requests.append(TraceRequest(i, at, text, out, seed * 1_000_003 + i, f"h{r.hash_ids[0]}"))
    return Trace("trace", rate, duration, tuple(requests))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--trace`` options of the benchmarks that replay traces (``bench_routing``, ``replay_policy``)."""
    t = p.add_argument_group("trace replay")
    t.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="replay a Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids) "
                        "instead of --workloads")
    t.add_argument("--trace-scale", type=float, default=0.0625,
                   help="multiply the trace's token counts (its 512-token blocks too; default %(default)s)")
    t.add_argument("--trace-output-scale", type=float, default=None, help="multiply output lengths (default: --trace-scale)")
    t.add_argument("--trace-window", nargs=2, type=float, default=None, metavar=("START", "END"),
                   help="replay only requests arriving in [START, END) seconds of trace time")
    t.add_argument("--trace-speedup", type=float, default=None,
                   help="compress the trace's time by this factor (one rate; default: the rate search's rates)")
    t.add_argument("--trace-pods", type=int, default=4, help="pods for the trace (default %(default)s)")
    t.add_argument("--trace-num-blocks", type=int, default=2400, help="KV blocks per pod for the trace (default %(default)s)")


def workload(args: argparse.Namespace) -> tuple[Workload, tuple[float, ...]]:
    """The ``--trace`` workload, and its one rate when ``--trace-speedup`` fixes it (else none:
    the rate search picks them). Raises ValueError (OSError) for a bad trace or window."""
    start, end = args.trace_window if args.trace_window else (0.0, None)
    window = TraceWindow(args.trace.name, load(args.trace), scale=args.trace_scale,
                         output_scale=args.trace_output_scale, start_s=start, end_s=end)
    if not window.window():
        raise ValueError(f"{window.describe()}: no requests in the window")
    rates = (round(window.natural_rate() * args.trace_speedup, 3),) if args.trace_speedup else ()
    return Workload("trace", TRACE_SHAPE, decode_pods=args.trace_pods, num_blocks=args.trace_num_blocks,
                    params=(("window", window),)), rates
