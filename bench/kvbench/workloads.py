"""Seeded, deterministic request traces for the routing benchmark (pure: no I/O).

A ``Trace`` is what the load generator sends and what the oracle replays: prompts, output
lengths, per-request sampling seeds and open-loop (Poisson) send times. A request of a
multi-turn session waits for the previous turn's answer, then a think time: its ``at`` is that
think time and ``after`` names the previous turn. Every other request is sent at ``at`` seconds
from the start whatever happens to the others (open loop).

Prompts are words ``w<n>``: the simulator's built-in tokenizer makes each one token, so
lengths below are in tokens. Answers are deterministic (each request carries a ``seed``), so
the history a multi-turn session sends is known in advance and is the same whichever router
runs; ``answer`` is what the simulator will answer, drawn with its own sampler.

Shapes (``SHAPES``), scaled to a 2-core machine:

* ``shared-prefix`` — llm-d's shared-prefix benchmark (inference-perf ``shared_prefix``:
  150 groups x 5 prompts, 6,000-token system prompt, 1,200-token question, 1,000 output
  tokens) with its prompt lengths kept and the rest scaled: 16 groups x 5 prompts and 32 output
  tokens. Each arrival picks one of the 80 (group, question) prompts uniformly.
* ``zipf-tenants`` — 48 tenants with system prompts of 2,000-7,000 tokens, picked with Zipf
  popularity (s = 1.1: the top three tenants take 46 % of the traffic), each request a
  fresh 300-1,000-token question.
* ``multi-turn`` — sessions of 5 turns over 32 shared 3,000-token system prompts; each turn
  adds a 400-1,000-token user message, and the next turn carries the whole history, answers
  included. Sessions arrive as a Poisson process at ``rate / turns``; the user thinks
  (exponential, mean 1 s) after each answer.

Pods get 2,400 KV blocks (38,400 tokens) each: one pod holds about five system prompts of (a),
so only a router that partitions the prefixes keeps them all cached.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

VOCAB = 20000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    at: float
    """Send time from the start; for a follow-up turn, the think time after ``after`` answered."""
    prompt: str
    max_tokens: int
    seed: int
    group: str
    """Prefix group, tenant or session: what a perfect router would keep together."""
    after: int | None = None
    answer: str = ""
    """The simulator's answer (drawn with ``seed``); follow-up turns carry it in their history."""


def after_warmup(sent: float, warmup: float) -> bool:
    """Whether a request sent at ``sent`` seconds counts in a run's figures: every request
    without a warm-up, else those sent at or after it (one never sent, NaN, does not)."""
    return not warmup or sent >= warmup


@dataclass(frozen=True, slots=True)
class Trace:
    shape: str
    rate: float
    duration: float
    """Seconds of arrivals, the warm-up's included."""
    requests: tuple[TraceRequest, ...]
    warmup: float = 0.0
    """Seconds of arrivals at the start that fill the caches and count in no figure
    (``after_warmup``): the run measures steady state, not the first sight of each prefix."""

    def children(self) -> dict[int, int]:
        """Request index -> the follow-up turn that waits for it."""
        return {r.after: r.index for r in self.requests if r.after is not None}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def shared_prefix(rate: float, duration: float, seed: int = 0, *, groups: int = 16, per_group: int = 5,
                  system_len: int = 6000, question_len: int = 1200, output_len: int = 32) -> Trace:
    rng = random.Random(f"shared-prefix/{seed}")
    systems = [_words(rng, system_len) for _ in range(groups)]
    questions = [[_words(rng, question_len) for _ in range(per_group)] for _ in range(groups)]
    arrivals = random.Random(f"shared-prefix/{seed}/{rate:g}")
    requests = []
    for i, at in enumerate(_poisson(arrivals, rate, duration)):
        g, q = arrivals.randrange(groups), arrivals.randrange(per_group)
        requests.append(TraceRequest(i, at, f"{systems[g]} {questions[g][q]}", output_len, seed * 1_000_003 + i,
                                     f"g{g}"))
    return Trace("shared-prefix", rate, duration, tuple(requests))


def zipf_tenants(rate: float, duration: float, seed: int = 0, *, tenants: int = 48, s: float = 1.1,
                 system_len: tuple[int, int] = (2000, 7000), question_len: tuple[int, int] = (300, 1000),
                 output_len: int = 32) -> Trace:
    rng = random.Random(f"zipf-tenants/{seed}")
    systems = [_words(rng, rng.randint(*system_len)) for _ in range(tenants)]
    weights = [1 / (k + 1) ** s for k in range(tenants)]
    arrivals = random.Random(f"zipf-tenants/{seed}/{rate:g}")
    requests = []
    for i, at in enumerate(_poisson(arrivals, rate, duration)):
        t = arrivals.choices(range(tenants), weights)[0]
        question = _words(arrivals, arrivals.randint(*question_len))
        requests.append(TraceRequest(i, at, f"{systems[t]} {question}", output_len, seed * 1_000_003 + i, f"t{t}"))
    return Trace("zipf-tenants", rate, duration, tuple(requests))


