"""The engine: the pure ``Scheduler`` stepped on a computed timeline, delivered on the event loop.

vLLM v1's engine core runs apart from its API server: a slow front end (a /metrics render, a
burst of requests being parsed, KV events being published) delays the delivery of tokens, never
the GPU's steps. The simulator keeps that separation in time rather than in a second process
(docs/simulator.md, "Timeline", says why):

* A step starts when the previous one ends in simulated time or, when the engine was idle or
  blocked, when the work that woke it arrived; it lasts the profile's modelled time. Its tokens
  carry the step's end as their time (``first_token_at``, TTFT/ITL/e2e in the metrics, the KV
  events' batch time) however late the event loop gets round to delivering them, and are not
  delivered before it (give or take the clock's timer resolution, 1 ms on uvloop).
* Outside events (a new request, a finished KV pull, blocks released by a transfer, an abort)
  are stamped with the clock when they happen and take effect at the first step boundary at or
  after their stamp, so a step planned late, while the engine catches up after a stall, sees
  only what had arrived by its simulated start.
* ``poll()`` advances the timeline to the clock's now by at most one step; the driver (``_run``)
  sleeps until the in-flight step's end and polls again. After a stall it wakes late and replays
  the missed steps back to back, one per loop turn, at their simulated times. When a step ends
  the driver lets its requests write their tokens before it publishes the step's KV events and
  plans the next step (vLLM's output thread sends them while the engine core schedules on).
* A process further behind than ``max_lag_s`` is overloaded rather than stalled (its own work
  per step exceeds the modelled step): simulated time then slips forward to now, and the slip is
  counted (``slipped_seconds``, ``kvflow_sim:engine_slip_seconds_total``). The default allows 16
  of the profile's minimal steps, at most 100 ms (``--engine-max-lag``); the ``instant`` profile,
  whose steps take no time, runs at the wall clock.

The engine is also the ``KVHost`` a ``KVTransfer`` attaches to: the pool's geometry, and the
pinned blocks of exported prefill requests, which the transfer unpins. It parses a request's
``kv_transfer_params`` (``KvTransferParams``) for the transfer; params it cannot parse make the
pull fail (``bad_params``) and the request prefill locally. Transfers are real I/O and take wall
time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvflow.protocol.kv_transfer import InvalidKvTransferParams, KvTransferParams
from kvflow.sim.clock import Clock, MonotonicClock
from kvflow.sim.events import ZmqPublisher
from kvflow.sim.faults import Faults
from kvflow.sim.kv_transfer import KVTransfer, PullResult
from kvflow.sim.metrics import EngineGauges, SimMetrics
from kvflow.sim.profiles import Profile
from kvflow.sim.request import SimRequest, Status
from kvflow.sim.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)


MAX_LAG_S = 0.1
LAG_STEPS = 16


def default_max_lag(profile: Profile) -> float:
    """How far behind the clock the engine may replay its timeline before time slips."""
    return min(MAX_LAG_S, LAG_STEPS * profile.step_base_s)


@dataclass(frozen=True, slots=True)
class Step:
    plan: StepPlan
    start: float
    end: float


Apply = Callable[[float], object]
"""An outside event's effect on the scheduler, given the event's stamp."""


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        profile: Profile,
        *,
        transfer: KVTransfer,
        metrics: SimMetrics | None = None,
        publisher: ZmqPublisher | None = None,
        faults: Faults | None = None,
        bytes_per_block: int = 4096,
        clock: Clock | None = None,
        max_lag_s: float | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.profile = profile
        self.transfer = transfer
        self.metrics = metrics
        self.publisher = publisher
        self.faults = faults or Faults()
        self.clock: Clock = clock or MonotonicClock()
        self.max_lag_s = default_max_lag(profile) if max_lag_s is None else max_lag_s
        if not self.max_lag_s >= 0:
            raise ValueError(f"the engine's max lag must be a number of seconds >= 0, got {max_lag_s}")
        self.block_size = scheduler.config.block_size
        self.num_blocks = scheduler.config.num_blocks
        self.bytes_per_block = bytes_per_block
        self._now = self.clock.now()
        self._inflight: Step | None = None
        self._parked = True  # idle, or blocked until an outside event: time jumps to the next one
        self._inbox: deque[tuple[float, Apply]] = deque()  # stamps in clock order
        self._aborted: set[str] = set()  # aborted by the client; the abort takes effect at the next boundary
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pulls: set[asyncio.Task[None]] = set()
        self._scaled: tuple[float, Profile] = (1.0, profile)
        self.steps = 0
        self.busy_seconds = 0.0
        """Simulated time spent in steps."""
        self.slipped_seconds = 0.0
        transfer.attach(self)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.transfer.start()
        if self.publisher is not None:
            await self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        for task in [self._task, *self._pulls]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.transfer.stop()
        if self.publisher is not None:
            await self.publisher.close()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def now(self) -> float:
        """Simulated time: the end of the last step, or when the engine last woke from idle."""
        return self._now

    # -- outside events --------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        """Queue ``req``; its arrival is now on the engine's clock."""
        req.arrival = self.clock.now()
        if self.scheduler.config.kv_transfer and req.wants_remote_prefill:
            # from now until its pull ends, keep the prefill pod's blocks alive (vLLM 0.32's
            # heartbeats): the request may wait for free blocks longer than their lease. Params
            # that do not parse are not tracked (vLLM's rule): the pull will say what is wrong.
            with contextlib.suppress(InvalidKvTransferParams):
                self.transfer.track(req.request_id, KvTransferParams.from_wire(req.kv_transfer_params))
        self._post(req.arrival, lambda _: self.scheduler.add(req))

    def abort(self, request_id: str) -> None:
        """The client went away. Like vLLM's output processor, stop counting and delivering its
        tokens now; the scheduler drops it (and frees its blocks) at the next step boundary."""
        self.transfer.untrack(request_id)
        self._aborted.add(request_id)
        self._post(self.clock.now(), lambda at: self._drop(request_id, at))

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.pool.reset()
        self._flush_events(self.clock.now())
        return ok

    def gauges(self) -> EngineGauges:
        sched = self.scheduler

        def loras(reqs: Iterable[SimRequest]) -> list[str]:
            return sorted({r.lora.name for r in reqs if r.lora is not None})

        return EngineGauges(
            running=lambda: len(sched.running),
            waiting=lambda: sched.num_waiting,
            deferred=lambda: len(sched.remote_waiting) + len(sched.loading),
            kv_usage=lambda: sched.pool.usage,
            prefix_queries=lambda: sched.prefix_stats.queries,
            prefix_hits=lambda: sched.prefix_stats.hits,
            external_queries=lambda: sched.prefix_stats.external_queries,
            external_hits=lambda: sched.prefix_stats.external_hits,
            preemptions=lambda: sched.num_preemptions,
            lora_running=lambda: loras(sched.running),
            lora_waiting=lambda: loras([*sched.waiting, *sched.remote_waiting.values()]),
            slipped_seconds=lambda: self.slipped_seconds,
            offload_stored_tokens=lambda: (sched.pool.offload.stored_blocks * self.block_size
                                           if sched.pool.offload is not None else 0),
        )

    def _post(self, at: float, apply: Apply) -> None:
        self._inbox.append((at, apply))
        self._wake.set()

    def _drop(self, request_id: str, at: float) -> None:
        self._aborted.discard(request_id)
        if self.scheduler.abort(request_id, at) is not None:
            self._flush_events()

    # -- KVHost ----------------------------------------------------------------------------
    def unpin(self, request_id: str) -> None:
        self._post(self.clock.now(), lambda _: self.scheduler.unpin(request_id))

    def claim_export(self, request_id: str) -> bool:
        """A decode pod pulls an exported request's blocks: release them to it (modelled P/D)."""
        if request_id not in self.scheduler.pinned:
            return False
        self.transfer.release(request_id)
        return True

    # -- the timeline ----------------------------------------------------------------------
    def poll(self) -> float | None:
        """Advance the timeline to the clock's now by at most one step. Returns when to poll
        again (the in-flight step's end), or None when idle or blocked until an outside event."""
        if (end := self._finish_step()) is not None:
            return end
        self._plan(self.clock.now())
        return None if self._inflight is None else self._inflight.end

    def _finish_step(self) -> float | None:
        """Complete the in-flight step if it has ended (its tokens go to their requests), else
        return its end."""
        step = self._inflight
        if step is not None:
            if step.end > self.clock.now() + self.clock.resolution:
                return step.end
            self._inflight = None
            self._complete(step)
        return None

    def _plan(self, wall: float) -> None:
        self._flush_events()  # the last step's, stamped with its end
        sched = self.scheduler
        while True:
            if self._parked:
                # time jumps to the event that wakes it: an outside one, or a CPU-tier load back
                due = [t for t in (self._inbox[0][0] if self._inbox else None, sched.next_ready())
                       if t is not None and t <= wall]
                if not due:
                    return
                self._now = max(self._now, min(due))
                self._parked = False
            lag = wall - self._now
            if lag > self.max_lag_s:
                if self.max_lag_s > 0:  # a zero-time profile keeps no timeline, so it never slips
                    self.slipped_seconds += lag
                self._now = wall
            while self._inbox and self._inbox[0][0] <= self._now:
                at, apply = self._inbox.popleft()
                apply(at)
            plan = sched.schedule(self._now) if sched.has_work() else None
            for req in plan.pulls if plan is not None else ():
                self._start_pull(req)
            loaded = plan.reload_tokens + plan.loads_started if plan is not None else 0
            if self.metrics is not None and loaded:
                self.metrics.on_offload_load(loaded, self.profile.reload_seconds(loaded))
            if plan is None or plan.empty:
                self._flush_events()
                self._parked = True
                continue
            seconds = self._current_profile().step_seconds(
                plan.num_decoding, plan.decode_ctx_tokens, plan.prefill_tokens, plan.reload_tokens)
            self._inflight = Step(plan, self._now, self._now + seconds)
            return

    def _complete(self, step: Step) -> None:
        self._now = step.end
        produced = self.scheduler.complete(step.plan, step.end)
        self.steps += 1
        self.busy_seconds += step.end - step.start
        self._after_step(step.plan.num_decoding + step.plan.prefill_tokens, produced, step.end)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            if self._inflight is not None:
                if (end := self._finish_step()) is not None:  # still running
                    await self.clock.sleep_until(end)
                    continue
                # Like vLLM's engine core, whose output thread sends a step's tokens while the
                # next step is scheduled: the requests write theirs before this loop publishes
                # the step's KV events and plans (and hashes prompts for) the next one.
                await asyncio.sleep(0)
            deadline = self.poll()
            if deadline is None:
                deadline = self.scheduler.next_ready()  # a CPU-tier load in flight wakes it too
                if deadline is None:
                    await self._wake.wait()
                    continue
                await self._wake_or_sleep(deadline)
            else:
                await self.clock.sleep_until(deadline)

    async def _wake_or_sleep(self, deadline: float) -> None:
        """Until an outside event or ``deadline``, whichever comes first."""
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self.clock.sleep_until(deadline))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _current_profile(self) -> Profile:
        factor = self.faults.slow_factor
        if factor != self._scaled[0]:
            self._scaled = (factor, self.profile.scaled(factor))
        return self._scaled[1]

    def _after_step(self, num_tokens: int, produced: list[SimRequest], now: float) -> None:
        metrics = self.metrics
        last_tokens: dict[float, int] = {}  # previous token time -> requests (one gap each)
        delivered = 0
        for req in produced:
            aborted = req.request_id in self._aborted
            if len(req.output_ids) == 1:
                if metrics is not None and not aborted:
                    metrics.on_first_token(req)
            elif req.last_token_at is not None and not aborted:
                last_tokens[req.last_token_at] = last_tokens.get(req.last_token_at, 0) + 1
            req.last_token_at = now
            if req.status is Status.FINISHED:
                self._on_finished(req, counted=not aborted)
            if aborted:
                continue
            delivered += 1
            if req.notify is not None:
                req.notify()
        if metrics is not None:
            metrics.on_step(num_tokens, delivered)
            metrics.on_token_gaps({now - t: n for t, n in last_tokens.items()})

    def _on_finished(self, req: SimRequest, *, counted: bool) -> None:
        if req.request_id in self.scheduler.pinned:
            # exported even when aborted: the transfer's lease then frees the blocks
            req.kv_transfer_out = self._export(req)
        if self.metrics is not None and counted:
            self.metrics.on_finished(req)

    def _export(self, req: SimRequest) -> dict[str, Any]:
        """The prefill side's answer, shaped like vLLM NixlConnector's ``request_finished``: where
        the transfer can be reached, plus the request's blocks."""
        block_ids = self.scheduler.pinned[req.request_id]
        exported = self.transfer.export(req.request_id, list(block_ids), req.prompt_ids)
        return dataclasses.replace(
            exported, do_remote_prefill=True, remote_block_ids=(tuple(block_ids),), remote_request_id=req.request_id,
            remote_num_tokens=req.num_prompt_tokens, transfer_mode="pull",
            remote_prefill_cached_tokens=req.cached_tokens,
        ).to_wire()

    def _start_pull(self, req: SimRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(req))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull(self, req: SimRequest) -> None:
        local = req.block_ids[req.num_cached_blocks :]
        try:
            result = await self._pull_params(req, local)
        except Exception as exc:  # noqa: BLE001 - a broken transfer must not take the engine down
            log.warning("kv pull for %s raised %s", req.request_id, exc)
            ok, seconds = False, 0.0
        else:
            ok, seconds = result.ok, result.seconds
            if not ok:
                log.info("kv pull for %s failed (%s); prefilling locally", req.request_id, result.reason)
        finally:
            self.transfer.untrack(req.request_id)  # done, failed or cancelled: its lease needs no renewal
        req.pull_seconds = seconds
        if not ok and self.metrics is not None:
            self.metrics.pd_fallbacks.inc()
        self._post(self.clock.now(), lambda at: self.scheduler.remote_done(req, ok, at))

    async def _pull_params(self, req: SimRequest, local: list[int]) -> PullResult:
        try:
            params = KvTransferParams.from_wire(req.kv_transfer_params)
        except InvalidKvTransferParams as exc:  # vLLM too prefills locally with params it cannot use
            return PullResult(False, 0.0, 0, f"bad_params: {exc}")
        return await self.transfer.pull(params, local, req.prompt_ids)

    def _flush_events(self, at: float | None = None) -> None:
        """Publish the pool's events, stamped with the simulated time they happened at (``at``,
        default the engine's now: vLLM stamps a batch when its step ends), as Unix time."""
        events = self.scheduler.pool.take_events()
        if events and self.publisher is not None:
            happened = self._now if at is None else at
            self.publisher.publish(events, ts=time.time() - (self.clock.now() - happened))
