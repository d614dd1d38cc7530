"""What the best router could do: a trace replayed offline on the simulator's own model.

``replay`` is a discrete-event simulation of ``N`` pods, each running the simulator's pure
``Scheduler`` (continuous batching, chunked prefill, the paged prefix cache with its LRU) and
stepping on the timing profile's formula (``Profile.step_seconds``) — the same code
``kvflow sim`` runs in real time, here on a virtual clock with no HTTP, no event-loop jitter and
no CPU contention. A ``Policy`` picks each request's pod at its arrival:

* ``RoundRobin`` — calibration: its replayed TTFT, set beside round-robin measured on live pods,
  says how far the live run is from the model (HTTP, streaming, a loaded 2-core machine).
* ``Clairvoyant`` — the oracle: it sees every pod's true prefix cache (the exact blocks), its
  queue and running batch, and the prefixes that queued requests will have cached by the time
  this one runs, and sends each request to the pod with the smallest estimated TTFT plus, with
  a capacity weight, the prefill compute the choice takes from that pod (what it costs later
  requests). ``oracle_replay`` keeps the best of a few weights for each trace. It is a greedy,
  perfectly informed router, not a proven optimum: it does not plan for requests yet to come,
  so a router could beat it (a ratio below 1 in the table says so).

``lower_bound`` is a provable bound instead: no router, on this simulator, can give request
``i`` a TTFT below the time its pod needs just to compute the prompt tokens no earlier request
could have cached (the longest block-aligned prefix it shares with any earlier request, its
own earlier turns included), alone in the batch, in as few chunks as the token budget allows.
Each measured TTFT is at least its request's bound, so the bound's mean and every percentile
are below any router's.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Protocol

from kvflow.hashing import BlockHash
from kvflow.sim.profiles import Profile
from kvflow.sim.request import BlockHasher, HashConfig, SimRequest
from kvflow.sim.scheduler import Scheduler, SchedulerConfig, StepPlan

from kvbench.workloads import Trace, TraceRequest, after_warmup

HASH = HashConfig(16, "0", "sha256")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A trace request's prompt tokens and block hashes, computed once per trace."""

    request: TraceRequest
    token_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]


def prepare(trace: Trace) -> list[Prepared]:
    tok = _tokenizer()
    out = []
    for r in trace.requests:
        ids = tok.encode(r.prompt)
        out.append(Prepared(r, tuple(ids), tuple(BlockHasher(HASH, None, None).update(ids))))
    return out


@dataclass(slots=True)
class Pod:
    index: int
    scheduler: Scheduler
    step_end: float = 0.0
    plan: object | None = None
    routed: int = 0
    expected_uncached: dict[str, int] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    def pick(self, prepared: Prepared, pods: Sequence[Pod], now: float, profile: Profile) -> int | None:
        """The pod to send the request to; None refuses it (a router's 429: the request counts
        as an error, with no time to first token, and a conversation's later turns are not sent)."""
        ...


class Observer(Protocol):
    """What a policy that learns as it goes (a real router, ``kvbench.replay_kvflow``) also hears."""

    scrape_interval: float
    """Seconds between two ``scraped`` calls per pod (0: never)."""

    def first_token(self, index: int, now: float) -> None: ...

    def finished(self, index: int, now: float) -> None: ...

    def stepped(self, pod: Pod, now: float) -> None:
        """After each step: the pod's KV events (its scheduler records them) are the policy's to take."""

    def scraped(self, pod: Pod, now: float) -> None: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, prepared: Prepared, pods: Sequence[Pod], now: float, profile: Profile) -> int:
        self._next += 1
        return (self._next - 1) % len(pods)


