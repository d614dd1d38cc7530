"""The gateway's Prometheus metrics: one ``kvflow.exposition`` registry behind ``/metrics``.

The gateway's own families are ``kvflow.exposition``'s, the fast path the simulator uses: an
observation is a ``bisect`` or an addition on a child looked up once per model (no per-sample
lock or label resolution on the hot path), and a render formats only numbers, from prefixes
written when each series was created. The pool routers' families (``kvflow.router``'s, the same
kind, which the standalone router serves too) join the same registry (``join``), merged family
by family. The registry is a prometheus_client collector as a whole, and
``tests/gateway/test_metrics.py`` checks that ``generate_latest`` renders it byte for byte as the
fast path does. One ``GatewayMetrics`` per gateway (tests run several in one process).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvflow.exposition import Counter, Family, Gauge, GaugeChild, Histogram, HistogramChild, Registry, render_joined

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class ModelMetrics:
    """Everything recorded per model: its series in each per-model family."""

    __slots__ = ("e2e", "held", "inflight", "itl", "queued", "ttft")

    def __init__(self, ttft: HistogramChild, itl: HistogramChild, e2e: HistogramChild, inflight: GaugeChild,
                 queued: GaugeChild, held: GaugeChild) -> None:
        self.ttft, self.itl, self.e2e, self.inflight, self.queued = ttft, itl, e2e, inflight, queued
        self.held = held


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = Registry()
        by_model = ["model"]
        self._ttft = Histogram("kvflow_gateway_time_to_first_token_seconds", "Time to first streamed token.",
                               by_model, buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("kvflow_gateway_inter_token_latency_seconds", "Time between streamed chunks.",
                              by_model, buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("kvflow_gateway_request_duration_seconds", "End-to-end request latency.",
                              by_model, buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("kvflow_gateway_requests", "Requests answered, by HTTP status.", ["model", "status"],
                                registry=r)
        self.retries = Counter("kvflow_gateway_retries", "Requests re-sent to another pod.", ["model", "reason"],
                               registry=r)
        self.mode = Counter("kvflow_gateway_routed", "Requests routed, by serving mode (pd or aggregated).",
                            ["model", "mode"], registry=r)
        self.failures = Counter("kvflow_gateway_failures", "Failures, by kind.", ["model", "reason"], registry=r)
        self._refusals = Counter("kvflow_gateway_http_refusals", "Client connections closed or requests refused by "
                                 "the HTTP limits (timeouts, sizes, connection cap), by reason.", ["reason"],
                                 registry=r)
        self._inflight = Gauge("kvflow_gateway_inflight_requests", "Requests being served.", by_model, registry=r)
        self._queued = Gauge("kvflow_gateway_queued_requests", "Requests waiting for a slot.", by_model, registry=r)
        self._held = Gauge("kvflow_gateway_held_requests", "Requests waiting for the model's first ready pod "
                           "(scaled to zero, or starting).", by_model, registry=r)
        self.batch_lines = Counter("kvflow_gateway_batch_lines", "Batch API lines finished, by result "
                                   "(completed or failed).", ["result"], registry=r)
        self.batch_in_flight = Gauge("kvflow_gateway_batch_lines_in_flight", "Batch API lines being served.",
                                     by_model, registry=r)
        self.http_refusals: dict[str, int] = {}
        """The HTTP server's own counts (connections closed and requests refused by its limits, by
        reason), read into ``kvflow_gateway_http_refusals`` when rendered."""
        self._models: dict[str, ModelMetrics] = {}
        self._routers = RouterFamilies()
        r.register(self._routers)  # after the gateway's own families

    def model(self, name: str) -> ModelMetrics:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelMetrics(self._ttft.labels(name), self._itl.labels(name),
                                                      self._e2e.labels(name), self._inflight.labels(name),
                                                      self._queued.labels(name), self._held.labels(name))
        return found

    @staticmethod
    def count(counter: Counter, *labels: str) -> None:
        counter.labels(*labels).inc()

    def join(self, router: Registry) -> None:
        """Render a pool router's families with the gateway's (``PoolRouter.metrics.registry``)."""
        self._routers.registries.append(router)

    def render(self) -> bytes:
        for reason, n in self.http_refusals.items():  # the server's own counts, which only grow
            child = self._refusals.labels(reason)
            if n > child.value:
                child.inc(n - child.value)
        return self.registry.render().encode()


class RouterFamilies:
    """The pool routers' registries as one: families of the same name (one per pool's router)
    are joined, since the exposition format allows each family once."""

    def __init__(self) -> None:
        self.registries: list[Registry] = []

    def render(self) -> str:
        by_name: dict[str, list[Family[Any]]] = {}
        for registry in self.registries:
            for family in registry.families:
                if not isinstance(family, Family):
                    raise TypeError(f"a router registry holds only families, not {family!r}")
                by_name.setdefault(family.name, []).append(family)
        out: list[str] = []
        for families in by_name.values():
            render_joined(families, out)
        return "".join(out)

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())
