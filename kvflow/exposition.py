"""Prometheus metric families that render their text exposition (format 0.0.4) in a fraction
of a millisecond: the fast path of the simulator's and the gateway's ``/metrics``.

prometheus_client's ``generate_latest`` rebuilds every sample on each scrape (a tuple per
sample, labels sorted and escaped, every number formatted): milliseconds for vLLM's 46 KB, on
the event loop that also serves tokens (``kvflow bench observe`` prints both renders' cost).
Here each series writes its sample-line prefixes once, when it is created, so a render formats
only numbers, and a histogram whose count has not moved since the last render reuses its text.
Updates are plain attribute arithmetic (no lock: each user updates its families from one
thread, its event loop), which is what keeps observing cheap on the simulator's engine step and
the gateway's request path.

The same families are a prometheus_client collector: ``Registry.collect()`` yields the public
``CounterMetricFamily``/``GaugeMetricFamily``/``HistogramMetricFamily``/``SummaryMetricFamily``
objects, so ``generate_latest`` renders them too; ``tests/core/test_exposition.py`` checks that the
two renderings are identical byte for byte (and the simulator's and gateway's tests check their
own families the same way).
"""

from __future__ import annotations

import gc
import os
import re
import resource
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, PlatformCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
INF = float("inf")

def fmt(value: float) -> str:
    """Prometheus' number format (Go's, e.g. ``1.234567e+06``), as generate_latest writes numbers."""
    return floatToGoString(value)  # type: ignore[no-untyped-call,no-any-return]


def count_text(n: int) -> str:
    """``fmt(n)`` for a count (a non-negative integer): Go writes one below a million as ``n.0``,
    which costs a third of formatting it as a float (a changed histogram writes one per bucket)."""
    return f"{n}.0" if n < 1_000_000 else fmt(n)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def label_text(pairs: Iterable[tuple[str, str]]) -> str:
    """``{a="x",b="y"}``: sorted by name, values escaped (empty without labels)."""
    items = sorted(pairs)
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}" if items else ""


def _head(name: str, doc: str, kind: str) -> str:
    escaped = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


class CounterChild:
    __slots__ = ("_line", "created", "created_line", "value")

    def __init__(self, name: str, labels: str) -> None:
        self.value = 0.0
        self.created = time.time()
        self._line = f"{name}_total{labels} "
        self.created_line = f"{name}_created{labels} {fmt(self.created)}\n"

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount

    def render(self) -> str:
        return self._line + fmt(self.value) + "\n"


