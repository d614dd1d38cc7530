"""The gateway's Prometheus metrics.

Counts live in plain dicts and lists and become metric families only when ``/metrics`` is
scraped: the hot path pays a dict update or a ``bisect`` per observation, not
prometheus_client's per-sample locks and label resolution. One ``GatewayMetrics`` per gateway
(tests run several in one process); ``render`` joins in the pool routers' registries.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class Histogram:
    """One labelled histogram child: counts per bucket (the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            out.append((bound, float(running)))
        return out


class Gauge:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)


class Counter:
    """Counts by label values."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, count in sorted(self.values.items()):
            family.add_metric(list(values), count)
        return family


class ModelMetrics:
    """Everything recorded per model."""

    __slots__ = ("ttft", "itl", "e2e", "inflight", "queued")

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.inflight = Gauge()
        self.queued = Gauge()


_HISTOGRAMS = (
    ("ttft", "kvflow_gateway_time_to_first_token_seconds", "Time to first streamed token."),
    ("itl", "kvflow_gateway_inter_token_latency_seconds", "Time between streamed chunks."),
    ("e2e", "kvflow_gateway_request_duration_seconds", "End-to-end request latency."),
)
_GAUGES = (
    ("inflight", "kvflow_gateway_inflight_requests", "Requests being served."),
    ("queued", "kvflow_gateway_queued_requests", "Requests waiting for a slot."),
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests = Counter("kvflow_gateway_requests", "Requests answered, by HTTP status.", ("model", "status"))
        self.retries = Counter("kvflow_gateway_retries", "Requests re-sent to another pod.", ("model", "reason"))
        self.mode = Counter("kvflow_gateway_routed", "Requests routed, by serving mode (pd or aggregated).",
                            ("model", "mode"))
        self.failures = Counter("kvflow_gateway_failures", "Failures, by kind.", ("model", "reason"))
        self.http_refusals: dict[str, int] = {}
        """The HTTP server's own: connections closed and requests refused by its limits, by reason."""
        self._models: dict[str, ModelMetrics] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)  # type: ignore[arg-type]

    def model(self, name: str) -> ModelMetrics:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelMetrics()
        return found

    @staticmethod
    def count(counter: Counter, *labels: str) -> None:
        counter.values[labels] = counter.values.get(labels, 0.0) + 1.0

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: called when the registry is rendered."""
        models = sorted(self._models.items())
        for attr, name, doc in _HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, m in models:
                histogram: Histogram = getattr(m, attr)
                family.add_metric([model], histogram.cumulative(), histogram.total)
            yield family
        for counter in (self.requests, self.retries, self.mode, self.failures):
            yield counter.family()
        refusals = CounterMetricFamily("kvflow_gateway_http_refusals", "Client connections closed or requests "
                                       "refused by the HTTP limits (timeouts, sizes, connection cap), by reason.",
                                       labels=["reason"])
        for reason, n in sorted(self.http_refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        for attr, name, doc in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            for model, m in models:
                gauge.add_metric([model], getattr(m, attr).value)
            yield gauge

    def render(self, others: Iterable[CollectorRegistry] = ()) -> bytes:
        """This registry's metrics and, merged family by family, those of ``others`` (the routers')."""
        return generate_latest(_Merged([self.registry, *others]))  # type: ignore[arg-type]


class _Merged:
    """Several registries as one: families of the same name (one per pool's router) are joined,
    since the exposition format allows each family once."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())