class Clairvoyant:
    """Smallest estimated TTFT, from each pod's exact state.

    The estimate: what is left of the step now running, then the prompt tokens queued ahead of
    this request (prefilling requests' remainders, waiting requests' uncached tokens) and its own
    uncached tokens, computed in as many steps as the token budget needs, each step also paying
    for the batch that is decoding meanwhile.
    """

    name = "oracle"

    def __init__(self, capacity_weight: float = 0.0) -> None:
        self.capacity_weight = capacity_weight
        """Also charge the compute the request takes from the pod (its uncached prefill), times
        this: what it costs the requests after it, which a pure TTFT-greedy choice ignores."""

    def pick(self, prepared: Prepared, pods: Sequence[Pod], now: float, profile: Profile) -> int:
        best, best_t = 0, math.inf
        for pod in pods:
            t = self.cost(prepared, pod, now, profile)
            if t < best_t - 1e-9:
                best, best_t = pod.index, t
        return best

    def cost(self, prepared: Prepared, pod: Pod, now: float, profile: Profile, cached: int | None = None) -> float:
        """What sending the request to ``pod`` costs: its estimated TTFT, plus the capacity weight
        times the prefill compute it takes from the pod. ``cached``: ``cached_tokens``, if known."""
        if cached is None:
            cached = self.cached_tokens(prepared, pod)
        t = self.estimate(prepared, pod, now, profile, cached)
        if self.capacity_weight:
            t += self.capacity_weight * (len(prepared.token_ids) - cached) * profile.prefill_per_token_s
        return t

    @staticmethod
    def cached_tokens(prepared: Prepared, pod: Pod) -> int:
        sched = pod.scheduler
        bs = sched.config.block_size
        max_blocks = (len(prepared.token_ids) - 1) // bs
        hashes = prepared.hashes[:max_blocks]
        hit = len(sched.pool.longest_hit(hashes))
        if sched.pool.offload is not None:  # a CPU hit counted as a GPU one: its reload is ~7 % of a prefill
            hit += sched.pool.offload.lookup(hashes[hit:])
        for other in [*sched.waiting, *sched.running]:  # prefixes about to be cached
            if hit == len(hashes):
                break
            theirs = other.hasher.hashes
            n = 0
            for a, b in zip(hashes, theirs):
                if a != b:
                    break
                n += 1
            hit = max(hit, n)
        return hit * bs

    def estimate(self, prepared: Prepared, pod: Pod, now: float, profile: Profile, cached: int | None = None) -> float:
        sched = pod.scheduler
        own = len(prepared.token_ids) - (self.cached_tokens(prepared, pod) if cached is None else cached)
        ahead, decoding, ctx = after_step(pod)
        tokens = ahead + own
        steps = max(1, math.ceil(tokens / sched.config.max_num_batched_tokens))
        step = profile.step_base_s + decoding * profile.decode_per_seq_s + ctx * profile.decode_per_ctx_token_s
        return max(0.0, pod.step_end - now) + steps * step + tokens * profile.prefill_per_token_s


