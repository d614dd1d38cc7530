"""Prometheus metrics of NIXL transfers, under vLLM's ``vllm:nixl_*`` names where vLLM has one.

vLLM (``NixlPromMetrics``) exports per transfer: ``vllm:nixl_xfer_time_seconds``,
``vllm:nixl_post_time_seconds``, ``vllm:nixl_bytes_transferred`` and
``vllm:nixl_num_descriptors`` (histograms, so ``_count`` is the number of transfers and the
bytes histogram's ``_sum`` the bytes moved), and the counters ``vllm:nixl_num_failed_transfers``,
``vllm:nixl_num_failed_notifications``, ``vllm:nixl_num_kv_expired_reqs`` and
``vllm:nixl_num_notifications_after_expiry`` (0.32's names, docs/vllm-protocols.md §3). The same names, buckets and labels
(``model_name``, ``engine``) are used here. What vLLM has no metric for is ``kvflow_sim:nixl_*``:
fallbacks to local prefill by reason, handshakes, content verification, pinned exports, and
lease heartbeats (sent by decode pods, received and leases extended by prefill pods).

``NixlMetrics`` owns a private registry of ``kvflow.exposition`` families and renders it, so the
simulator's ``/metrics`` includes it, on its fast path, with ``sim_registry.register(transfer.metrics)``;
it is also a prometheus_client collector (``collect``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric

from kvflow.exposition import Counter, Gauge, Histogram, HistogramChild, Registry

XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
POST_TIME_BUCKETS = (0.001, *XFER_TIME_BUCKETS)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
FALLBACK_REASONS = ("bad_params", "prefill_unreachable", "transfer_timeout", "transfer_error", "content_mismatch")


class NixlMetrics:
    def __init__(self, model_name: str = "", engine: str = "0", pinned: Callable[[], int] = lambda: 0) -> None:
        self.registry = Registry()
        r, names, values = self.registry, ["model_name", "engine"], [model_name, engine]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> HistogramChild:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        self.xfer_time = hist("vllm:nixl_xfer_time_seconds",
                              "Histogram of transfer duration for NIXL KV Cache transfers.", XFER_TIME_BUCKETS)
        self.post_time = hist("vllm:nixl_post_time_seconds",
                              "Histogram of transfer post time for NIXL KV Cache transfers.", POST_TIME_BUCKETS)
        self.bytes = hist("vllm:nixl_bytes_transferred",
                          "Histogram of bytes transferred per NIXL KV Cache transfers.", BYTES_BUCKETS)
        self.descriptors = hist("vllm:nixl_num_descriptors",
                                "Histogram of number of descriptors per NIXL KV Cache transfers.",
                                DESCRIPTOR_BUCKETS)
        self.failed_transfers = counter("vllm:nixl_num_failed_transfers",
                                        "Number of failed NIXL KV Cache transfers.").labels(*values)
        self.failed_notifications = counter("vllm:nixl_num_failed_notifications",
                                            "Number of failed NIXL KV Cache notifications.").labels(*values)
        self.expired = counter("vllm:nixl_num_kv_expired_reqs",
                               "Number of requests whose KV blocks expired before a decode pod read them."
                               ).labels(*values)
        self.late_notifications = counter("vllm:nixl_num_notifications_after_expiry",
                                          "Number of notifications that arrived after their request's blocks "
                                          "expired.").labels(*values)
        fallbacks = counter("kvflow_sim:nixl_pull_fallbacks",
                            "Remote-prefill requests whose NIXL pull failed, by reason; each fell back "
                            "to local prefill.", ("reason",))
        self.fallbacks = {reason: fallbacks.labels(*values, reason) for reason in FALLBACK_REASONS}
        handshakes = counter("kvflow_sim:nixl_handshakes",
                             "Side-channel handshakes with prefill pods, by result.", ("result",))
        self.handshakes = {result: handshakes.labels(*values, result) for result in ("ok", "failed")}
        self.rehandshakes = counter("kvflow_sim:nixl_stale_peers",
                                    "Cached peers found stale (restarted or gone) and dropped.").labels(*values)
        self.blocks_verified = counter("kvflow_sim:nixl_blocks_verified",
                                       "Pulled blocks whose content matched what prefill wrote.").labels(*values)
        self.blocks_mismatched = counter("kvflow_sim:nixl_blocks_mismatched",
                                         "Pulled blocks whose content did not match.").labels(*values)
        released = counter("kvflow_sim:nixl_exports_released",
                           "Exported (pinned) prefill blocks released, by cause.", ("cause",))
        self.released = {cause: released.labels(*values, cause) for cause in ("notified", "expired", "engine")}
        heartbeats = counter("kvflow_sim:nixl_heartbeats_sent",
                             "Lease-renewal heartbeats (one NIXL notification per prefill engine and "
                             "interval) sent, by result.", ("result",))
        self.heartbeats_sent = {result: heartbeats.labels(*values, result) for result in ("ok", "failed")}
        self.heartbeats_received = counter("kvflow_sim:nixl_heartbeats_received",
                                           "Lease-renewal heartbeats received from decode pods.").labels(*values)
        self.leases_extended = counter("kvflow_sim:nixl_leases_extended",
                                       "Pinned exports whose expiry a heartbeat moved later.").labels(*values)
        Gauge("kvflow_sim:nixl_pinned_exports", "Prefill requests whose blocks wait for a decode pull.",
              names, registry=r).labels(*values).set_function(lambda: float(pinned()))

    def render(self) -> str:
        return self.registry.render()

    def collect(self) -> Iterator[Metric]:
        """Makes this object a prometheus_client collector for another registry."""
        yield from self.registry.collect()