class GaugeChild:
    __slots__ = ("_function", "_line", "value")
    created_line: ClassVar[str] = ""  # a gauge has no _created series

    def __init__(self, name: str, labels: str) -> None:
        self.value = 0.0
        self._function: Callable[[], float] | None = None
        self._line = f"{name}{labels} "

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value from ``function`` at each render (prometheus_client's ``set_function``)."""
        self._function = function

    def get(self) -> float:
        return self._function() if self._function is not None else self.value

    def render(self) -> str:
        return self._line + fmt(self.get()) + "\n"


class HistogramChild:
    __slots__ = ("_bounds", "_bucket_lines", "_cache", "_count_line", "_sum_line", "count", "counts", "created",
                 "created_line", "sum")

    def __init__(self, name: str, pairs: list[tuple[str, str]], bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0
        self.created = time.time()
        labels = label_text(pairs)
        self._bucket_lines = [f"{name}_bucket{label_text([*pairs, ('le', fmt(b))])} " for b in bounds]
        self._count_line = f"{name}_count{labels} "
        self._sum_line = f"{name}_sum{labels} "
        self.created_line = f"{name}_created{labels} {fmt(self.created)}\n"
        self._cache = (-1, "")

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value`` (every request decoding in the same two steps has the
        same inter-token gap: one call for the whole batch)."""
        self.counts[bisect_left(self._bounds, value)] += n
        self.count += n
        self.sum += value * n

    def cumulative(self) -> list[float]:
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(float(acc))
        return out

    def render(self) -> str:
        if self._cache[0] != self.count:  # unchanged since the last render: reuse its text
            lines = [line + count_text(acc) + "\n" for line, acc in zip(self._bucket_lines, accumulate(self.counts),
                                                                       strict=True)]
            lines.append(self._count_line + count_text(self.count) + "\n")
            lines.append(self._sum_line + fmt(self.sum) + "\n")
            self._cache = (self.count, "".join(lines))
        return self._cache[1]


class SummaryChild:
    """A summary without quantiles (count and sum), as prometheus_client's ``Summary``."""

    __slots__ = ("_count_line", "_sum_line", "count", "created", "created_line", "sum")

    def __init__(self, name: str, labels: str) -> None:
        self.count = 0
        self.sum = 0.0
        self.created = time.time()
        self._count_line = f"{name}_count{labels} "
        self._sum_line = f"{name}_sum{labels} "
        self.created_line = f"{name}_created{labels} {fmt(self.created)}\n"

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value

    def render(self) -> str:
        return f"{self._count_line}{fmt(self.count)}\n{self._sum_line}{fmt(self.sum)}\n"


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild, SummaryChild)


class Family(Generic[C]):
    """One metric family: a name, a help text, label names and one child per label values."""

    kind: ClassVar[str]
    sample_suffix: ClassVar[str] = ""
    has_created: ClassVar[bool] = True

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), *,
                 registry: Registry | None = None) -> None:
        if not _METRIC_NAME.match(name) or not all(_LABEL_NAME.match(n) for n in labelnames):
            raise ValueError(f"invalid metric or label name in {name}{list(labelnames)}")
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], C] = {}
        self._head = _head(name + self.sample_suffix, doc, self.kind)
        self._created_head = _head(name + "_created", doc, "gauge")
        if not labelnames:
            self.labels()  # an unlabelled family has its one series from the start
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> C:
        child = self.children.get(values)
        if child is None:
            values = tuple(str(v) for v in values)  # as prometheus_client does
            if values in self.children:
                return self.children[values]
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self.children[values] = self._child(list(zip(self.labelnames, values, strict=True)))
        return child

    def _child(self, pairs: list[tuple[str, str]]) -> C:
        raise NotImplementedError

    def render(self, out: list[str]) -> None:
        render_joined([self], out)

    def collect(self) -> Metric:
        raise NotImplementedError


class Counter(Family[CounterChild]):
    """A counter named with or without ``_total`` (the exposition appends it, as prometheus_client does)."""

    kind = "counter"
    sample_suffix = "_total"

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), *,
                 registry: Registry | None = None) -> None:
        super().__init__(name.removesuffix("_total"), doc, labelnames, registry=registry)

    def _child(self, pairs: list[tuple[str, str]]) -> CounterChild:
        return CounterChild(self.name, label_text(pairs))

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            family.add_metric(key, child.value, created=child.created)
        return family


class Gauge(Family[GaugeChild]):
    kind = "gauge"
    has_created = False

    def _child(self, pairs: list[tuple[str, str]]) -> GaugeChild:
        return GaugeChild(self.name, label_text(pairs))

    def collect(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            family.add_metric(key, child.get())
        return family


class Histogram(Family[HistogramChild]):
    kind = "histogram"

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), *, buckets: Iterable[float],
                 registry: Registry | None = None) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        if bounds[0] < 0:
            raise ValueError("negative buckets have no _sum in the text format; not supported here")
        self.bounds = tuple(bounds)
        super().__init__(name, doc, labelnames, registry=registry)

    def _child(self, pairs: list[tuple[str, str]]) -> HistogramChild:
        return HistogramChild(self.name, pairs, self.bounds)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            buckets = [(fmt(b), acc) for b, acc in zip(self.bounds, child.cumulative(), strict=True)]
            family.add_metric(key, buckets, child.sum)
            family.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, key, strict=True)),
                                         child.created))
        return family