def after_step(pod: Pod) -> tuple[int, int, int]:
    """The pod once the step now running ends (at ``step_end``, having computed its chunks):
    prompt tokens still to compute (running prompts' rest, waiting requests' uncached tokens),
    requests decoding, and their context tokens. A prompt the step finishes decodes from then on."""
    sched = pod.scheduler
    in_step = {id(req): n for req, n in pod.plan.scheduled} if isinstance(pod.plan, StepPlan) else {}
    ahead = decoding = ctx = 0
    for req in sched.running:
        computed = req.num_computed + in_step.get(id(req), 0)
        if computed < len(req.prompt_ids):
            ahead += len(req.prompt_ids) - computed
        else:
            decoding += 1
            ctx += computed
    for req in sched.waiting:
        ahead += pod.expected_uncached.get(req.request_id, len(req.all_token_ids))
    return ahead, decoding, ctx


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    ttft: tuple[float, ...]
    """Seconds, per trace request (NaN for one that never got a token)."""
    finished: tuple[float, ...]
    requests_per_pod: tuple[int, ...]
    hit_rate: float
    placements: tuple[int, ...] = ()
    """The pod each trace request was sent to (-1: refused, or never sent)."""
    reload_rate: float = 0.0
    """Prompt tokens loaded back from the pods' CPU offload tiers over those queried (no part of
    ``hit_rate``: vLLM counts them as external hits)."""
    sent: tuple[float, ...] = ()
    """Per trace request, when it was sent (NaN: never)."""
    prompt_tokens: tuple[int, ...] = ()
    """Per trace request, the prompt tokens its pod looked up (0: never scheduled)."""
    hit_tokens: tuple[int, ...] = ()
    """Of them, those its pod's GPU cache held."""
    reloaded_tokens: tuple[int, ...] = ()
    """And those its pod's CPU tier loaded back."""

    def since(self, warmup: float) -> ReplayResult:
        """The result of the requests sent at or after ``warmup`` seconds only (all of them at 0),
        hit rates and requests per pod included."""
        if not warmup:
            return self
        keep = [i for i, t in enumerate(self.sent) if after_warmup(t, warmup)]

        def kept(values: Sequence[Any]) -> tuple[Any, ...]:
            return tuple(values[i] for i in keep)

        placements, looked_up = kept(self.placements), kept(self.prompt_tokens)
        hits, reloads, queried = kept(self.hit_tokens), kept(self.reloaded_tokens), sum(looked_up)
        return replace(
            self, ttft=kept(self.ttft), finished=kept(self.finished), placements=placements, sent=kept(self.sent),
            requests_per_pod=tuple(placements.count(pod) for pod in range(len(self.requests_per_pod))),
            hit_rate=sum(hits) / queried if queried else 0.0, reload_rate=sum(reloads) / queried if queried else 0.0,
            prompt_tokens=looked_up, hit_tokens=hits, reloaded_tokens=reloads,
        )


def new_pod(index: int, profile: Profile, num_blocks: int, *, events: bool = False, cpu_blocks: int = 0) -> Pod:
    """An idle pod of the replay: the simulator's scheduler, ``num_blocks`` KV blocks (and a
    CPU offload tier of ``cpu_blocks``), the profile's token budget; ``events``: its pool
    records KV events."""
    config = SchedulerConfig(block_size=HASH.block_size, num_blocks=num_blocks,
                             max_num_batched_tokens=profile.max_num_batched_tokens, kv_transfer=False,
                             num_cpu_blocks=cpu_blocks, reload_seconds_per_token=profile.reload_seconds(1))
    return Pod(index, Scheduler(config, _sampler(), enable_events=events))


@dataclass(frozen=True, slots=True)
class Lag:
    """The way between the router and the pods, which the replay otherwise leaves out: a request
    reaches its pod's engine ``to_pod`` seconds after the router picks it, and the router hears
    of each first token and finish ``from_pod`` seconds after the engine produced it; on the
    routing benchmark's live pods ``bench/path_probe.py`` measures both."""

    to_pod: float = 0.0
    from_pod: float = 0.0