def multi_turn(rate: float, duration: float, seed: int = 0, *, turns: int = 5, systems: int = 32,
               system_len: int = 3000, user_len: tuple[int, int] = (400, 1000), output_len: int = 32,
               think_s: float = 1.0) -> Trace:
    rng = random.Random(f"multi-turn/{seed}")
    prompts = [_words(rng, system_len) for _ in range(systems)]
    arrivals = random.Random(f"multi-turn/{seed}/{rate:g}")
    requests: list[TraceRequest] = []
    for s, start in enumerate(_poisson(arrivals, rate / turns, duration)):
        history = prompts[arrivals.randrange(systems)]
        previous: int | None = None
        for _ in range(turns):
            i = len(requests)
            prompt = f"{history} {_words(arrivals, arrivals.randint(*user_len))}"
            at = start if previous is None else arrivals.expovariate(1 / think_s)
            req_seed = seed * 1_000_003 + i
            answer = sim_answer(req_seed, output_len)
            requests.append(TraceRequest(i, at, prompt, output_len, req_seed, f"s{s}", previous, answer))
            history, previous = prompt + answer, i
    return Trace("multi-turn", rate, duration, tuple(requests))


def sim_answer(seed: int, max_tokens: int) -> str:
    """What ``kvflow sim`` (built-in tokenizer) answers a request with this seed: its sampler,
    drawing ``max_tokens`` words with ``random.Random(seed)``."""
    sampler = _sampler()
    rng = random.Random(seed)
    return "".join(sampler.sample(rng)[1] for _ in range(max_tokens))


@cache
def _sampler():  # type: ignore[no-untyped-def]
    from kvflow.sim.sampler import Sampler
    from kvflow.tokenizer import load_tokenizer

    return Sampler(load_tokenizer(None))


Shape = Callable[..., Trace]
TRACE_SHAPE = "trace"
"""A workload whose ``params`` hold ``("window", kvbench.traces.TraceWindow)``: a file's trace."""
SHAPES: dict[str, Shape] = {"shared-prefix": shared_prefix, "zipf-tenants": zipf_tenants, "multi-turn": multi_turn}


@dataclass(frozen=True, slots=True)
class Workload:
    """A named benchmark case: a trace shape on a pod topology."""

    name: str
    shape: str
    decode_pods: int = 4
    prefill_pods: int = 0
    num_blocks: int = 2400
    """KV blocks per pod (16 tokens each): small enough that no pod holds every prefix."""
    params: tuple[tuple[str, object], ...] = ()
    """The shape's keyword arguments where they differ from its defaults (sizes, counts)."""
    cpu_blocks: int = 0
    """Blocks of each pod's CPU offload tier (``kvflow sim --kv-offloading-size``); 0: none."""
    kv_fraction: float = 0.0
    """A cache-pressure variant's pools, as a fraction of the working set (``kvbench.runner.pressured``);
    0: the workload's own ``num_blocks``."""
    base: str = ""
    """The workload a variant was made from (its description); empty for the workload itself."""

    @property
    def pd(self) -> bool:
        return self.prefill_pods > 0

    def trace(self, rate: float, duration: float, seed: int = 0, warmup: float = 0.0) -> Trace:
        """``duration`` seconds of arrivals after ``warmup`` seconds of them at the same rate."""
        if self.shape == TRACE_SHAPE:  # a recorded trace (kvbench.traces), replayed at ``rate``
            from kvbench.traces import replay

            trace = replay(dict(self.params)["window"], rate, warmup + duration, seed)  # type: ignore[arg-type]
        else:
            trace = SHAPES[self.shape](rate, warmup + duration, seed, **dict(self.params))
        return replace(trace, warmup=warmup) if warmup else trace


TIERED = (("groups", 120), ("per_group", 1), ("system_len", 4000), ("question_len", 200), ("output_len", 32))
"""llm-d's tiered-prefix-cache benchmark, scaled: many long system prompts whose total (120 x
4,000 tokens = 30,000 blocks) is three times the four pods' GPU KV (4 x 2,400 blocks), so even a
router that partitions them keeps only a third on the GPUs; with offloading (``e-cpu``) each
pod's CPU tier (32,000 blocks: 62 GiB at h100-llama8b's 2 MiB a block, a small share of a GPU
node's host memory) holds all of them, wherever a router sends them."""

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("a", "shared-prefix"),
        Workload("b", "zipf-tenants"),
        Workload("c", "multi-turn"),
        Workload("d", "shared-prefix", decode_pods=2, prefill_pods=2),
        Workload("e", "shared-prefix", params=TIERED),
        Workload("e-cpu", "shared-prefix", params=TIERED, cpu_blocks=32000),
    )
}
SMOKE = Workload("smoke", "shared-prefix", decode_pods=2, num_blocks=300,
                 params=(("groups", 4), ("per_group", 3), ("system_len", 600), ("question_len", 100), ("output_len", 8)))
"""Two pods and a few short shared prefixes: a workload the tests replay, or run live, in seconds."""
def describe(workload: Workload) -> str:
    if workload.shape == TRACE_SHAPE:
        text: str = dict(workload.params)["window"].describe()  # type: ignore[attr-defined]
        return text + (f"; pools hold {workload.kv_fraction:.0%} of the working set" if workload.kv_fraction else "")
    text = DESCRIPTIONS.get(workload.base or workload.name, f"{workload.shape} {dict(workload.params)}")
    if workload.kv_fraction:
        text += f"; pools hold {workload.kv_fraction:.0%} of the working set ({workload.num_blocks} blocks a pod)"
    return text


DESCRIPTIONS = {
    "a": "llm-d shared prefix (16 groups x 5 prompts, 6000+1200 tokens)",
    "b": "skewed multi-tenant (48 Zipf tenants, 2000-7000 + 300-1000 tokens)",
    "c": "multi-turn chat (5 turns, growing history)",
    "d": "shared prefix with P/D (2 prefill + 2 decode pods)",
    "e": "tiered prefix (120 system prompts x 4000 + 200 tokens, 3x GPU KV), no offloading",
    "e-cpu": "tiered prefix (120 system prompts x 4000 + 200 tokens), 32000-block CPU tier per pod",
}