class Summary(Family[SummaryChild]):
    kind = "summary"

    def _child(self, pairs: list[tuple[str, str]]) -> SummaryChild:
        return SummaryChild(self.name, label_text(pairs))

    def collect(self) -> Metric:
        family = SummaryMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            family.add_metric(key, child.count, child.sum)
            family.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, key, strict=True)),
                                         child.created))
        return family


AnyFamily = Family[CounterChild] | Family[GaugeChild] | Family[HistogramChild] | Family[SummaryChild]


def render_joined(families: Sequence[Family[Any]], out: list[str]) -> None:
    """Families of one name and kind rendered as one (the exposition format allows a name once):
    the first one's head, then every family's series. A gateway joins its pools' routers so."""
    first = families[0]
    out.append(first._head)
    children = [child for family in families for child in family.children.values()]
    out.extend(child.render() for child in children)
    if first.has_created and children:
        out.append(first._created_head)
        out.extend(child.created_line for child in children)


class Renderable(Protocol):
    """A group of families rendered on the fast path (for example the simulator's NIXL metrics)."""

    def render(self) -> str: ...

    def collect(self) -> Iterable[Metric]: ...


class Registry:
    """Families in registration order; a prometheus_client ``Collector`` as well (``collect``).

    A ``Renderable`` (something with its own fast ``render``) may join, and so may any other
    prometheus_client collector, whose families are then rendered in their place by
    ``generate_latest``, the slow path."""

    def __init__(self) -> None:
        self.families: list[AnyFamily | Renderable | Collector] = []

    def register(self, family: Family[C] | Renderable | Collector) -> None:
        if isinstance(family, Family) and any(isinstance(f, Family) and f.name == family.name for f in self.families):
            raise ValueError(f"duplicate metric family {family.name}")
        self.families.append(family)

    def unregister(self, family: Family[C] | Renderable | Collector) -> None:
        self.families.remove(family)

    def render(self) -> str:
        out: list[str] = []
        for family in self.families:
            if isinstance(family, Family):
                family.render(out)
            elif hasattr(family, "render"):
                out.append(family.render())
            else:
                out.append(generate_latest(family).decode())
        return "".join(out)

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            if isinstance(family, Family):
                yield family.collect()
            else:
                yield from family.collect()


# -- the process and Python families ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProcessSample:
    """What prometheus_client's ``ProcessCollector`` reads from /proc for this process."""

    virtual_memory_bytes: float
    resident_memory_bytes: float
    start_time_seconds: float
    cpu_seconds_total: float
    open_fds: float
    max_fds: float


@dataclass(frozen=True, slots=True)
class RuntimeSample:
    gc: tuple[tuple[int, int, int], ...]
    """Per generation: objects collected, uncollectable objects found, collections."""
    process: ProcessSample | None
    """None where /proc cannot be read (prometheus_client then leaves the process families out)."""


_GC = (
    ("python_gc_objects_collected", "Objects collected during gc"),
    ("python_gc_objects_uncollectable", "Uncollectable objects found during GC"),
    ("python_gc_collections", "Number of times this generation was collected"),
)
_PROCESS = (
    ("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge"),
    ("process_resident_memory_bytes", "Resident memory size in bytes.", "gauge"),
    ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", "gauge"),
    ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter"),
    ("process_open_fds", "Number of open file descriptors.", "gauge"),
    ("process_max_fds", "Maximum number of open file descriptors.", "gauge"),
)
_GC_LINES = tuple((_head(name + "_total", doc, "counter"), f'{name}_total{{generation="') for name, doc in _GC)
"""Per GC family: its head, and the start of a generation's line (written once)."""
_PROCESS_LINES = tuple(f"{_head(name, doc, kind)}{name} " for name, doc, kind in _PROCESS)
"""Per process family: its head and the start of its one line (written once)."""


