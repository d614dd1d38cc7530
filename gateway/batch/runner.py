"""The batch runner: one per gateway replica, feeding batch lines to the pods from idle capacity.

Three tasks, all on the gateway's event loop:

* **control** looks in the database (when woken, and every ``poll_s`` for other replicas' work
  and cancellations): validates new batches, claims lines into a local backlog, expires
  batches past their window, finalizes batches whose lines are all done;
* **dispatch** starts backlog lines as the batch band of their pool lets it (``batch_room``):
  each line is a task sending one request through the gateway, so many are in flight at once
  and the pods' continuous batching stays full while nobody else needs it. It re-evaluates when
  a line finishes and, while the band holds lines back, every ``TICK`` (the router scrapes the
  pods every 50 ms: what the band reads does not change faster);
* **commit** writes finished lines' results in one transaction every ``TICK`` and renews the
  replica's leases.

A line whose pods cannot be reached (no healthy pod, 502) goes back to the database with a
back-off and is tried again, up to ``max_attempts``; any other answer is its result. A line that
raises anywhere on the way (a body the gateway cannot use, a bug) gets a 500 as its result: no
line can stop the runner or stay claimed forever.

Lines are claimed and started fairly between the keys that own batches (``fair``): one key's
large batch does not make another key's lines wait behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.endpoints import Role
from kvflow.gateway.app import Gateway
from kvflow.gateway.batch import execute
from kvflow.gateway.batch.config import BatchConfig
from kvflow.gateway.batch.fair import OwnerQueue, shares
from kvflow.gateway.batch.lines import encode_body, error_line, parse_file, response_line
from kvflow.gateway.batch.states import BatchRecord, Status
from kvflow.gateway.batch.store import AsyncStore, Claimed, NewLine, Result
from kvflow.gateway.flow import InteractiveWatch, PodLoad, batch_room, next_cap
from kvflow.gateway.pools import Pool

log = logging.getLogger("kvflow.gateway.batch")

TICK = 0.05
BACKLOG_MARGIN = 16


@dataclass(slots=True)
class _Waiting:
    claimed: Claimed
    owner: str
    endpoint: str
    line: execute.Prepared


class BatchRunner:
    def __init__(self, gateway: Gateway, store: AsyncStore, config: BatchConfig, replica: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.gateway, self.store, self.config, self.replica, self.clock = gateway, store, config, replica, clock
        self.limits = config.limits()
        self.watches = {model: InteractiveWatch(self.limits.quiet_s) for model in gateway.pools}
        self.backlog: dict[str, OwnerQueue[_Waiting]] = {model: OwnerQueue() for model in gateway.pools}
        self.inflight: dict[str, int] = {model: 0 for model in gateway.pools}
        self.caps: dict[str, tuple[int, object]] = {}
        """Per pod: its batch cap and the scrape it was last brought up to date with."""
        self.results: list[Result] = []
        self._more_to_claim = False
        """The last claim filled what was asked: the database may hold more for this replica."""
        self._turn = 0
        """Which owner is asked first in the next claim (it turns, so no owner always goes first)."""
        self._wake_control = asyncio.Event()
        self._wake_dispatch = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lines: set[asyncio.Task[None]] = set()

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        released = await self.store.run(self.store.store.release_all, self.replica)
        if released:
            log.info("batch: took back %d lines this replica (%s) held before it stopped", released, self.replica)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(coro, name=f"batch-{name}") for name, coro in
                       (("control", self._control()), ("dispatch", self._dispatch()), ("commit", self._commit()))]

    async def stop(self) -> None:
        """Stop feeding; results already in hand are written, running lines go back for later."""
        for task in [*self._tasks, *self._lines]:
            task.cancel()
        for task in [*self._tasks, *self._lines]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._flush()
        await self.store.run(self.store.store.release_all, self.replica)

    def wake(self) -> None:
        """Something changed in the database (a batch created or cancelled here)."""
        self._wake_control.set()

    def _drop(self, batch_id: str) -> list[int]:
        """Take the batch's lines that have not started out of the backlog; their indexes."""
        dropped: list[int] = []
        for queue in self.backlog.values():
            dropped += [w.claimed.index for w in queue.remove(lambda w: w.claimed.batch_id == batch_id)]
        return dropped

    # --- control: the database side ------------------------------------------------------

    async def _control(self) -> None:
        while True:
            try:
                await self._survey()
            except Exception:  # a database hiccup must not stop batches for good
                log.exception("batch: control step failed; retrying")
            await asyncio.sleep(TICK)  # lines finishing wake this often: look at most every TICK
            await _woken(self._wake_control, self.config.poll_s)
            self._wake_control.clear()

    async def _survey(self) -> None:
        store = self.store.store
        now = self.clock()
        live: dict[str, tuple[str, str]] = {}
        """Batches whose lines can be claimed, oldest first: id -> (owner, endpoint)."""
        for rec in await self.store.run(store.active):
            try:
                if await self._step(rec, now):
                    live[rec.id] = (rec.owner, rec.endpoint)
            except Exception:  # one batch's trouble must not hold up the others
                log.exception("batch %s: step failed (%s); retrying", rec.id, rec.status)
        for batch_id in await self._claim(live):
            if (not await self.store.run(store.any_unfinished, batch_id)
                    and await self.store.run(store.to_finalizing, batch_id, int(now))):
                await self._finalize(batch_id)

    async def _step(self, rec: BatchRecord, now: float) -> bool:
        """Move one batch on; whether its lines can be claimed now."""
        store = self.store.store
        if rec.status is Status.VALIDATING:
            return await self._validate(rec)  # its lines can be claimed right away
        if rec.status is Status.IN_PROGRESS and now >= rec.expires_at:
            self._drop(rec.id)
            await self.store.run(store.expire, rec.id, int(now))
            await self._finalize(rec.id)
        elif rec.status is Status.IN_PROGRESS:
            return True
        elif rec.status is Status.CANCELLING:  # lines not started stay unrun; running ones finish
            dropped = self._drop(rec.id)
            if dropped:
                await self.store.run(store.release_lines, rec.id, self.replica, dropped)
            if not await self.store.run(store.any_running, rec.id, now):
                await self._finalize(rec.id)
        elif rec.status is Status.FINALIZING:
            await self._finalize(rec.id)
        return False

    async def _validate(self, rec: BatchRecord) -> bool:
        """Read the batch's input file into lines; whether it is now in progress."""
        store = self.store.store
        now = self.clock()
        if not await self.store.run(store.lease_batch, rec.id, self.replica, now + self.config.lease_s, now):
            return False
        try:
            data = await self.store.run(store.read_file, rec.owner, rec.input_file_id)
        except Exception as exc:  # deleted before the batch started
            await self.store.run(store.fail, rec.id, [{"code": "invalid_file", "message": str(exc), "line": None,
                                                       "param": "input_file_id"}], int(now))
            return False
        lines = await asyncio.to_thread(_new_lines, rec.id, rec.endpoint, data)
        started = await self.store.run(store.start, rec.id, self.replica, lines, int(self.clock()))
        if started:
            log.info("batch %s: %d lines, in progress", rec.id, len(lines))
        return started

    async def _finalize(self, batch_id: str) -> None:
        store = self.store.store
        now = self.clock()
        if await self.store.run(store.lease_batch, batch_id, self.replica, now + self.config.lease_s, now):
            done = await self.store.run(store.finalize, batch_id, self.replica, int(now))
            if done is not None:
                log.info("batch %s: %s (%d completed, %d failed)", batch_id, done.status, done.completed, done.failed)

    async def _claim(self, live: dict[str, tuple[str, str]]) -> list[str]:
        """Keep the backlog at about what the bands could start now, that room shared evenly
        between the owners with work (each owner's oldest batch first); the batches that had no
        line left to claim (they may be done)."""
        store = self.store.store
        todo: dict[str, list[tuple[str, str]]] = {}
        for batch_id, (owner, endpoint) in live.items():
            todo.setdefault(owner, []).append((batch_id, endpoint))
        order = list(todo)
        self._turn += 1
        turn = self._turn % len(order) if order else 0
        todo = {owner: todo[owner] for owner in order[turn:] + order[:turn]}
        exhausted: list[str] = []
        asked: set[str] = set()
        want = self._wanted()
        while want > 0 and todo:  # each pass claims lines or uses a batch up: it ends
            for owner, share in zip(list(todo), shares(want, len(todo)), strict=True):
                batches = todo[owner]
                while share > 0 and batches:
                    batch_id, endpoint = batches[0]
                    asked.add(batch_id)
                    now = self.clock()
                    claimed = await self.store.run(store.claim, batch_id, self.replica, share,
                                                   now + self.config.lease_s, now)
                    for c in claimed:
                        self._enqueue(c, owner, endpoint)
                    if claimed:
                        self._wake_dispatch.set()
                    if len(claimed) < share:
                        exhausted.append(batch_id)
                        batches.pop(0)
                    share -= len(claimed)
                    want -= len(claimed)
                if not batches:
                    del todo[owner]
        self._more_to_claim = bool(todo)
        exhausted += [b for b in live if b not in asked and not self._holding(b)]
        return exhausted

    def _holding(self, batch_id: str) -> bool:
        return any(w.claimed.batch_id == batch_id for q in self.backlog.values() for w in q)

    def _wanted(self) -> int:
        """Lines worth holding: what the bands would start now, and a few more for when they
        finish. Claiming no more than that leaves the rest to replicas with more room."""
        backlog = sum(len(q) for q in self.backlog.values())
        return sum(self._room(pool) + BACKLOG_MARGIN for pool in self.gateway.pools.values()) - backlog

    def _enqueue(self, claimed: Claimed, owner: str, endpoint: str) -> None:
        prepared = execute.prepare(self.gateway, endpoint, claimed.request, _request_id(claimed))
        if isinstance(prepared, execute.Answer):  # bad body or unknown model: its answer is its result
            self._finish(claimed, prepared)
            return
        self.backlog[prepared.pool.model].append(owner, _Waiting(claimed, owner, endpoint, prepared))

    # --- dispatch: the pods side ---------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            try:
                held_back = self._dispatch_step()
            except Exception:  # a bug here must not stop every batch: say so and go on
                log.exception("batch: dispatch step failed")
                held_back = True
            await _woken(self._wake_dispatch, TICK if held_back else None)
            self._wake_dispatch.clear()

    def _dispatch_step(self) -> bool:
        """Start what the bands allow; whether lines are still held back."""
        held_back = False
        for model, queue in self.backlog.items():
            if not queue:
                continue
            room = self._room(self.gateway.pools[model])
            while queue and room > 0:
                self._start(queue.popleft())
                room -= 1
            held_back = held_back or bool(queue)
        if self._more_to_claim and sum(len(q) for q in self.backlog.values()) < self._low_water():
            self._wake_control.set()
        return held_back

    def _low_water(self) -> int:
        return max(1, sum(self.inflight.values()) // 2)

    def _room(self, pool: Pool) -> int:
        queue = pool.gate.queue
        interactive = self.watches[pool.model].around(queue.inflight, time.monotonic())
        return batch_room(self._pod_loads(pool), self.inflight[pool.model], self.limits,
                          interactive=interactive, interactive_waiting=queue.waiting)

    def _pod_loads(self, pool: Pool) -> list[PodLoad]:
        """The router's view of the pods that decode, with each pod's cap brought up to date with
        its latest scrape. A router without a view (a scripted router in tests) gets pods that
        run whatever they are sent."""
        datastore = getattr(pool.router, "datastore", None)
        if datastore is None:
            pods = [ep for ep in pool.router.endpoints if ep.role is not Role.PREFILL]
            share = self.inflight[pool.model] // max(1, len(pods))
            return [PodLoad(0, 0.0, in_flight=share, cap=self.limits.per_pod) for _ in pods]
        decoders, _ = datastore.by_role()
        loads = []
        for v in decoders:
            cap, seen = self.caps.get(v.id, (min(self.limits.first_cap, self.limits.per_pod), None))
            if v.metrics is not seen:  # a new scrape
                cap = next_cap(cap, v.metrics.running, v.metrics.waiting, self.limits)
                self.caps[v.id] = (cap, v.metrics)
            loads.append(PodLoad(v.metrics.waiting, v.metrics.kv_usage, v.in_flight, cap, v.healthy))
        return loads

    def _start(self, waiting: _Waiting) -> None:
        model = waiting.line.pool.model
        self.inflight[model] += 1
        task = asyncio.get_running_loop().create_task(self._run(waiting))
        self._lines.add(task)
        task.add_done_callback(self._lines.discard)

    async def _run(self, waiting: _Waiting) -> None:
        claimed = waiting.claimed
        request_id = _request_id(claimed)
        try:
            answer = await execute.run(self.gateway, waiting.line, waiting.endpoint, request_id)
        except execute.Transient as exc:
            await self._retry_later(claimed, exc)
        except Exception as exc:  # a bug on the line's way: its result, never a line held forever
            log.exception("batch %s line %d failed", claimed.batch_id, claimed.index)
            self._finish(claimed, execute.failed(exc, request_id))
        else:
            self._finish(claimed, answer)
        finally:
            self.inflight[waiting.line.pool.model] -= 1
            self._wake_dispatch.set()

    async def _retry_later(self, claimed: Claimed, exc: execute.Transient) -> None:
        if claimed.attempts >= self.config.max_attempts:
            self._finish(claimed, exc.answer)
            return
        delay = min(30.0, 2.0 ** (claimed.attempts - 1))
        log.warning("batch %s line %d: %s; again in %gs", claimed.batch_id, claimed.index, exc, delay)
        try:
            await self.store.run(self.store.store.release, claimed.batch_id, claimed.index, self.replica,
                                 self.clock() + delay)
        except Exception:  # not given back: its last answer is its result rather than a lost line
            log.exception("batch %s line %d: could not be given back", claimed.batch_id, claimed.index)
            self._finish(claimed, exc.answer)

    def _finish(self, claimed: Claimed, answer: execute.Answer) -> None:
        line = response_line(claimed.batch_id, claimed.index, claimed.custom_id, answer.status, answer.request_id,
                             answer.body)
        ok = 200 <= answer.status < 300
        self.results.append(Result(claimed.batch_id, claimed.index, ok, line))
        self.gateway.metrics.count(self.gateway.metrics.batch_lines, "completed" if ok else "failed")

    # --- commit: results and leases ------------------------------------------------------

    async def _commit(self) -> None:
        renew_every = self.config.lease_s / 3
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(TICK)
            try:
                if self.results and await self._flush() and not self._more_to_claim:
                    self._wake_control.set()  # nothing left to claim: a batch may be done
                if time.monotonic() - renewed >= renew_every:
                    await self.store.run(self.store.store.renew, self.replica, self.clock() + self.config.lease_s)
                    renewed = time.monotonic()
            except Exception:
                log.exception("batch: writing results failed; retrying")

    async def _flush(self) -> int:
        results, self.results = self.results, []
        if not results:
            return 0
        try:
            return await self.store.run(self.store.store.record, self.replica, results)
        except BaseException:
            self.results[:0] = results  # not written: keep them for the next try
            raise


async def _woken(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` passes. Not ``asyncio.wait_for``: on Python 3.11 it
    drops a cancellation that arrives as the event is set, and these loops would then never stop
    (the runner's ``stop`` waited forever when lines finished as it cancelled them)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


def _request_id(claimed: Claimed) -> str:
    """The line's X-Request-Id at the pods: batch, line and attempt."""
    return f"{claimed.batch_id}-{claimed.index}-{claimed.attempts}"


def _new_lines(batch_id: str, endpoint: str, data: bytes) -> list[NewLine]:
    """The input file as stored lines: requests to run, and results already for malformed ones."""
    out = []
    for line in parse_file(data, endpoint):
        if line.error is not None:
            out.append(NewLine(line.index, line.custom_id, None, error_line(batch_id, line.index, line.custom_id,
                                                                           line.error)))
        else:
            assert line.body is not None
            out.append(NewLine(line.index, line.custom_id, encode_body(line.body)))
    return out
