"""Tokenizing the routing benchmark's prompts: the built-in tokenizer, and a Hugging Face
tokenizer with and without its remembered chunks.

The router tokenizes every prompt before it can look up its prefix, on the gateway's event
loop, so this is time every request waits. A Hugging Face BPE tokenizer holds the GIL while it
encodes, tens of milliseconds for a 40 KB prompt here. ``HFTokenizer`` therefore tokenizes long
texts in chunks cut at spaces from the start and remembers them (``kvflow/tokenizer.py``): a
prompt that shares a prefix with an earlier one pays only for its new text. The table gives,
per workload of ``kvflow bench routing`` (its seed-0 trace at round-robin's saturation rate
on the replay, prompts in arrival order, one tokenizer per workload so each starts cold):

* ``builtin``: kvflow's built-in tokenizer (no tokenizer folder), which remembers chunks too;
* ``hf, whole text``: the Hugging Face tokenizer as a plain ``encode`` (what a router without
  the chunks pays, and what vLLM pays);
* ``hf`` (the headline: a tokenizer folder, as users configure one): the same tokenizer with
  its chunks, and ``same ids``: the requests whose ids equal the whole text's (all, or the
  chunks would be a bug).

Wall time per request (``encode_batch`` may use the tokenizer's own threads) and the process's
CPU time, mean / median / p90 in ms. The default tokenizer is the tiny Llama's in
``tests/golden/tiny-llama-tokenizer`` (a 2,048-token BPE vocabulary: the workloads' ``w123``
words take about one token per character, several times what an English text takes with a
128k vocabulary; the ratios are the figures to read). A PNG under ``bench/out/`` plots the means.

    .venv/bin/python bench/bench_tokenize.py [--workloads a b c] [--tokenizer FOLDER] [--duration 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from kvbench.report import percentile  # noqa: E402 - bench/ is put on the path above
from kvbench.runner import saturation  # noqa: E402
from kvbench.workloads import WORKLOADS  # noqa: E402

from kvflow.tokenizer import BuiltinTokenizer, HFTokenizer  # noqa: E402

OUT = ROOT / "bench" / "out"
TINY_LLAMA = ROOT / "tests" / "golden" / "tiny-llama-tokenizer"


def timed(encode: Callable[[str], list[int]], prompts: list[str]) -> tuple[list[float], list[float], list[list[int]]]:
    walls, cpus, ids = [], [], []
    for prompt in prompts:
        wall, cpu = time.perf_counter(), time.process_time()
        ids.append(encode(prompt))
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return walls, cpus, ids


def measure(prompts: list[str], folder: Path) -> dict[str, tuple[list[float], list[float], list[list[int]]]]:
    """Per tokenizer (a fresh one each): every prompt's wall and CPU seconds and its ids."""
    plain, chunked = HFTokenizer(folder), HFTokenizer(folder)
    if not chunked.chunked:
        print(f"{folder}: its chunks would not give the whole text's ids; it tokenizes whole texts", file=sys.stderr)
    plain.chunked = False
    return {"builtin": timed(BuiltinTokenizer().encode, prompts), "hf, whole text": timed(plain.encode, prompts),
            "hf": timed(chunked.encode, prompts)}


def summary(values: list[float]) -> str:
    return f"{statistics.fmean(values) * 1e3:.2f} / {statistics.median(values) * 1e3:.2f} / {percentile(values, 90) * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["a", "b", "c"],
                   choices=sorted(w for w in WORKLOADS if WORKLOADS[w].prefill_pods == 0))
    p.add_argument("--tokenizer", type=Path, default=TINY_LLAMA, help="a Hugging Face tokenizer folder")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each trace")
    args = p.parse_args(argv)

    print("| workload | tokenizer | requests | tokens / request | wall ms mean / median / p90 | CPU ms mean / median / p90 "
          "| same ids |\n|---|---|---:|---:|---:|---:|---|")
    means: dict[str, dict[str, float]] = {}
    for name in args.workloads:
        w = WORKLOADS[name]
        rate = saturation(w, 0, args.duration)
        runs = measure([r.prompt for r in w.trace(rate, args.duration, 0).requests], args.tokenizer)
        reference = runs["hf, whole text"][2]
        for label, (walls, cpus, ids) in runs.items():
            same = "–" if label == "builtin" else f"{sum(a == b for a, b in zip(ids, reference))} / {len(ids)}"
            tokens = statistics.fmean(len(i) for i in ids)
            print(f"| ({name}) {rate:g} req/s | {label} | {len(ids)} | {tokens:,.0f} | {summary(walls)} | {summary(cpus)} "
                  f"| {same} |")
            means.setdefault(label, {})[name] = statistics.fmean(walls) * 1e3
        print(f"| ({name}) | hf whole / hf | | | {statistics.fmean(runs['hf, whole text'][0]) / statistics.fmean(runs['hf'][0]):.1f}x "
              "| | |", flush=True)
    plot(means, args.workloads, OUT / "tokenize.png")
    return 0


def plot(means: dict[str, dict[str, float]], workloads: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(means)
    for k, (label, per) in enumerate(means.items()):
        ax.bar([i + k * width for i in range(len(workloads))], [per[w] for w in workloads], width, label=label)
    ax.set_xticks([i + width * (len(means) - 1) / 2 for i in range(len(workloads))], [f"({w})" for w in workloads])
    ax.set_yscale("log")
    ax.set_ylabel("ms per request (mean, wall)")
    ax.set_title("Tokenizing the routing workloads' prompts")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
