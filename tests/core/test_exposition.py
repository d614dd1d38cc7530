"""The fast /metrics renderer writes exactly what prometheus_client's generate_latest writes."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.exposition import (
    Counter,
    Gauge,
    Histogram,
    ProcessSample,
    Registry,
    Runtime,
    RuntimeSample,
    Summary,
    count_text,
    fmt,
    render_runtime,
    runtime_families,
)

TRICKY = ["plain", 'quo"te', "back\\slash", "new\nline", "ünïcode", ""]


def reference(registry: Registry) -> bytes:
    """The same families rendered by prometheus_client, through its public collector API."""
    prom = CollectorRegistry(auto_describe=False)
    prom.register(registry)
    return generate_latest(prom)


def populated(seed: int) -> Registry:
    rng = random.Random(seed)
    r = Registry()
    c = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name", "engine"], registry=r)
    Counter("unlabelled", "A counter without labels\\with a backslash\nand a newline.", registry=r).labels().inc(7)
    Counter("never_touched_total", "A labelled family with no series yet.", ["x"], registry=r)
    g = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", ["model_name"], registry=r)
    h = Histogram("vllm:time_to_first_token_seconds", "TTFT.", ["model_name", "engine"],
                  buckets=(0.001, 0.005, 0.01, 0.5, 1.0, 2560.0, 1e6), registry=r)
    s = Summary("http_request_size_bytes", "Content length. Trailing space. ", ["handler"], registry=r)
    plain = Histogram("http_request_duration_highr_seconds", "No labels.", buckets=(0.01, 0.1, 1), registry=r)
    for value in TRICKY:
        c.labels(value, "0").inc(rng.choice([0, 1, 12345678, 0.5, 1e-9]))
        g.labels(value).set(rng.choice([0, -3, 1.5e7, 0.25]))
        for _ in range(rng.randrange(0, 40)):
            h.labels(value, "0").observe(rng.expovariate(3.0), n=rng.randrange(1, 5))
        s.labels(value).observe(rng.randrange(0, 100_000))
    plain.labels().observe(0.05)
    g.labels("computed").set_function(lambda: 42.0)
    return r


@pytest.mark.parametrize("seed", range(5))
def test_the_fast_render_is_generate_latest_byte_for_byte(seed: int) -> None:
    registry = populated(seed)
    assert registry.render().encode() == reference(registry)


def test_a_histogram_rendered_twice_reflects_observations_made_in_between() -> None:
    r = Registry()
    h = Histogram("h", "doc", buckets=(1, 2), registry=r)
    first = r.render()
    h.labels().observe(1.5)
    second = r.render()
    assert first != second and second.encode() == reference(r)
    assert 'h_bucket{le="1.0"} 0.0\nh_bucket{le="2.0"} 1.0\nh_bucket{le="+Inf"} 1.0\nh_count 1.0\nh_sum 1.5\n' in second


def test_bulk_observations_equal_single_ones() -> None:
    r1, r2 = Registry(), Registry()
    h1 = Histogram("h", "doc", buckets=(0.01, 0.1), registry=r1).labels()
    h2 = Histogram("h", "doc", buckets=(0.01, 0.1), registry=r2).labels()
    h1.observe(0.05, n=3)
    for _ in range(3):
        h2.observe(0.05)
    assert (h1.counts, h1.count) == (h2.counts, h2.count)


@pytest.mark.parametrize(("make", "message"), [
    (lambda r: Counter("bad-name", "d", registry=r), "invalid metric or label name"),
    (lambda r: Counter("ok", "d", ["bad-label"], registry=r), "invalid metric or label name"),
    (lambda r: [Gauge("twice", "d", registry=r), Gauge("twice", "d", registry=r)], "duplicate metric family"),
])
def test_bad_families_are_refused(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(Registry())  # type: ignore[operator]


def test_counters_only_go_up_and_labels_must_match() -> None:
    c = Counter("c", "d", ["a"], registry=Registry())
    with pytest.raises(ValueError, match="only goes up"):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        c.labels("x", "y")
    assert c.labels(1) is c.labels("1")  # type: ignore[arg-type]  # label values become strings


def test_a_prometheus_client_collector_renders_in_its_place() -> None:
    from prometheus_client import CollectorRegistry as PromRegistry
    from prometheus_client import Counter as PromCounter

    foreign = PromRegistry(auto_describe=False)
    PromCounter("vllm:nixl_num_failed_transfers", "Failed NIXL transfers.", ["model_name"], registry=foreign).labels(
        "m").inc(2)
    r = Registry()
    Gauge("before", "d", registry=r).labels().set(1)
    r.register(foreign)
    Gauge("after", "d", registry=r).labels().set(2)
    text = r.render()
    assert text.encode() == reference(r)
    assert text.index("before 1.0") < text.index('vllm:nixl_num_failed_transfers_total{model_name="m"} 2.0') \
        < text.index("after 2.0")
    r.unregister(foreign)  # a NIXL transfer leaves when it stops
    assert "nixl" not in r.render()


def test_a_group_with_its_own_fast_render_renders_in_its_place() -> None:
    from kvflow.sim.nixl.metrics import NixlMetrics

    nixl = NixlMetrics("m")
    nixl.bytes.observe(4096)
    r = Registry()
    Gauge("before", "d", registry=r).labels().set(1)
    r.register(nixl)
    assert r.render().encode() == reference(r)
    assert 'vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 4096.0' in r.render()


@pytest.mark.parametrize("n", [0, 1, 42, 999_999, 1_000_000, 1_234_567, 10**15, 10**17 + 3])
def test_a_count_is_written_as_prometheus_writes_its_float(n: int) -> None:
    assert count_text(n) == fmt(float(n))


# -- the process and Python families ---------------------------------------------------------------
SAMPLES = [
    RuntimeSample(((1605, 0, 107), (247, 3, 9), (0, 0, 0)),
                  ProcessSample(1.71835392e8, 5.228544e7, 1.79601047304e9, 0.74, 6.0, 20000.0)),
    RuntimeSample(((0, 0, 0),) * 3, ProcessSample(0.0, 4096.0, 1.5, 123456.789, 1.0, math.inf)),  # no fd limit
    RuntimeSample(((12, 0, 1),) * 3, None),  # no /proc: no process families
]


@pytest.mark.parametrize("sample", SAMPLES)
def test_the_runtime_families_render_as_generate_latest_renders_them(sample: RuntimeSample) -> None:
    runtime = Runtime()
    prom = CollectorRegistry(auto_describe=False)
    prom.register(type("Fixed", (), {"collect": lambda self: runtime_families(sample, runtime.platform)})())

    assert render_runtime(sample, runtime.platform_text) == generate_latest(prom).decode()


def test_the_runtime_families_read_what_prometheus_clients_collectors_read() -> None:
    prom = CollectorRegistry(auto_describe=False)
    for collector in (GCCollector, PlatformCollector, ProcessCollector):
        collector(registry=prom)

    theirs = {f.name: f for f in text_string_to_metric_families(generate_latest(prom).decode())}
    ours = {f.name: f for f in text_string_to_metric_families(Runtime().render())}

    assert list(ours) == list(theirs)  # the same families, in the same order
    for name in ours:
        assert (ours[name].type, ours[name].documentation) == (theirs[name].type, theirs[name].documentation)
        assert [s.labels for s in ours[name].samples] == [s.labels for s in theirs[name].samples]
    value = {name: f.samples[0].value for name, f in ours.items()}
    for name in ("python_info", "process_start_time_seconds", "process_max_fds", "process_open_fds"):
        assert value[name] == theirs[name].samples[0].value, name
    for name in ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_cpu_seconds"):
        assert value[name] == pytest.approx(theirs[name].samples[0].value, rel=0.05, abs=0.05), name


def test_without_proc_the_process_families_are_left_out_as_prometheus_client_leaves_them(tmp_path: Path) -> None:
    prom = CollectorRegistry(auto_describe=False)
    ProcessCollector(proc=str(tmp_path), registry=prom)
    assert generate_latest(prom) == b""

    names = [f.name for f in text_string_to_metric_families(Runtime(proc=str(tmp_path)).render())]
    assert names == ["python_gc_objects_collected", "python_gc_objects_uncollectable", "python_gc_collections",
                     "python_info"]
