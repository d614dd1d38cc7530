"""Mooncake traces become benchmark traces that keep their prefix sharing exactly.

The parser refuses what is not a Mooncake record (naming the line), scaling keeps the block
structure, a window and a rate pick the requests and their send times, and two prompts share
exactly the tokens of the hash ids they share, down to the simulator's prefix-cache blocks; the
oracle's replay runs on such a trace.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvbench import oracle, traces
from kvbench.traces import TraceFormatError, TraceRecord, TraceWindow
from kvbench.workloads import TRACE_SHAPE, Workload, describe

from kvflow.sim.profiles import get_profile

SYNTHETIC = Path("/work/shared/traces/mooncake-synthetic_trace.jsonl")


def line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def rec(ts: float, n_in: int, n_out: int, ids: list[int]) -> TraceRecord:
    return TraceRecord(float(ts), n_in, n_out, tuple(ids))


def test_parse_reads_records_in_file_order_and_skips_blank_lines() -> None:
    got = traces.parse([line(0, 1024, 6, [0, 1]), "", line(1500, 600, 3, [0, 7])])
    assert got == (rec(0, 1024, 6, [0, 1]), rec(1500, 600, 3, [0, 7]))


@pytest.mark.parametrize(("text", "message"), [
    ("{nope", "t:1: not JSON"),
    ("[1, 2]", "t:1: expected a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}), "t:1: missing 'hash_ids'"),
    (line(-1, 5, 1, [0]), "t:1: timestamp must be"),
    (line(0, 0, 1, []), "t:1: input_length must be an integer >= 1"),
    (line(0, 5, 0, [0]), "t:1: output_length must be"),
    (line(0, 5, 1, ["a"]), "t:1: hash_ids must be a list of integers"),
    (line(0, 513, 1, [0]), "t:1: 1 hash_ids for input_length 513"),
], ids=["json", "object", "missing-key", "negative-time", "empty-input", "no-output", "ids-type", "ids-count"])
def test_parse_names_the_bad_line(text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message.replace("(", r"\(")):
        traces.parse([text], "t")


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(TraceFormatError, match="no records"):
        traces.parse(["", "  "], "t")


def test_scaling_keeps_whole_blocks_and_scales_the_partial_one() -> None:
    w = TraceWindow("t", (rec(0, 1100, 100, [0, 1, 2]),), scale=1 / 16)
    assert w.block_tokens == 32
    r = w.records[0]
    assert w.input_tokens(r) == 2 * 32 + round(76 / 16)  # 1100 = 2 x 512 + 76
    assert w.output_tokens(r) == round(100 / 16)
    assert TraceWindow("t", w.records, scale=1 / 16, output_scale=1.0).output_tokens(r) == 100
    assert TraceWindow("t", (rec(0, 1, 1, [0]),), scale=1 / 16).input_tokens(rec(0, 1, 1, [0])) == 1  # never empty


@pytest.mark.parametrize("kwargs", [{"scale": 0.0}, {"scale": 1 / 2048}, {"output_scale": -1.0},
                                    {"start_s": 5.0, "end_s": 5.0}], ids=["zero", "no-block", "output", "window"])
def test_impossible_scales_and_windows_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TraceWindow("t", (rec(0, 5, 1, [0]),), **kwargs)  # type: ignore[arg-type]


def test_prompts_share_exactly_the_tokens_of_shared_hash_ids() -> None:
    a, b, c = rec(0, 1536, 1, [4, 5, 6]), rec(1, 1400, 1, [4, 5, 9]), rec(2, 1100, 1, [4, 5, 6])
    w = TraceWindow("t", (a, b, c), scale=1 / 16)
    pa, pb, pc = (traces.prompt(w, r).split() for r in (a, b, c))
    assert (len(pa), len(pb), len(pc)) == (96, 64 + round(376 / 16), 64 + round(76 / 16))
    assert pa[:64] == pb[:64] and pa[64] != pb[64]  # two shared blocks, then block 6 vs 9
    assert pc == pa[: len(pc)]  # a partial block 6 is the start of the whole one


def test_prefix_sharing_is_exact_in_the_simulators_blocks() -> None:
    """16-token blocks hashed as the simulator hashes them: shared 32-token trace blocks are
    shared cache blocks, and the first block that differs differs."""
    a, b = rec(0, 2048, 1, [1, 2, 3, 4]), rec(1, 2048, 1, [1, 2, 8, 4])
    w = TraceWindow("t", (a, b), scale=1 / 16)
    workload = Workload("t", TRACE_SHAPE, num_blocks=100, params=(("window", w),))
    pa, pb = oracle.prepare(workload.trace(rate=2.0, duration=10.0))
    assert len(pa.hashes) == len(pb.hashes) == 8
    assert pa.hashes[:4] == pb.hashes[:4]
    assert all(x != y for x, y in zip(pa.hashes[4:], pb.hashes[4:], strict=True))  # a chain: all differ after


def test_a_window_replays_open_loop_at_the_rate_asked() -> None:
    records = tuple(rec(1000 * t, 512, 4, [t]) for t in range(10))  # 1 request/s for 10 s
    w = TraceWindow("t", records, start_s=2.0, end_s=8.0)
    assert w.natural_rate() == pytest.approx(1.0)
    trace = traces.replay(w, rate=2.0, duration=10.0)
    assert [r.at for r in trace.requests] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert [r.max_tokens for r in trace.requests] == [4] * 6
    assert trace.rate == 2.0
    cut = traces.replay(w, rate=2.0, duration=1.2)
    assert [r.at for r in cut.requests] == pytest.approx([0.0, 0.5, 1.0])
    later = traces.replay(w, rate=2.0, duration=1.2, seed=1)  # the next slice of the window
    assert [r.at for r in later.requests] == pytest.approx([0.3, 0.8])
    assert [r.prompt for r in later.requests] == [traces.prompt(w, records[5]), traces.prompt(w, records[6])]
    # a slice past the window's end goes on from its start: every seed replays something
    wrapped = traces.replay(w, rate=2.0, duration=1.2, seed=2)  # starts 2 x 2.4 s in, 0.6 s before the end
    assert [r.at for r in wrapped.requests] == pytest.approx([0.1, 0.6, 1.1])
    assert [r.prompt for r in wrapped.requests] == [traces.prompt(w, records[i]) for i in (7, 2, 3)]


def test_a_window_without_requests_says_so() -> None:
    w = TraceWindow("t", (rec(0, 5, 1, [0]),), start_s=10.0)
    with pytest.raises(ValueError, match="no requests in the window"):
        traces.replay(w, rate=1.0, duration=1.0)


def test_prompts_longer_than_the_pods_context_are_cut_to_a_prefix() -> None:
    r = rec(0, 4096, 10, list(range(8)))
    w = TraceWindow("t", (r,), max_model_len=1000)
    (req,) = traces.replay(w, rate=1.0, duration=5.0).requests
    # the prompt, its BOS token and the answer fit the context: the pod generates every token
    assert len(req.prompt.split()) == 989
    assert req.prompt.split() == traces.prompt(w, r).split()[:989]


@pytest.mark.skipif(not SYNTHETIC.is_file(), reason="the shared synthetic Mooncake trace is not on this machine")
def test_the_synthetic_mooncake_trace_replays_on_the_oracle() -> None:
    w = TraceWindow(SYNTHETIC.name, traces.load(SYNTHETIC), scale=1 / 16, start_s=0.0, end_s=60.0)
    workload = Workload("trace", TRACE_SHAPE, decode_pods=2, num_blocks=2400, params=(("window", w),))
    assert "mooncake-synthetic_trace.jsonl" in describe(workload)
    trace = workload.trace(rate=4.0, duration=20.0)
    assert 40 <= len(trace.requests) <= 120
    prepared = oracle.prepare(trace)
    assert 0 < oracle.hit_ceiling(trace, prepared) < 1  # the trace shares prefixes, not everything
    result = oracle.replay(trace, oracle.RoundRobin(), pods=2, profile=get_profile("h100-llama8b"),
                           num_blocks=2400, prepared=prepared)
    assert not any(math.isnan(t) for t in result.ttft)


def test_the_tiered_workloads_pods_get_a_cpu_tier_of_exactly_its_blocks() -> None:
    from kvbench.runner import offload_args
    from kvbench.workloads import WORKLOADS

    from kvflow.sim.cli import num_cpu_blocks

    assert offload_args(WORKLOADS["e"]) == ()
    flag, gib, backend, native = offload_args(WORKLOADS["e-cpu"])
    assert (flag, backend, native) == ("--kv-offloading-size", "--kv-offloading-backend", "native")
    assert num_cpu_blocks(float(gib), 16, get_profile("h100-llama8b").kv_bytes_per_token) == 32000
    e = WORKLOADS["e"]
    working_set = dict(e.params)["groups"] * dict(e.params)["system_len"] // 16  # type: ignore[operator]
    assert working_set > e.decode_pods * e.num_blocks  # the prompts do not fit the GPUs
    assert WORKLOADS["e-cpu"].cpu_blocks >= working_set  # they fit one pod's CPU tier


def test_kvflows_router_replayed_on_offloading_pods_learns_their_cpu_tiers_from_events() -> None:
    """The replayed router hears the pods' CPU-tier events through the wire format: every one
    fingerprinted (none unchained), and at the end it believes each pod's tier holds as many
    blocks as it does."""
    from dataclasses import replace

    from kvbench.oracle import Pod
    from kvbench.replay_kvflow import KvflowReplay
    from kvbench.workloads import SMOKE

    class Watching(KvflowReplay):
        def __init__(self, pods: int, num_blocks: int) -> None:
            super().__init__(pods, num_blocks)
            self.pods: dict[int, Pod] = {}

        def stepped(self, pod: Pod, now: float) -> None:
            self.pods[pod.index] = pod
            super().stepped(pod, now)

    w = replace(SMOKE, num_blocks=60, cpu_blocks=400)  # the system prompts overflow the GPU pools
    policy = Watching(w.decode_pods, w.num_blocks)
    result = oracle.replay(w.trace(rate=6.0, duration=6.0), policy, pods=w.decode_pods,
                           profile=get_profile("h100-llama8b"), num_blocks=w.num_blocks, cpu_blocks=w.cpu_blocks)
    assert not any(math.isnan(t) for t in result.ttft) and policy.unchained == 0
    held = {i: pod.scheduler.pool.offload.num_used for i, pod in policy.pods.items()}  # type: ignore[union-attr]
    assert sum(held.values()) > 0
    assert {i: policy.router.precise.cpu.blocks_of(policy.endpoints[i].id) for i in held} == held
