"""Builders for engine-level tests: requests and schedulers with a fake clock and fixed outputs."""

from __future__ import annotations

import random
from typing import Any

from kvflow.sim.request import BlockHasher, HashConfig, LoraAdapter, SimRequest
from kvflow.sim.scheduler import Scheduler, SchedulerConfig

SEED = "0"


def fixed_sampler(req: SimRequest) -> tuple[int, str]:
    """Output token k of every request is 1000 + k, text ' t<k>'."""
    k = len(req.output_ids)
    return 1000 + k, f" t{k}"


def make_scheduler(**overrides: Any) -> Scheduler:
    config = SchedulerConfig(**{"block_size": 4, "num_blocks": 17, "max_num_seqs": 8, **overrides})
    return Scheduler(config, fixed_sampler)


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 4, *, block_size: int = 4, stop: tuple[str, ...] = (),
    kv: dict[str, Any] | None = None, lora: LoraAdapter | None = None, cache_salt: str | None = None,
) -> SimRequest:
    return SimRequest(
        request_id=rid,
        prompt_ids=list(prompt),
        max_tokens=max_tokens,
        hasher=BlockHasher(HashConfig(block_size, SEED, "sha256"), lora, cache_salt),
        rng=random.Random(0),
        arrival=0.0,
        stop=stop,
        kv_transfer_params=kv,
        lora=lora,
    )


def run_steps(sched: Scheduler, n: int, t0: float = 0.0) -> list[list[str]]:
    """Run ``n`` steps at times t0+1, t0+2, ...; return the ids that produced a token in each."""
    out = []
    for i in range(n):
        plan = sched.schedule(t0 + i)
        out.append([r.request_id for r in sched.complete(plan, t0 + i + 1)])
    return out


def run_until_idle(sched: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while sched.has_work() and steps < limit:
        plan = sched.schedule(float(steps))
        sched.complete(plan, float(steps) + 1)
        steps += 1
    return steps
