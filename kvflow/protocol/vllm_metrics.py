"""vLLM's ``/metrics``: the families kvflow reads, one parser of them, and one fetch.

The router scores pods on these numbers (``router/scraper.py``, every pod every 0.5-2 s) and
the operator decides about engines with them (``operator/scrape.py``: stuck engines, queue-depth
scaling); both call ``fetch_metrics`` and read the same ``EngineMetrics``.

A vLLM scrape is ~50 KB of text, mostly histograms nobody here reads, so only the sample lines
of the families below are parsed (by hand: ~10 lines of the ~1,000). Names are vLLM v1's
(``vllm/v1/metrics/loggers.py``); the older ``gpu_cache_usage_perc`` / ``gpu_prefix_cache_*``
spellings are accepted too. Counters are named without ``_total``, as prometheus_client
declares them; the exposition appends it.

A pod is not trusted to send sane numbers: a sample that is not a finite number in its family's
range is skipped (``EngineMetrics.rejected`` counts them, the router logs it), never turned into
a score, an exception, or an unbounded label set.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"

_SUMMED = (RUNNING, WAITING, GENERATED, *KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS)
_WANTED = (*_SUMMED, LORA_INFO, CACHE_CONFIG)
MAX_COUNT = 1e12
"""Bigger than any real request or token count: a sample above it is garbage."""
MAX_LABEL = 4096
"""Longest label value kept (LoRA adapter lists); longer ones are skipped."""
MAX_MODELS = 64


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one vLLM ``/metrics`` scrape says, summed over the engine's data-parallel ranks.

    Equality compares what the router's scorers read: a scrape equal to the last one leaves the
    router's snapshot as it was.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int = 0
    block_size: int | None = None
    num_blocks: int | None = None
    models: frozenset[str] = frozenset()
    generated_tokens: float = field(default=0.0, compare=False)
    """Tokens generated since the engine started: the operator's sign of progress (no scorer reads it)."""
    rejected: int = field(default=0, compare=False)
    """Samples skipped as out of range or malformed (the pod is not trusted to send sane numbers)."""


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _sample(line: str) -> tuple[str, dict[str, str], float] | None:
    """``name{labels} value [timestamp]`` → its parts; None for anything malformed."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, body, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
        labels = {k: _unescape(v) for k, v in _LABEL.findall(body)}
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return name, labels, value


def _family(name: str) -> str | None:
    """The wanted family a sample belongs to (counters end in ``_total``), else None."""
    base = name.removesuffix("_total")
    return base if base in _WANTED else None


def parse_metrics(text: str) -> EngineMetrics:
    """Sum over engines (data-parallel ranks) and models; the latest LoRA info sample wins."""
    sums: dict[str, float] = {}
    lora_ts = -1.0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras = 0
    block_size: int | None = None
    num_blocks: int | None = None
    models: set[str] = set()
    rejected = 0
    for line in text.split("\n"):
        if not line.startswith(_WANTED):
            continue
        parsed = _sample(line.rstrip("\r"))
        family = _family(parsed[0]) if parsed is not None else None
        if parsed is None or family is None:
            if parsed is None:
                rejected += 1
            continue  # a longer name sharing the prefix (e.g. ..._by_reason, ..._created), or garbage
        _, labels, value = parsed
        if not math.isfinite(value) or value < 0 or value > MAX_COUNT or _too_long(labels.values()):
            rejected += 1
            continue
        model = labels.get("model_name")
        if model and len(models) < MAX_MODELS:
            models.add(model)
        if family == LORA_INFO:
            if value >= lora_ts:
                lora_ts = value
                running_loras = _csv(labels.get("running_lora_adapters"))
                waiting_loras = _csv(labels.get("waiting_lora_adapters"))
                max_loras = _int(labels.get("max_lora")) or 0
        elif family == CACHE_CONFIG:
            block_size = _int(labels.get("block_size"))
            num_blocks = _int(labels.get("num_gpu_blocks"))
        else:
            sums[family] = sums.get(family, 0.0) + value
    return EngineMetrics(
        running=int(sums.get(RUNNING, 0)),
        waiting=int(sums.get(WAITING, 0)),
        kv_usage=min(1.0, _first(sums, KV_USAGE)),
        prefix_queries=_first(sums, PREFIX_QUERIES),
        prefix_hits=_first(sums, PREFIX_HITS),
        running_loras=running_loras,
        waiting_loras=waiting_loras,
        max_loras=max_loras,
        block_size=block_size,
        num_blocks=num_blocks,
        models=frozenset(models),
        generated_tokens=sums.get(GENERATED, 0.0),
        rejected=rejected,
    )


def _too_long(values: Iterable[str]) -> bool:
    return any(len(v) > MAX_LABEL for v in values)


def _csv(value: str | None) -> frozenset[str]:
    return frozenset(x for x in (value or "").split(",") if x)


def _first(sums: dict[str, float], names: Iterable[str]) -> float:
    for name in names:
        if name in sums:
            return sums[name]
    return 0.0


def _int(value: str | None) -> int | None:
    """A label that should hold a positive count (``"None"`` where vLLM has none)."""
    try:
        number = int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None
    return number if number is not None and 0 < number <= MAX_COUNT else None


# -- the one fetch (the I/O edge; the callers own the session, its timeout and their policy) ----


MAX_SCRAPE_BYTES = 16 << 20
"""Largest ``/metrics`` body read (a vLLM scrape is ~50 KB): a pod sending more is not heard,
and what it sent past the mark is never buffered."""


async def fetch_metrics(session: aiohttp.ClientSession, url: str,
                        max_bytes: int = MAX_SCRAPE_BYTES) -> EngineMetrics | None:
    """The pod's metrics at ``url``, or None when it failed, timed out, sent something unreadable
    or more than ``max_bytes``.

    None is "did not answer", never "stuck" or "idle": what it means is the caller's to decide.
    """
    try:
        async with session.get(url) as resp:
            if resp.status != 200 or (resp.content_length or 0) > max_bytes:
                return None
            parts, size = [], 0
            while chunk := await resp.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    return None  # leaving the block drops the connection and the rest unread
                parts.append(chunk)
            text = b"".join(parts).decode()  # the exposition format is UTF-8
    except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
        return None
    return parse_metrics(text)