def replay(trace: Trace, policy: Policy, *, pods: int, profile: Profile, num_blocks: int,
           prepared: Sequence[Prepared] | None = None, lag: Lag = Lag(), cpu_blocks: int = 0) -> ReplayResult:
    """The trace on ``pods`` simulated pods, each request where ``policy`` picks it. A request's
    TTFT is counted from its arrival at the pod's engine. ``cpu_blocks``: each pod's CPU
    offload tier (``kvflow sim --kv-offloading-size``), 0 for none."""
    prepared = list(prepared) if prepared is not None else prepare(trace)
    observer: Observer | None = policy if hasattr(policy, "stepped") else None  # type: ignore[assignment]
    fleet = [new_pod(i, profile, num_blocks, events=observer is not None, cpu_blocks=cpu_blocks)
             for i in range(pods)]
    n = len(prepared)
    ttft, finished, sent = [math.nan] * n, [math.nan] * n, [math.nan] * n
    looked_up, hit, reloads = [0] * n, [0] * n, [0] * n
    arrival = [0.0] * n
    placed = [-1] * n
    children = trace.children()
    events: list[tuple[float, int, str, int, int]] = []
    seq = 0

    def push(t: float, kind: str, what: int, pod: int = -1) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, what, pod))
        seq += 1

    def start_step(pod: Pod, now: float) -> None:
        plan = pod.scheduler.schedule(now)
        if plan.empty:
            pod.plan = None
            ready = pod.scheduler.next_ready()
            if ready is not None:  # idle until a CPU-tier load is back
                push(ready, "wake", pod.index)
            return
        pod.plan = plan
        pod.step_end = now + profile.step_seconds(plan.num_decoding, plan.decode_ctx_tokens, plan.prefill_tokens,
                                                  plan.reload_tokens)
        push(pod.step_end, "step", pod.index)

    def tell(kind: str, i: int, now: float) -> None:
        if observer is None:
            return
        if lag.from_pod > 0:
            push(now + lag.from_pod, kind, i)
        elif kind == "first":
            observer.first_token(i, now)
        else:
            observer.finished(i, now)

    for p in prepared:
        if p.request.after is None:
            push(p.request.at, "send", p.request.index)
    interval = observer.scrape_interval if observer is not None else 0.0
    if interval > 0:
        for pod in fleet:  # pods are scraped at phases spread over the interval, as the router does
            push(interval * (pod.index + 0.5) / len(fleet), "scrape", pod.index)
    pending_sends = sum(1 for p in prepared)
    while events:
        now, _, kind, what, picked = heapq.heappop(events)
        if kind == "scrape":
            assert observer is not None
            observer.scraped(fleet[what], now)
            if pending_sends or any(p.plan is not None for p in fleet):
                push(now + interval, "scrape", what)
            continue
        if kind == "first":
            observer.first_token(what, now)  # type: ignore[union-attr]
            continue
        if kind == "finish":
            observer.finished(what, now)  # type: ignore[union-attr]
            continue
        if kind == "wake":
            if fleet[what].plan is None:
                start_step(fleet[what], now)
            continue
        if kind == "send":
            pending_sends -= 1
            sent[what] = now
            chosen = policy.pick(prepared[what], fleet, now, profile)
            if chosen is None:  # refused: the conversation's later turns are never sent
                child = children.get(what)
                while child is not None:
                    pending_sends -= 1
                    child = children.get(child)
                continue
            if lag.to_pod > 0:
                push(now + lag.to_pod, "arrive", what, chosen)
                continue
            kind, picked = "arrive", chosen
        if kind == "arrive":
            p, pod = prepared[what], fleet[picked]
            pod.routed += 1
            placed[what] = picked
            req = sim_request(p, now)
            pod.expected_uncached[req.request_id] = len(p.token_ids) - Clairvoyant.cached_tokens(p, pod)
            arrival[what] = now
            pod.scheduler.add(req)
            if pod.plan is None:
                start_step(pod, now)
            continue
        pod = fleet[what]
        assert pod.plan is not None
        produced = pod.scheduler.complete(pod.plan, now)  # type: ignore[arg-type]
        if observer is not None:
            observer.stepped(pod, now)
        for req in produced:
            i = int(req.request_id)
            if len(req.output_ids) == 1:
                ttft[i] = now - arrival[i]
                looked_up[i] = len(req.prompt_ids)  # what its first lookup counted (vLLM's prefix-cache stats)
                hit[i], reloads[i] = req.cached_tokens - req.offloaded_tokens, req.offloaded_tokens
                pod.expected_uncached.pop(req.request_id, None)
                tell("first", i, now)
            if req.finished:
                finished[i] = now
                tell("finish", i, now)
                if i in children:
                    child = children[i]
                    push(now + prepared[child].request.at, "send", child)
        start_step(pod, now)
    hits = sum(p.scheduler.prefix_stats.hits for p in fleet)
    queries = sum(p.scheduler.prefix_stats.queries for p in fleet)
    reloaded = sum(p.scheduler.prefix_stats.external_hits for p in fleet) if cpu_blocks else 0
    return ReplayResult(policy.name, tuple(ttft), tuple(finished), tuple(p.routed for p in fleet),
                        hits / queries if queries else 0.0, tuple(placed), reloaded / queries if queries else 0.0,
                        tuple(sent), tuple(looked_up), tuple(hit), tuple(reloads))


