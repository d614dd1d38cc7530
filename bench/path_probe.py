"""Where a request's time to first token goes, hop by hop, from the probe in ``path_probe_site/``.

    mkdir /tmp/probe
    KVFLOW_PATH_PROBE=/tmp/probe PYTHONPATH=bench/path_probe_site \\
        kvflow bench routing --workloads b --routers kvflow --factors 1.0 --seeds 0
    python bench/path_probe.py /tmp/probe

Joins the gateway's and the simulated pods' records by request id (their clocks are the
machine's one monotonic clock) and prints the mean, median and p90 of every hop in ms: the
gateway's work before it sends, the way to the pod, the pod's own front end, the engine, the
way back. Under a peer router (no request ids), only the pods' hops are printed. Either way the
load generator's records, joined to the pods' by each request's seed, add the whole way there,
the whole way back and the path (the client's TTFT less the engine's), so a peer's path is split
as kvflow's is. Run one router per probe folder.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from kvbench.report import percentile

Record = dict[str, float]
Hop = tuple[str, Callable[[Record, Record], float]]

GATEWAY_HOPS: list[Hop] = [
    ("gateway: request's first byte to handled (read, parse)", lambda g, p: g["handled"] - g["began"]),
    ("gateway: handled to serving (parse, validate, admit)", lambda g, p: g["serving"] - g["handled"]),
    ("gateway: tokenize", lambda g, p: g["tokenize"]),
    ("gateway: tokenize, its thread's CPU time", lambda g, p: g["tokenize_cpu"]),
    ("gateway: schedule", lambda g, p: g["schedule"]),
    ("gateway: schedule, its thread's CPU time", lambda g, p: g["schedule_cpu"]),
    ("gateway: serving to sent", lambda g, p: g["sent"] - g["serving"]),
    ("sent to the pod's handler", lambda g, p: p["handler"] - g["sent"]),
]
POD_HOPS: list[Hop] = [
    ("pod: handler to engine", lambda g, p: p["engine"] - p["handler"]),
    ("pod: engine TTFT", lambda g, p: p["first_token"] - p["engine"]),
    ("pod: first token to written", lambda g, p: p["written"] - p["first_token"]),
]
CLIENT_HOPS: list[Hop] = [
    ("client: sent to the pod's handler (the way there)", lambda c, p: p["handler"] - c["sent"]),
    ("pod written to the client's first token (way back)", lambda c, p: c["first"] - p["written"]),
    ("client TTFT less the pod engine's TTFT (the path)",
     lambda c, p: (c["first"] - c["sent"]) - (p["first_token"] - p["engine"])),
]
"""Through any router, peers included: the load generator's records joined to the pods' by the
request's seed."""
BACK_HOPS: list[Hop] = [
    ("pod written to the gateway holding it", lambda g, p: g["first_chunk"] - p["written"]),
    ("gateway: handled to first chunk", lambda g, p: g["first_chunk"] - g["handled"]),
]


def load(folder: Path, role: str) -> tuple[list[Record], list[float]]:
    records: list[Record] = []
    lag: list[float] = []
    for path in sorted(folder.glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            key, item = json.loads(line)
            (records if key == "requests" else lag).append(item)
    return records, lag


def summary(values: list[float]) -> str:
    """Mean, median and p90 in ms (the p90 as the routing benchmark takes it)."""
    return (f"{statistics.mean(values) * 1e3:8.2f} {statistics.median(values) * 1e3:8.2f} "
            f"{percentile(values, 0.9) * 1e3:8.2f}")


def _hop(hop: Callable[[Record, Record], float], g: Record, p: Record) -> float | None:
    try:
        return hop(g, p)
    except (KeyError, TypeError):  # a stamp the record lacks
        return None


def report(folder: Path) -> str:
    gateway, lag = load(folder, "gateway")
    pod_records = load(folder, "sim")[0]
    pods = {r["rid"]: r for r in pod_records if r.get("rid")}
    by_seed = {r["seed"]: r for r in pod_records if "seed" in r}
    client = [(c, by_seed[c["seed"]]) for c in load(folder, "client")[0] if c["seed"] in by_seed]
    joined = [(g, pods[g["rid"]]) for g in gateway if g.get("rid") in pods and "schedule" in g]
    lines = [f"{'hop (ms)':<54} {'mean':>8} {'median':>8} {'p90':>8}"]
    if joined:
        lines[0] += f"   ({len(joined)} requests joined by id)"
        for name, hop in GATEWAY_HOPS + POD_HOPS + BACK_HOPS:
            values = [value for g, p in joined if (value := _hop(hop, g, p)) is not None]
            if values:  # (a probe folder from before a stamp was added has none of it)
                lines.append(f"{name:<54} {summary(values)}")
        if lag:
            lines.append(f"{'gateway: event-loop lag on 5 ms timers':<54} {summary(lag)}")
    elif pod_records:
        lines[0] += f"   ({len(pod_records)} requests; no gateway records: the pods' hops only)"
        for name, hop in POD_HOPS:
            lines.append(f"{name:<54} {summary([hop({}, p) for p in pod_records])}")
    else:
        return f"no probe records in {folder}"
    if client:
        lines.append(f"from the load generator ({len(client)} requests joined by seed):")
        for name, hop in CLIENT_HOPS:
            lines.append(f"{name:<54} {summary([hop(c, p) for c, p in client])}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/path_probe.py PROBE_FOLDER")
    print(report(Path(sys.argv[1])))
