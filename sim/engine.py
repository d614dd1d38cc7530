"""The engine loop: runs the pure ``Scheduler`` in real time on the event loop.

One iteration = one engine step: plan, sleep the profile's step time (measured from the step's
start, so Python overhead is absorbed rather than added), apply, publish the step's KV events
as one batch, wake the requests that produced tokens. When there is nothing to run the loop
awaits an ``asyncio.Event`` — an idle simulator uses no CPU.

The engine is also the ``KVHost`` a ``KVTransfer`` attaches to: pinned blocks of exported
prefill requests, and the tokens each block holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from kvflow.sim.events import ZmqPublisher
from kvflow.sim.faults import Faults
from kvflow.sim.kv_transfer import KVTransfer
from kvflow.sim.metrics import EngineGauges, SimMetrics
from kvflow.sim.profiles import Profile
from kvflow.sim.request import SimRequest, Status
from kvflow.sim.scheduler import Scheduler

log = logging.getLogger(__name__)


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
    ) -> None:
        self.scheduler = scheduler
        self.profile = profile
        self.transfer = transfer
        self.metrics = metrics
        self.publisher = publisher
        self.faults = faults or Faults()
        self.block_size = scheduler.config.block_size
        self.num_blocks = scheduler.config.num_blocks
        self.bytes_per_block = bytes_per_block
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pulls: set[asyncio.Task[None]] = set()
        self._scaled: tuple[float, Profile] = (1.0, profile)
        self.steps = 0
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

    # -- requests --------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.scheduler.add(req)
        if self.scheduler.config.kv_transfer and req.wants_remote_prefill:
            # from now until its pull ends, keep the prefill pod's blocks alive (vLLM 0.32's
            # heartbeats): the request may wait for free blocks longer than their lease
            self.transfer.track(req.request_id, req.kv_transfer_params or {})
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.transfer.untrack(request_id)
        req = self.scheduler.abort(request_id, time.monotonic())
        if req is not None:
            self._flush_events()
            if self.metrics is not None:
                self.metrics.on_finished(req)
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.pool.reset()
        self._flush_events()
        return ok

    def gauges(self) -> EngineGauges:
        sched = self.scheduler

        def loras(reqs: Iterable[SimRequest]) -> list[str]:
            return sorted({r.lora.name for r in reqs if r.lora is not None})

        return EngineGauges(
            running=lambda: len(sched.running),
            waiting=lambda: sched.num_waiting,
            deferred=lambda: len(sched.remote_waiting),
            kv_usage=lambda: sched.pool.usage,
            prefix_queries=lambda: sched.prefix_stats.queries,
            prefix_hits=lambda: sched.prefix_stats.hits,
            external_queries=lambda: sched.prefix_stats.external_queries,
            external_hits=lambda: sched.prefix_stats.external_hits,
            preemptions=lambda: sched.num_preemptions,
            lora_running=lambda: loras(sched.running),
            lora_waiting=lambda: loras([*sched.waiting, *sched.remote_waiting.values()]),
        )

    # -- KVHost ----------------------------------------------------------------------------
    def unpin(self, request_id: str) -> None:
        if self.scheduler.unpin(request_id):
            self._wake.set()

    def block_token_ids(self, block_id: int) -> tuple[int, ...]:
        return self.scheduler.pool.blocks[block_id].token_ids

    def claim_export(self, request_id: str) -> bool:
        """A decode pod pulls an exported request's blocks: release them to it (modelled P/D)."""
        if request_id not in self.scheduler.pinned:
            return False
        self.transfer.release(request_id)
        return True

    # -- the loop --------------------------------------------------------------------------
    def _current_profile(self) -> Profile:
        factor = self.faults.slow_factor
        if factor != self._scaled[0]:
            self._scaled = (factor, self.profile.scaled(factor))
        return self._scaled[1]

    async def _run(self) -> None:
        clock = time.monotonic  # uvloop's loop.time() ticks in whole milliseconds
        sched = self.scheduler
        while True:
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = clock()
            plan = sched.schedule(start)
            for req in plan.pulls:
                self._start_pull(req)
            if plan.empty:
                self._flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            profile = self._current_profile()
            step = profile.step_seconds(plan.num_decoding, plan.decode_ctx_tokens, plan.prefill_tokens)
            await asyncio.sleep(max(0.0, start + step - clock()))
            now = clock()
            produced = sched.complete(plan, now)
            self.steps += 1
            self._flush_events()
            self._after_step(plan.num_decoding + plan.prefill_tokens, produced, now)

    def _after_step(self, num_tokens: int, produced: list[SimRequest], now: float) -> None:
        metrics = self.metrics
        last_tokens: dict[float, int] = {}  # previous token time -> requests (one gap each)
        for req in produced:
            if len(req.output_ids) == 1:
                if metrics is not None:
                    metrics.on_first_token(req)
            elif req.last_token_at is not None:
                last_tokens[req.last_token_at] = last_tokens.get(req.last_token_at, 0) + 1
            req.last_token_at = now
            if req.status is Status.FINISHED:
                self._on_finished(req)
            if req.notify is not None:
                req.notify()
        if metrics is not None:
            metrics.on_step(num_tokens, len(produced))
            metrics.on_token_gaps({now - t: n for t, n in last_tokens.items()})

    def _on_finished(self, req: SimRequest) -> None:
        if req.request_id in self.scheduler.pinned:
            req.kv_transfer_out = self._export(req)
        if self.metrics is not None:
            self.metrics.on_finished(req)

    def _export(self, req: SimRequest) -> dict[str, Any]:
        """The prefill side's answer, shaped like vLLM NixlConnector's ``request_finished``."""
        block_ids = self.scheduler.pinned[req.request_id]
        extra = self.transfer.export(req.request_id, list(block_ids), req.prompt_ids)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.transfer.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": None,
            "remote_port": None,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": req.num_prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": req.cached_tokens,
            **extra,
        }

    def _start_pull(self, req: SimRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(req))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull(self, req: SimRequest) -> None:
        params = req.kv_transfer_params or {}
        local = req.block_ids[req.num_cached_blocks :]
        try:
            result = await self.transfer.pull(params, local, req.prompt_ids)
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
        self.scheduler.remote_done(req, ok, time.monotonic())
        self._wake.set()

    def _flush_events(self) -> None:
        events = self.scheduler.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
