"""A live run's placements, replayed: is a live gap to the oracle the placements or the pods?

    mkdir /tmp/probe
    KVFLOW_PATH_PROBE=/tmp/probe PYTHONPATH=bench/path_probe_site \\
        kvflow bench routing --workloads a --routers kvflow --factors 1.0 --seeds 0
    python bench/replay_placements.py /tmp/probe --workload a --seed 0 --rate 16

The path probe's pod records (``bench/path_probe_site``) name the pod that served each request
and the request's ``seed``, which names it in the trace. This replays the trace on the oracle's
simulation of the pods (``kvbench.oracle``) with every request sent where the live router sent
it, and prints that replay's TTFT beside the live pods' own (the engine's, from the same
records), the oracle's and kvflow's router in the replay. If the replayed placements come near
the live pods' own TTFT, the live run is what its placements made it, and its gap to the oracle
is where the router put requests under live timing. If they come near the oracle, the
placements were as good and the live pods lost the time themselves. Run one router and one
rate per probe folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import path_probe
from kvbench import oracle
from kvbench.report import percentile
from kvbench.replay_kvflow import KvflowReplay
from kvbench.runner import SIM_PROFILE
from kvbench.workloads import WORKLOADS, Trace

from kvflow.sim.profiles import Profile, get_profile


class Placed:
    """A ``Policy`` that sends each request where the live run did (None: it was not served)."""

    name = "live placements (replay)"

    def __init__(self, placements: Mapping[int, int]) -> None:
        self.placements = placements

    def pick(self, prepared: oracle.Prepared, pods: Sequence[oracle.Pod], now: float, profile: Profile) -> int | None:
        return self.placements.get(prepared.request.index)


def placements(records: Sequence[Mapping[str, object]], trace: Trace) -> tuple[dict[int, int], list[float]]:
    """Trace index -> pod index (pods numbered in the order of their addresses), and the pods'
    own TTFTs (engine arrival to first token) of the trace's requests."""
    index = {r.seed: r.index for r in trace.requests}
    pods = {pod: i for i, pod in enumerate(sorted({str(r["pod"]) for r in records if "pod" in r}))}
    placed: dict[int, int] = {}
    engine_ttft: list[float] = []
    for r in records:
        i = index.get(r.get("seed"))  # type: ignore[arg-type]
        if i is None or "pod" not in r:
            continue
        placed[i] = pods[str(r["pod"])]
        engine_ttft.append(float(r["first_token"]) - float(r["engine"]))  # type: ignore[arg-type]
    return placed, engine_ttft


def report(folder: Path, workload: str, seed: int, rate: float, duration: float = 20.0) -> str:
    wl = WORKLOADS[workload]
    trace = wl.trace(rate, duration, seed)
    placed, live = placements(path_probe.load(folder, "sim")[0], trace)
    if not placed:
        return f"no pod record in {folder} names a request of ({workload}) seed {seed} at {rate:g} req/s"
    profile = get_profile(SIM_PROFILE)
    prepared = oracle.prepare(trace)
    pods, blocks = wl.decode_pods, wl.num_blocks
    rows = [("live pods' own (engine arrival to first token)", live)]
    runs = [(Placed(placed), "live placements, replayed"),
            (KvflowReplay(pods, blocks), "kvflow default (replay)")]
    for policy, name in runs:
        result = oracle.replay(trace, policy, pods=pods, profile=profile, num_blocks=blocks, prepared=prepared)
        rows.append((name, [t for t in result.ttft if t == t]))
    best, _ = oracle.oracle_replay(trace, pods=pods, profile=profile, num_blocks=blocks, prepared=prepared)
    rows.append(("oracle (replay)", [t for t in best.ttft if t == t]))
    reference = statistics.mean(rows[-1][1])
    lines = [f"({workload}) seed {seed}, {rate:g} req/s: {len(placed)} of {len(trace.requests)} requests placed",
             f"{'TTFT (ms)':<48} {'mean':>7} {'p90':>7} {'vs oracle':>10}"]
    for name, values in rows:
        mean = statistics.mean(values)
        lines.append(f"{name:<48} {mean * 1e3:7.1f} {percentile([v * 1e3 for v in values], 0.9):7.1f} "
                     f"{mean / reference:10.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workload", choices=sorted(w for w in WORKLOADS if not WORKLOADS[w].pd), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=20.0)
    args = parser.parse_args(argv)
    print(report(args.folder, args.workload, args.seed, args.rate, args.duration))


if __name__ == "__main__":
    main(sys.argv[1:])