def render_runtime(sample: RuntimeSample, platform: str) -> str:
    """The families prometheus_client's GC, platform and process collectors export (vLLM's
    /metrics begins with them), in their order and text; ``platform``: the platform collector's
    text (``python_info``, fixed for the process)."""
    out: list[str] = []
    for i, (head, line) in enumerate(_GC_LINES):
        out.append(head)
        out.extend(f'{line}{gen}"}} {fmt(counts[i])}\n' for gen, counts in enumerate(sample.gc))
    out.append(platform)
    if sample.process is not None:
        out.extend(line + fmt(value) + "\n" for line, value in zip(_PROCESS_LINES, _process_values(sample.process),
                                                                    strict=True))
    return "".join(out)


def runtime_families(sample: RuntimeSample, platform: Iterable[Metric]) -> list[Metric]:
    """The same families as prometheus_client's metric objects (what its collectors yield);
    ``platform``: the platform collector's."""
    out: list[Metric] = []
    for i, (name, doc) in enumerate(_GC):
        family = CounterMetricFamily(name, doc, labels=["generation"])
        for gen, counts in enumerate(sample.gc):
            family.add_metric([str(gen)], counts[i])
        out.append(family)
    out.extend(platform)
    if sample.process is not None:
        for (name, doc, kind), value in zip(_PROCESS, _process_values(sample.process), strict=True):
            metric = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            out.append(metric(name, doc, value=value))
    return out


def _process_values(p: ProcessSample) -> tuple[float, ...]:
    return (p.virtual_memory_bytes, p.resident_memory_bytes, p.start_time_seconds, p.cpu_seconds_total,
            p.open_fds, p.max_fds)


class Runtime:
    """The process and Python families on the fast path (a ``Renderable``).

    prometheus_client's collectors build every sample anew and read three /proc files a scrape
    (most of a simulated pod's render); this reads ``/proc/self/stat`` and counts
    ``/proc/self/fd``, the numbers prometheus_client reads there, and writes lines whose heads
    are fixed; ``python_info``, which never changes, is prometheus_client's own platform
    collector rendered once. ``collect()`` yields the same families as metric
    objects, so ``generate_latest`` renders the same text."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = float(os.sysconf("SC_CLK_TCK"))
        self._pagesize = float(resource.getpagesize())
        self._btime = self._boot_time()
        platform = CollectorRegistry(auto_describe=False)
        PlatformCollector(registry=platform)
        self.platform = list(platform.collect())
        self.platform_text = generate_latest(platform).decode()

    def _boot_time(self) -> float:
        try:
            with open(os.path.join(self._proc, "stat"), "rb") as stat:
                return next((float(line.split()[1]) for line in stat if line.startswith(b"btime ")), 0.0)
        except OSError:
            return 0.0

    def sample(self) -> RuntimeSample:
        stats = tuple((s["collected"], s["uncollectable"], s["collections"]) for s in gc.get_stats())
        return RuntimeSample(stats, self._process())

    def _process(self) -> ProcessSample | None:
        if not self._btime:
            return None
        try:
            with open(os.path.join(self._proc, "self", "stat"), "rb") as stat:
                parts = stat.read().split(b")")[-1].split()
            open_fds = len(os.listdir(os.path.join(self._proc, "self", "fd")))
        except OSError:
            return None
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # "Max open files" of /proc/self/limits
        return ProcessSample(float(parts[20]), float(parts[21]) * self._pagesize,
                             float(parts[19]) / self._ticks + self._btime,
                             (float(parts[11]) + float(parts[12])) / self._ticks, float(open_fds),
                             INF if soft == resource.RLIM_INFINITY else float(soft))

    def render(self) -> str:
        return render_runtime(self.sample(), self.platform_text)

    def collect(self) -> list[Metric]:
        return runtime_families(self.sample(), self.platform)
