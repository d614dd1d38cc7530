"""The tokenizer benchmark's runs: with remembered chunks every request gets the whole text's ids."""

from __future__ import annotations

from bench_tokenize import TINY_LLAMA, measure
from kvbench.workloads import WORKLOADS


def test_the_chunked_tokenizer_gives_every_prompt_the_whole_texts_ids() -> None:
    prompts = [r.prompt for r in WORKLOADS["c"].trace(6.0, 3.0, 0).requests]
    runs = measure(prompts, TINY_LLAMA)
    assert set(runs) == {"builtin", "hf, whole text", "hf"}
    whole, chunked = runs["hf, whole text"], runs["hf"]
    assert len(prompts) >= 5 and chunked[2] == whole[2] and all(len(ids) > 1000 for ids in whole[2])
    assert all(len(walls) == len(cpus) == len(prompts) for walls, cpus, _ in runs.values())