ORACLE_WEIGHTS = (0.0, 1.0, 2.0, 4.0)


def oracle_replay(trace: Trace, *, pods: int, profile: Profile, num_blocks: int,
                  prepared: Sequence[Prepared] | None = None,
                  weights: Sequence[float] = ORACLE_WEIGHTS, cpu_blocks: int = 0) -> tuple[ReplayResult, float]:
    """The oracle: the clairvoyant router with the capacity weight that gives this trace the
    lowest mean TTFT of the requests sent after its warm-up (and that weight). Pure TTFT-greedy
    (weight 0) starves later requests under load; charging the compute a choice takes fixes
    that, by how much depends on the load."""
    prepared = list(prepared) if prepared is not None else prepare(trace)
    best: tuple[ReplayResult, float] | None = None
    best_ttft = math.inf
    for weight in weights:
        result = replay(trace, Clairvoyant(weight), pods=pods, profile=profile, num_blocks=num_blocks,
                        prepared=prepared, cpu_blocks=cpu_blocks)
        ttft = mean_ttft(result.since(trace.warmup).ttft)
        if best is None or ttft < best_ttft:
            best, best_ttft = (result, weight), ttft
    assert best is not None
    return best


def mean_ttft(values: Sequence[float]) -> float:
    """The mean of the TTFTs of the requests that got one (a refused request's is NaN)."""
    done = [v for v in values if not math.isnan(v)]
    return sum(done) / len(done) if done else math.inf


def lower_bound(trace: Trace, profile: Profile, prepared: Sequence[Prepared] | None = None,
                hits: Sequence[int] | None = None) -> tuple[float, ...]:
    """Per request: its TTFT can be no lower than this on the simulator, whatever the router:
    the time to compute, alone in a batch, the prompt tokens past its most hittable blocks
    (``hits``: ``hittable_blocks``, computed here unless given)."""
    prepared = list(prepared) if prepared is not None else prepare(trace)
    hits = hits if hits is not None else hittable_blocks(trace, prepared)
    bs, budget = HASH.block_size, profile.max_num_batched_tokens
    bounds = []
    for p, hit in zip(prepared, hits, strict=True):
        uncached = len(p.token_ids) - hit * bs
        steps = max(1, math.ceil(uncached / budget))
        bounds.append(steps * profile.step_base_s + uncached * profile.prefill_per_token_s)
    return tuple(bounds)


def hit_ceiling(trace: Trace, prepared: Sequence[Prepared] | None = None, hits: Sequence[int] | None = None) -> float:
    """The highest prefix-cache hit rate any router could give the trace on aggregated pods
    (``vllm:prefix_cache_hits / queries``, tokens): every hittable block a hit, as if no pod
    ever evicted. A router's measured hit rate is at most this."""
    prepared = list(prepared) if prepared is not None else prepare(trace)
    hits = hits if hits is not None else hittable_blocks(trace, prepared)
    queried = sum(len(p.token_ids) for p in prepared)
    return sum(hits) * HASH.block_size / queried if queried else 0.0


def working_set_blocks(prepared: Sequence[Prepared]) -> int:
    """The trace's working set in KV blocks: the distinct blocks that more than one request's
    prompt holds, which is what a prefix cache can ever reuse (a block only one prompt holds is
    computed once whatever the pools hold). Sizing pools below it puts the cache under pressure."""
    holders: dict[BlockHash, int] = {}
    for p in prepared:
        for h in set(p.hashes):
            holders[h] = holders.get(h, 0) + 1
    return sum(1 for n in holders.values() if n > 1)


