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

Then the gateway's view: how late the event loop runs a 1 ms ticker while the trace's prompts
are tokenized back to back with the HF tokenizer's chunks, on the loop, or off it as the gateway
does (bodies of the tokenizer's ``offload_bytes`` or more in a worker thread: its Rust code
encodes new chunks outside the GIL).

Wall time per request (``encode_batch`` may use the tokenizer's own threads) and the process's
CPU time, mean / median / p90 in ms. The default tokenizer is the tiny Llama's in
``tests/golden/tiny-llama-tokenizer`` (a 2,048-token BPE vocabulary: the workloads' ``w123``
words take about one token per character, several times what an English text takes with a
128k vocabulary; the ratios are the figures to read). A PNG under ``bench/out/`` plots both tables.

    .venv/bin/python bench/bench_tokenize.py [--workloads a b c] [--tokenizer FOLDER] [--duration 20]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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

from kvflow.router.request import tokens_off_loop  # noqa: E402
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


def loop_stalls(prompts: list[str], folder: Path, *, off_loop: bool) -> list[float]:
    """The event loop's lateness on a 1 ms ticker while the prompts are tokenized one after
    another as the gateway does it (``tokens_off_loop``), on the loop or off it (a fresh HF
    tokenizer with its chunks, bodies of ``offload_bytes`` or more in a worker thread)."""
    tokenizer = HFTokenizer(folder)
    threshold = tokenizer.offload_bytes if off_loop else 1 << 62

    async def run() -> list[float]:
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        task = asyncio.create_task(ticker())
        for prompt in prompts:
            body = {"prompt": prompt}
            await tokens_off_loop(tokenizer, body, len(prompt), threshold)
            await asyncio.sleep(0)
        done.set()
        await task
        return lags

    return asyncio.run(run())


def print_rows(workload: str, runs: dict[str, tuple[list[float], list[float], list[list[int]]]],
               means: dict[str, float]) -> None:
    reference = runs["hf, whole text"][2]
    for label, (walls, cpus, ids) in runs.items():
        same = "–" if label == "builtin" else f"{sum(a == b for a, b in zip(ids, reference))} / {len(ids)}"
        tokens = statistics.fmean(len(i) for i in ids)
        print(f"| {workload} | {label} | {len(ids)} | {tokens:,.0f} | {summary(walls)} | {summary(cpus)} | {same} |")
        means[label] = statistics.fmean(walls) * 1e3
    print(f"| {workload} | hf whole / hf | | | {means['hf, whole text'] / means['hf']:.1f}x | | |", flush=True)


def summary(values: list[float]) -> str:
    return f"{statistics.fmean(values) * 1e3:.2f} / {statistics.median(values) * 1e3:.2f} / {percentile(values, 90) * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["a", "b", "c"],
                   choices=sorted(w for w in WORKLOADS if WORKLOADS[w].prefill_pods == 0))
    p.add_argument("--tokenizer", type=Path, default=TINY_LLAMA, help="a Hugging Face tokenizer folder")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each trace")
    args = p.parse_args(argv)

    print("| workload | tokenizer | requests | tokens / request | wall ms mean / median / p90 | CPU ms mean / median / p90 "
          "| same ids |\n|---|---|---:|---:|---:|---:|---|")
    means: dict[str, dict[str, float]] = {}
    stalls: dict[str, dict[str, list[float]]] = {}
    for name in args.workloads:
        w = WORKLOADS[name]
        rate = saturation(w, 0, args.duration)
        prompts = [r.prompt for r in w.trace(rate, args.duration, 0).requests]
        print_rows(f"({name}) {rate:g} req/s", measure(prompts, args.tokenizer), means.setdefault(name, {}))
        gc.collect()  # the runs' ids are garbage now: the collector walking them would stall the loop below
        stalls[name] = {where: loop_stalls(prompts, args.tokenizer, off_loop=where == "off the loop")
                        for where in ("on the loop", "off the loop")}
    print("\nThe event loop's lateness on a 1 ms ticker while each trace is tokenized with the HF tokenizer's chunks, "
          "ms:\n\n| workload | tokenized | lateness p50 / p99 | longest stall |\n|---|---|---:|---:|")
    for name, per in stalls.items():
        for where, lags in per.items():
            print(f"| ({name}) | {where} | {statistics.median(lags) * 1e3:.2f} / {percentile(lags, 99) * 1e3:.2f} "
                  f"| {max(lags) * 1e3:.1f} |")
    plot(means, stalls, args.workloads, OUT / "tokenize.png")
    return 0


def plot(means: dict[str, dict[str, float]], stalls: dict[str, dict[str, list[float]]], workloads: list[str],
         path: Path) -> None:
    """Left: ms per request per tokenizer; right: the event loop's p99 lateness, on and off the loop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, per, title, ylabel in (
        (left, means, "Tokenizing a prompt", "ms per request (mean, wall)"),
        (right, {w: {k: percentile(v, 99) * 1e3 for k, v in stalls[w].items()} for w in workloads},
         "Event-loop lateness, HF with chunks", "ms (p99 of a 1 ms ticker)"),
    ):
        labels = list(per[workloads[0]])
        width = 0.8 / len(labels)
        for k, label in enumerate(labels):
            ax.bar([i + k * width for i in range(len(workloads))], [per[w][label] for w in workloads], width,
                   label=label)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(workloads))], [f"({w})" for w in workloads])
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
