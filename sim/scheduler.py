"""The continuous-batching scheduler, as pure logic over a fake-able clock value.

Each call to ``schedule(now)`` plans one engine step, vLLM v1 style (no prefill/decode phases,
just "tokens to compute" per request):

1. Running requests first, in arrival order. A request still prefilling gets a chunk of its
   remaining prompt within the step's token budget; a decoding request gets one token. If a
   request needs a new block and the pool is empty, the most recently admitted running request
   is preempted (its blocks freed, its progress dropped; it re-queues at the front, as vLLM's
   recompute preemption does).
2. Then waiting requests in order, while fewer than ``max_num_seqs`` run and budget remains:
   look up the longest cached prefix (capped at ``num_tokens - 1`` so one token is always
   computed), take references on those blocks, allocate the rest; stop at the first that does
   not fit (no overtaking). A decode request of a P/D pair (``do_remote_prefill``) instead gets
   blocks for its whole prompt and goes to ``WAITING_FOR_REMOTE_KVS`` until its pull finishes.
3. Blocks a step will fill enter the prefix cache when they are allocated, before the step
   computes them, as vLLM's ``allocate_slots`` caches them: a request scheduled later in the
   same step (or while an earlier one's long prompt is still being chunked) reuses them instead
   of computing the prefix again. The engine publishes the step's events when it ends.

``complete(plan, now)`` then applies the step: computed tokens advance, a request whose tokens
are all computed samples one new token, finished requests release their blocks (or keep them
pinned for a remote decode).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.sim.kvcache import BlockPool, CpuTier, StoreInfo
from kvflow.sim.request import SimRequest, Status

Sample = Callable[[SimRequest], tuple[int, str]]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_transfer: bool = True
    """Honour P/D ``kv_transfer_params`` (pin on remote decode, pull on remote prefill)."""
    num_cpu_blocks: int = 0
    """CPU offload pool size in blocks (``--kv-offloading-size``); 0: no offloading."""
    reload_seconds_per_token: float = 0.0
    """How long loading a token's KV back from the CPU tier takes. > 0: loads are asynchronous,
    as vLLM's (the request waits in ``WAITING_FOR_REMOTE_KVS`` until its blocks are back, the
    others run on); 0: a load is charged to the step that admits the request (``reload_tokens``)."""


@dataclass(slots=True)
class StepPlan:
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    pulls: list[SimRequest] = field(default_factory=list)
    """Requests that just got blocks for a remote prefill's KV and now wait for the pull."""
    preempted: list[SimRequest] = field(default_factory=list)
    num_decoding: int = 0
    decode_ctx_tokens: int = 0
    prefill_tokens: int = 0
    reload_tokens: int = 0
    """Prompt tokens whose KV this step loads back from the CPU tier instead of computing (the
    synchronous model: their copy is part of the step's time)."""
    loads_started: int = 0
    """Prompt tokens whose asynchronous load from the CPU tier began at this step."""

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0
    hits: int = 0
    external_queries: int = 0
    external_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, sample: Sample, *, enable_events: bool = True) -> None:
        self.config = config
        offload = CpuTier(config.num_cpu_blocks, config.block_size, enable_events) if config.num_cpu_blocks else None
        self.pool = BlockPool(config.num_blocks, enable_events=enable_events, offload=offload)
        self.sample = sample
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.remote_waiting: dict[str, SimRequest] = {}
        self.loading: dict[str, tuple[float, SimRequest]] = {}
        """Requests whose blocks are being loaded back from the CPU tier, and when they are back."""
        self.pinned: dict[str, list[int]] = {}
        self.prefix_stats = PrefixStats()
        self.num_preemptions = 0
        self.requests: dict[str, SimRequest] = {}

    # -- intake ----------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote_waiting) + len(self.loading)

    def next_ready(self) -> float | None:
        """When the first CPU-tier load in flight completes (None: none is)."""
        return min((t for t, _ in self.loading.values()), default=None)

    # -- planning --------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        if self.loading:
            self._finish_loads(now)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(plan, budget)
        if not plan.preempted:
            self._schedule_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            num_new = min(len(req.all_token_ids) - req.num_computed, budget)
            if num_new <= 0:
                continue
            if not self._grow(req, req.num_computed + num_new, plan):
                continue
            self._cache_full_blocks(req, req.num_computed + num_new)
            budget -= num_new
            self._add_to_plan(plan, req, num_new)
        return budget

    def _grow(self, req: SimRequest, num_tokens: int, plan: StepPlan) -> bool:
        """Give ``req`` blocks for ``num_tokens``, preempting from the back when the pool is dry."""
        need = -(-num_tokens // self.config.block_size) - len(req.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.config.kv_transfer and req.wants_remote_prefill and not req.remote_pull_done:
                if not self._start_remote(req, plan):
                    return
                self.waiting.popleft()
                continue
            if not req.block_ids and req.num_computed == 0:
                self._lookup_prefix(req)
            if req.reloading and self.config.reload_seconds_per_token > 0:
                if not self._start_load(req, plan, now):
                    return
                continue
            num_new = min(len(req.all_token_ids) - req.num_computed, budget)
            need = -(-(req.num_computed + num_new) // self.config.block_size) - len(req.block_ids)
            if need > self.pool.num_free:
                self._unlookup(req)
                return
            if need > 0:
                req.block_ids += self.pool.allocate(need)
            self._cache_full_blocks(req, req.num_computed + num_new)
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = now
            plan.reload_tokens += req.reloading
            req.reloading = 0
            budget -= num_new
            self._add_to_plan(plan, req, num_new)

    def _start_load(self, req: SimRequest, plan: StepPlan, now: float) -> bool:
        """vLLM's asynchronous load (``load_kv_async``): blocks for the GPU hit and the loaded
        tokens, none of the step's budget; the request waits in ``WAITING_FOR_REMOTE_KVS`` and
        the scheduler goes on to the next. Its blocks enter the GPU cache once they are back."""
        need = -(-req.num_computed // self.config.block_size) - len(req.block_ids)
        if need > self.pool.num_free:
            self._unlookup(req)
            return False
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        self.waiting.popleft()
        req.status = Status.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = (now + req.reloading * self.config.reload_seconds_per_token, req)
        plan.loads_started += req.reloading
        req.reloading = 0
        return True

    def _finish_loads(self, now: float) -> None:
        """Loads that are back by ``now``: their requests wait at the queue's head, first back
        first, and are scheduled as cache hits (vLLM's ``_update_waiting_for_remote_kv``)."""
        done = sorted((t, rid) for rid, (t, _) in self.loading.items() if t <= now)
        for _, rid in reversed(done):
            req = self.loading.pop(rid)[1]
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def _lookup_prefix(self, req: SimRequest) -> None:
        """Take references on the longest cached prefix; record vLLM's prefix-cache stats."""
        hashes = req.hasher.update(req.all_token_ids)
        hit: list[int] = []
        if self.config.enable_prefix_caching:
            max_blocks = (len(req.all_token_ids) - 1) // self.config.block_size
            hit = self.pool.longest_hit(hashes[:max_blocks])
        self.pool.touch(hit)
        if hit and req.report_full_cache:
            self.pool.announce(hit, hashes, req.all_token_ids, self._store_info(req))
        req.block_ids = hit
        req.num_cached_blocks = len(hit)
        req.num_computed = len(hit) * self.config.block_size
        local = req.num_computed
        cpu = self.pool.offload
        pulls = self.config.kv_transfer and (req.wants_remote_prefill or req.remote_pull_done)
        if cpu is not None and self.config.enable_prefix_caching and not pulls:  # (P/D with offloading: not modelled)
            # the OffloadingConnector: touch the prompt's blocks, then continue the GPU hit on CPU
            cpu.touch(hashes)
            req.reloading = cpu.lookup(hashes[len(hit):max_blocks]) * self.config.block_size
            req.num_computed += req.reloading
        if req.num_preemptions == 0 and not req.remote_pull_done:
            req.cached_tokens = req.num_computed
            req.offloaded_tokens = req.reloading
            self.prefix_stats.queries += len(req.all_token_ids)
            self.prefix_stats.hits += local
            if cpu is not None:
                self.prefix_stats.external_queries += len(req.all_token_ids) - local
                self.prefix_stats.external_hits += req.reloading
            elif self.config.kv_transfer and req.wants_remote_decode:
                # a P/D request also asks the connector for what the local cache lacks
                self.prefix_stats.external_queries += len(req.all_token_ids) - req.num_computed

    def _unlookup(self, req: SimRequest) -> None:
        """Undo a prefix lookup for a request that could not be admitted this step."""
        if req.remote_pull_done:
            return
        local = req.num_computed - req.reloading
        if req.num_preemptions == 0:
            self.prefix_stats.queries -= len(req.all_token_ids)
            self.prefix_stats.hits -= local
            if self.pool.offload is not None:
                self.prefix_stats.external_queries -= len(req.all_token_ids) - local
                self.prefix_stats.external_hits -= req.reloading
            elif self.config.kv_transfer and req.wants_remote_decode:
                self.prefix_stats.external_queries -= len(req.all_token_ids) - req.num_computed
        self.pool.free(req.block_ids)
        req.block_ids, req.num_computed, req.num_cached_blocks, req.reloading = [], 0, 0, 0

    def _start_remote(self, req: SimRequest, plan: StepPlan) -> bool:
        self._lookup_prefix(req)
        need = -(-len(req.prompt_ids) // self.config.block_size) - len(req.block_ids)
        if need > self.pool.num_free:
            self._unlookup(req)
            return False
        req.block_ids += self.pool.allocate(need)
        req.status = Status.WAITING_FOR_REMOTE_KVS
        self.remote_waiting[req.request_id] = req
        plan.pulls.append(req)
        return True

    def remote_done(self, req: SimRequest, ok: bool, now: float) -> None:
        """A pull finished: on success the prompt's KV is present except the last token's (its
        logits are recomputed locally, as vLLM does); on failure fall back to local prefill."""
        if self.remote_waiting.pop(req.request_id, None) is None:
            return
        req.remote_pull_done = True
        req.pull_ok = ok
        self.prefix_stats.external_queries += len(req.prompt_ids) - req.cached_tokens
        if ok:
            self.prefix_stats.external_hits += len(req.prompt_ids) - req.cached_tokens
            req.num_computed = len(req.prompt_ids) - 1
            self._cache_full_blocks(req, req.num_computed)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _add_to_plan(self, plan: StepPlan, req: SimRequest, num_new: int) -> None:
        plan.scheduled.append((req, num_new))
        if num_new == 1 and req.output_ids:
            plan.num_decoding += 1
            plan.decode_ctx_tokens += req.num_computed
        else:
            plan.prefill_tokens += num_new

    def _preempt(self, req: SimRequest, plan: StepPlan) -> None:
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids, req.num_computed, req.num_cached_blocks = [], 0, 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)
        for i, (r, _) in enumerate(plan.scheduled):
            if r is req:
                del plan.scheduled[i]
                break

    # -- applying a step -------------------------------------------------------------------
    def complete(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Apply a step; return the requests that produced a token (finished ones included)."""
        produced: list[SimRequest] = []
        for req, num_new in plan.scheduled:
            if req.status is not Status.RUNNING:  # aborted during the step
                continue
            req.num_computed += num_new
            if req.num_computed < len(req.all_token_ids):
                continue  # a chunk of a long prompt; no token yet
            self._append_token(req, now)
            produced.append(req)
        return produced

    def _cache_full_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Cache the request's blocks that are full once its first ``num_tokens`` are computed."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        num_full = min(num_tokens // bs, len(req.block_ids))
        first = req.num_cached_blocks
        if num_full <= first:
            return
        hashes = req.hasher.update(req.all_token_ids[: num_full * bs])
        self.pool.cache_blocks(
            req.block_ids[first:num_full], hashes[first:num_full], req.all_token_ids,
            first_index=first, parent=hashes[first - 1] if first else None, info=self._store_info(req),
        )
        req.num_cached_blocks = num_full
        if self.pool.offload is not None:  # the connector writes every block a step fills to CPU
            self.pool.offload.store(hashes[:num_full])
            self.pool.offload.touch(hashes[:num_full])

    def _store_info(self, req: SimRequest) -> StoreInfo:
        lora = req.lora
        return StoreInfo(
            block_size=self.config.block_size,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=req.hasher.event_extra_keys(0),
            later_extra_keys=req.hasher.event_extra_keys(1),
        )

    def _append_token(self, req: SimRequest, now: float) -> None:
        token_id, piece = self.sample(req)
        req.output_ids.append(token_id)
        req.all_token_ids.append(token_id)
        req.text += piece
        if req.first_token_at is None:
            req.first_token_at = now
        reason = self._finish_reason(req)
        if reason is not None:
            self._finish(req, reason, now)

    def _finish_reason(self, req: SimRequest) -> str | None:
        for stop in req.stop:
            at = req.text.find(stop)
            if at >= 0:
                req.text = req.text[:at]
                req.stop_reason = stop
                return "stop"
        if len(req.output_ids) >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.status = Status.FINISHED
        req.finished_at = now
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        if self.config.kv_transfer and req.wants_remote_decode and reason in ("length", "stop"):
            self.pinned[req.request_id] = req.block_ids  # freed by unpin (transfer done or timeout)
        else:
            self.pool.free(req.block_ids)

    # -- outside events --------------------------------------------------------------------
    def unpin(self, request_id: str) -> bool:
        blocks = self.pinned.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def abort(self, request_id: str, now: float) -> SimRequest | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req.status is Status.WAITING_FOR_REMOTE_KVS:
            self.remote_waiting.pop(request_id, None)
            self.loading.pop(request_id, None)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.finish_reason = "abort"
        req.status = Status.FINISHED
        req.finished_at = now
        return req
