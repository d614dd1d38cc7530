"""Static record-level batching with Hugging Face transformers ``generate`` (run by bench_batch.py).

Runs in the vLLM venv's python (it has torch and transformers; the kvflow venv has neither):

    python -P hf_static.py MODEL_DIR PROMPTS.json BATCH DTYPE

PROMPTS.json is ``[{"prompt": [token ids], "output": n}, ...]``. Records are taken in order,
``BATCH`` at a time, left-padded to the longest prompt, and generated together until the
batch's longest output is done (``min_new_tokens = max_new_tokens``: no record stops early, as
vLLM's ``ignore_eos``/``min_tokens`` make it run to its length); each record's answer is then cut
to its own length. Prints one JSON line: wall seconds, this process's CPU seconds (all its
threads), useful and computed output tokens.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, prompts_path, batch, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    records = json.loads(open(prompts_path).read())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    pad = int(model.config.pad_token_id or 0)
    useful = computed = 0
    with torch.inference_mode():  # warm-up, untimed (first calls initialise kernels and caches)
        model.generate(input_ids=torch.tensor([records[0]["prompt"]]), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
    cpu0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(records), batch):
            group = records[start:start + batch]
            width = max(len(r["prompt"]) for r in group)
            ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in group])
            mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in group])
            longest = max(r["output"] for r in group)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad)
            new = out[:, width:]
            assert new.shape[1] == longest, new.shape
            useful += sum(r["output"] for r in group)  # each record keeps its own length
            computed += longest * len(group)
    print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0, "useful_tokens": useful,
                      "computed_tokens": computed, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