def hittable_blocks(trace: Trace, prepared: Sequence[Prepared]) -> list[int]:
    """Per request: how many of its leading blocks can be a hit at all, whatever the router.

    A prompt block can be a hit only if some request that may be sent before this one holds
    it. An open-loop request is sent at its ``at``, so only requests that can be sent by then
    count (a follow-up turn is sent no earlier than its chain's think times add up to). A
    follow-up turn may be sent arbitrarily late, so every request counts for it except itself
    and its own later turns. As on vLLM, the block holding a prompt's last token is never a hit.
    """
    bs = HASH.block_size
    earliest = [_earliest_send(prepared, i) for i in range(len(prepared))]
    later_turns = _later_turns(trace)
    first_two: dict[BlockHash, list[tuple[float, int]]] = {}  # the two earliest holders of a block
    holders: dict[BlockHash, int] = {}
    for i, p in enumerate(prepared):
        answer_ids = _tokenizer().encode(p.request.answer, add_special_tokens=False) if p.request.answer else []
        for h in set(BlockHasher(HASH, None, None).update([*p.token_ids, *answer_ids])):
            holders[h] = holders.get(h, 0) + 1
            first_two[h] = sorted([*first_two.get(h, []), (earliest[i], i)])[:2]

    def held_before(i: int, h: BlockHash) -> bool:
        if prepared[i].request.after is not None:  # all but itself and its later turns (which hold h)
            return holders.get(h, 0) > 1 + later_turns[i]
        return any(j != i and t <= earliest[i] for t, j in first_two.get(h, []))

    hits = []
    for i, p in enumerate(prepared):
        max_blocks = (len(p.token_ids) - 1) // bs
        hit = 0
        while hit < max_blocks and held_before(i, p.hashes[hit]):
            hit += 1
        hits.append(hit)
    return hits


def _earliest_send(prepared: Sequence[Prepared], i: int) -> float:
    """A follow-up turn is sent no earlier than the sum of the think times before it."""
    t, r = 0.0, prepared[i].request
    while True:
        t += r.at
        if r.after is None:
            return t
        r = prepared[r.after].request


def _later_turns(trace: Trace) -> list[int]:
    """Per request, how many turns of its session follow it (each carries its whole prompt)."""
    children = trace.children()
    counts = []
    for r in trace.requests:
        n, i = 0, r.index
        while i in children:
            i, n = children[i], n + 1
        counts.append(n)
    return counts


def saturation_rate(make_trace: Callable[[float, float], Trace], duration: float, *, pods: int, profile: Profile,
                    num_blocks: int, knee: float = 3.0, limit: float = 200.0, cpu_blocks: int = 0) -> float:
    """The request rate where round-robin saturates on the replay: the first rate (doubling from
    2 req/s, then bisection) whose mean TTFT exceeds ``knee`` times the mean at 1 req/s.
    ``make_trace(rate, duration)`` builds the workload's trace."""

    def mean_ttft(rate: float, seconds: float) -> float:
        result = replay(make_trace(rate, seconds), RoundRobin(), pods=pods, profile=profile, num_blocks=num_blocks,
                        cpu_blocks=cpu_blocks)
        done = [t for t in result.ttft if not math.isnan(t)]
        return sum(done) / len(done) if done else math.inf

    base = mean_ttft(1.0, max(duration, 60.0))  # enough requests to average over, cold misses included
    lo, hi = 1.0, 2.0
    while mean_ttft(hi, duration) <= knee * base:
        lo, hi = hi, hi * 2
        if hi > limit:
            return limit
    for _ in range(4):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_ttft(mid, duration) <= knee * base else (lo, mid)
    return hi


def sim_request(p: Prepared, now: float) -> SimRequest:
    """The simulator's request for ``p`` arriving at a pod at ``now``: its prompt, its block
    hashes (computed once, in ``prepare``) and its own sampling seed."""
    hasher = BlockHasher(HASH, None, None)
    hasher.hashes = list(p.hashes)
    return SimRequest(str(p.request.index), list(p.token_ids), p.request.max_tokens, hasher,
                      random.Random(p.request.seed), now)


@cache
def _tokenizer():  # type: ignore[no-untyped-def]
    from kvflow.tokenizer import load_tokenizer

    return load_tokenizer(None)


@cache
def _sampler():  # type: ignore[no-untyped-def]
    from kvflow.sim.sampler import Sampler

    return Sampler(_tokenizer())
