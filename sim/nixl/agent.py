"""A NIXL agent owning a simulated pod's KV buffer, driven from asyncio without burning a core.

NIXL's Python agent, by default, starts a progress thread that spins with no delay (the wrapper
hard-codes ``pthrDelay = 0``): a whole core per idle pod. Here the agent is created *without*
that thread (``enable_prog_thread=False``) and with thread sync ``NONE``, and exactly one thread
of ours — the *NIXL thread* — makes every NIXL call. It is the only place that progresses UCX,
and it paces itself by what is pending:

* a READ of ours in flight        → poll its state every ``xfer_interval`` (0.2 ms);
* peers expected to act on us     → progress every ``busy_interval`` (1 ms): a prefill pod holding
  blocks for a decode pod (its notifications free them), or one that has just answered a
  handshake (the peer's UCX wire-up, and any READ carrying a notification, complete only when
  the target's worker progresses; with no progress at all the connection fails);
* nothing pending                 → progress every ``idle_interval`` (200 ms): ~0 % of a core.

Progress runs on that schedule, not after every command, so a READ's caller is woken at once.

Because every call happens on that thread, the event loop never blocks on NIXL: a 16 MiB READ
over UCX's CMA transport is copied inside ``transfer()`` itself (a few ms), which would otherwise
stall the loop. Callers on the loop get ``asyncio`` futures; results come back with
``call_soon_threadsafe``.

What a pull waits for on the loop is the READ plus two thread wake-ups (loop → NIXL thread,
NIXL thread → loop), which on a busy VM cost far more than the Python around them. So the thread
does everything a READ needs before waking the loop once: it runs the caller's ``verify`` over
the landed blocks (numpy views, no copies), resolves the future, and releases the handle while
the loop wakes up. The loop awaits that future directly (a timer, not ``wait_for``, guards a
stuck thread: fewer loop iterations between the wake-up and the caller).

The buffer is an anonymous mapping advised for transparent huge pages (CMA pins and copies
page by page: 2 MiB pages cut that work) and, up to ``PREFAULT_MAX_BYTES``, populated at start,
so the first READs into fresh blocks pay no page faults.

    agent = NixlAgent("engine-a", layout)
    await agent.start()
    name = await agent.add_remote(peer_metadata, peer_region_bases, peer_num_blocks)
    result = await agent.read(name, local_ids, remote_ids, timeout=5.0)
    await agent.send_notif(name, b"req-1:1")
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvflow.sim.nixl.layout import (
    KVLayout,
    as_regions,
    descriptor_ids,
    descriptors,
    region_bases,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
SLOW_CALL_S = 0.25
"""NIXL calls slower than this are logged: they hold up every other pull on this pod."""
CALL_TIMEOUT_S = 30.0
STUCK_GRACE_S = 2.0
PREFAULT_MAX_BYTES = 256 << 20
"""Buffers up to this size are populated at start; larger ones fault pages in as blocks are used."""
MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module
Notifs = dict[str, list[bytes]]


class NixlUnavailable(RuntimeError):
    """The ``nixl`` package cannot be imported (install ``nixl`` and ``nixl-cu12``)."""


class TransferFailed(Exception):
    """A READ did not complete; ``reason`` is ``timeout``, ``error`` or ``disconnect``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def import_nixl() -> Any:
    """NIXL's ``_api`` module, or ``NixlUnavailable`` with the reason."""
    try:
        from nixl import _api  # type: ignore[import-untyped]
    except ImportError as exc:  # the package, or its CUDA-flavoured backend, is missing
        raise NixlUnavailable(f"nixl is not importable: {exc}") from exc
    return _api


@dataclass(frozen=True, slots=True)
class ProgressConfig:
    idle_interval: float = 0.2
    busy_interval: float = 0.001
    xfer_interval: float = 0.0002


@dataclass(frozen=True, slots=True)
class ReadResult:
    seconds: float
    """The transfer, posting to completion, as NIXL's telemetry times it (what vLLM 0.32 reports
    as ``vllm:nixl_xfer_time_seconds``); our own clock around the calls where NIXL has none."""
    post_seconds: float
    """Of which posting (``transfer()``): over CMA the copy itself happens here."""
    nbytes: int
    descriptors: int
    """As NIXL moved them: adjacent descriptors are merged (vLLM's ``vllm:nixl_num_descriptors``)."""
    mismatched: tuple[int, ...] | None = None
    """Blocks ``verify`` found wrong (empty: all good); None when not verified."""
    verify_seconds: float = 0.0
    prep_seconds: float = 0.0
    """Building the transfer handle (``make_prepped_xfer``) before posting it."""


Verify = Callable[[], Sequence[int]]
"""Run on the NIXL thread once a READ is done: the local blocks whose content is wrong."""


@dataclass(slots=True)
class _Remote:
    name: str
    dlist: Any
    num_blocks: int


@dataclass(slots=True)
class _InFlight:
    handle: Any
    future: asyncio.Future[ReadResult]
    started: float
    """When ``transfer()`` was called."""
    prep_seconds: float
    post_seconds: float
    deadline: float
    nbytes: int
    descriptors: int
    verify: Verify | None


@dataclass
class NixlAgent:
    """One UCX agent, its registered KV buffer, and the thread that makes all its NIXL calls."""

    name: str
    layout: KVLayout
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    on_notifs: Callable[[Notifs], None] | None = None
    """Called on the event loop with each batch of notifications from peers."""
    prefault_max_bytes: int = PREFAULT_MAX_BYTES

    buffer: np.ndarray = field(init=False)
    regions: np.ndarray = field(init=False)
    """``[region, block, word-group, word]`` uint64 view of ``buffer`` (see ``layout``)."""
    busy_holds: int = field(default=0, init=False)
    """While positive, progress at ``busy_interval``: callers count what they wait on."""
    _busy_until: float = field(default=0.0, init=False)
    _agent: Any = field(default=None, init=False)
    _local_dlist: Any = field(default=None, init=False)
    _reg: Any = field(default=None, init=False)
    _metadata: bytes = field(default=b"", init=False)
    _remotes: dict[str, _Remote] = field(default_factory=dict, init=False)
    _inflight: list[_InFlight] = field(default_factory=list, init=False)
    _commands: queue.SimpleQueue[Callable[[], None] | None] = field(default_factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)
    _mapping: mmap.mmap = field(init=False)

    def __post_init__(self) -> None:
        self._mapping = map_buffer(self.layout.total_bytes, prefault=self.layout.total_bytes <= self.prefault_max_bytes)
        self.buffer = np.frombuffer(self._mapping, dtype=np.uint8)
        self.regions = as_regions(self.buffer, self.layout)

    # -- lifecycle (event loop) -------------------------------------------------------------

    async def start(self) -> None:
        api = import_nixl()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"nixl-{self.name}", daemon=True)
        self._thread.start()
        await self._call(lambda: self._create(api))

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 5.0)
        self._thread = None

    @property
    def base_addr(self) -> int:
        return int(self.buffer.ctypes.data)

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and memory keys), for the side channel."""
        return self._metadata

    def hold_busy(self, seconds: float) -> None:
        """Progress promptly for a while (a peer has just shaken hands and will connect)."""
        self._busy_until = max(self._busy_until, time.monotonic() + seconds)
        self._commands.put(lambda: None)  # wake the thread so it picks the shorter interval now

    # -- operations (event loop) ------------------------------------------------------------

    @property
    def region_bases(self) -> list[int]:
        return region_bases(self.base_addr, self.layout)

    async def add_remote(self, metadata: bytes, bases: Sequence[int], num_blocks: int) -> str:
        """Load a peer's metadata and prepare the descriptor list of its whole KV cache.

        ``bases`` are the peer's region start addresses; its block length must equal ours.
        """
        if len(bases) != self.layout.num_regions:
            raise ValueError(f"peer has {len(bases)} KV regions, this pod {self.layout.num_regions}")
        return await self._call(lambda: self._add_remote(metadata, list(bases), num_blocks))

    async def remove_remote(self, name: str) -> None:
        await self._call(lambda: self._remove_remote(name))

    async def read(
        self, remote: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
        *, notif: bytes = b"", timeout: float = 5.0, verify: Verify | None = None,
    ) -> ReadResult:
        """READ remote blocks into local ones; raise ``TransferFailed`` on error or timeout.

        ``verify``, if given, runs on the NIXL thread right after the READ completes (its answer
        is ``ReadResult.mismatched``), so that the loop is woken once, with nothing left to do.
        """
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError(f"{len(local_block_ids)} local blocks for {len(remote_block_ids)} remote ones")
        assert self._loop is not None
        future: asyncio.Future[ReadResult] = self._loop.create_future()
        local, remote_ids = list(local_block_ids), list(remote_block_ids)
        self._commands.put(lambda: self._post_read(future, remote, local, remote_ids, notif, timeout, verify))
        # The NIXL thread enforces ``timeout``; this timer only guards against that thread being stuck.
        stuck = TransferFailed("timeout", "the NIXL thread did not answer")
        guard = self._loop.call_later(timeout + STUCK_GRACE_S, _set_exception, future, stuck)
        try:
            return await future
        finally:
            guard.cancel()

    async def send_notif(self, remote: str, message: bytes) -> None:
        await self._call(lambda: self._agent.send_notif(remote, message))

    # -- the NIXL thread ----------------------------------------------------------------------

    def _run(self) -> None:
        last_progress = 0.0
        while not self._stopping:
            due = last_progress + self._progress_interval()
            wait = self.progress.xfer_interval if self._inflight else due - time.monotonic()
            try:
                command = self._commands.get(timeout=max(0.0, wait))
            except queue.Empty:
                command = _tick
            if not self._drain(command):
                break
            if self._agent is None:
                continue
            if self._inflight:
                self._poll_transfers()
            now = time.monotonic()
            if now >= last_progress + self._progress_interval():
                self._poll_notifs()
                last_progress = now
        self._shutdown()

    def _drain(self, command: Callable[[], None] | None) -> bool:
        """Run ``command`` and every other queued one; False once told to stop."""
        while command is not None:
            started = time.monotonic()
            command()
            took = time.monotonic() - started
            if took > SLOW_CALL_S and self._metadata:  # creating the agent is slow by nature
                log.warning("NIXL call %s took %.3fs", getattr(command, "__qualname__", command), took)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _progress_interval(self) -> float:
        if self.busy_holds > 0 or time.monotonic() < self._busy_until:
            return self.progress.busy_interval
        return self.progress.idle_interval

    def _create(self, api: Any) -> None:
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                       capture_telemetry=True)  # per-transfer timings, as vLLM 0.32 enables
        self._agent = api.nixl_agent(self.name, config)
        self._reg = self._agent.register_memory([(self.base_addr, self.buffer.nbytes, 0, "")], "DRAM")
        local = descriptors(self.region_bases, self.layout.block_len, self.layout.num_blocks)
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        self._metadata = self._agent.get_agent_metadata()

    def _add_remote(self, metadata: bytes, bases: list[int], num_blocks: int) -> str:
        name: str = self._agent.add_remote_agent(metadata)
        old = self._remotes.pop(name, None)
        if old is not None:
            old.dlist.release()
        rows = descriptors(bases, self.layout.block_len, num_blocks)
        dlist = self._agent.prep_xfer_dlist(name, rows, "DRAM")
        self._remotes[name] = _Remote(name, dlist, num_blocks)
        # Wire up now, while the peer (just handshaken) progresses promptly, not in the first READ.
        self._agent.make_connection(name)
        return name

    def _remove_remote(self, name: str) -> None:
        remote = self._remotes.pop(name, None)
        if remote is None:
            return
        remote.dlist.release()
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - already disconnected: nothing left to free
            log.debug("remove_remote_agent(%s): %s", name, exc)

    def _post_read(
        self, future: asyncio.Future[ReadResult], remote_name: str, local_ids: list[int],
        remote_ids: list[int], notif: bytes, timeout: float, verify: Verify | None,
    ) -> None:
        remote = self._remotes.get(remote_name)
        if remote is None:
            self._fail(future, TransferFailed("error", f"unknown remote agent {remote_name}"))
            return
        regions = self.layout.num_regions
        local_desc = descriptor_ids(regions, self.layout.num_blocks, local_ids)
        remote_desc = descriptor_ids(regions, remote.num_blocks, remote_ids)
        nbytes = len(local_ids) * self.layout.bytes_per_block
        began = time.perf_counter()
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, local_desc, remote.dlist, remote_desc, notif_msg=notif)
            started = time.perf_counter()
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL errors share no base class
            self._fail(future, TransferFailed(_reason(exc), str(exc)))
            return
        posted = time.perf_counter()
        flight = _InFlight(handle, future, started, started - began, posted - started, began + timeout, nbytes,
                           len(local_desc), verify)
        self._settle(flight, state)

    def _poll_transfers(self) -> None:
        for flight in list(self._inflight):
            try:
                state = self._agent.check_xfer_state(flight.handle)
            except Exception as exc:  # noqa: BLE001 - NIXL errors share no base class
                self._inflight.remove(flight)
                self._release(flight.handle)
                self._fail(flight.future, TransferFailed(_reason(exc), str(exc)))
                continue
            self._inflight.remove(flight)
            self._settle(flight, state)

    def _settle(self, flight: _InFlight, state: str) -> None:
        now = time.perf_counter()
        if state == "DONE":
            self._complete(flight, self._timings(flight, now))
            self._release(flight.handle)  # while the loop wakes up (tens of µs here), not before
        elif state == "PROC" and now < flight.deadline:
            self._inflight.append(flight)
        else:
            self._release(flight.handle)  # for a timed-out READ this asks UCX to abort it
            reason = "timeout" if state == "PROC" else "error"
            self._fail(flight.future, TransferFailed(reason, f"transfer state {state}"))

    def _timings(self, flight: _InFlight, done: float) -> ReadResult:
        """A finished READ's figures: NIXL's own telemetry where it has it, else our clock."""
        seconds, post, descriptors = done - flight.started, flight.post_seconds, flight.descriptors
        try:
            telemetry = self._agent.get_xfer_telemetry(flight.handle)
        except Exception as exc:  # noqa: BLE001 - telemetry off or unsupported: our clock will do
            log.debug("no NIXL telemetry for a READ: %s", exc)
        else:
            if telemetry.xferDuration > 0:
                seconds, post = telemetry.xferDuration / 1e6, telemetry.postDuration / 1e6
                descriptors = telemetry.descCount
        return ReadResult(seconds, post, flight.nbytes, descriptors, prep_seconds=flight.prep_seconds)

    def _complete(self, flight: _InFlight, result: ReadResult) -> None:
        if flight.verify is not None:
            started = time.perf_counter()
            try:
                mismatched = tuple(flight.verify())
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                self._fail(flight.future, exc)
                return
            result = dataclasses.replace(result, mismatched=mismatched, verify_seconds=time.perf_counter() - started)
        self._resolve(flight.future, result)

    def _poll_notifs(self) -> None:
        try:
            notifs: Notifs = self._agent.get_new_notifs()
        except Exception as exc:  # noqa: BLE001 - NIXL errors share no base class
            log.warning("get_new_notifs failed: %s", exc)
            return
        if notifs and self.on_notifs is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_notifs, notifs)

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # noqa: BLE001 - an un-abortable transfer: NIXL keeps it on its leak list
            log.warning("could not release transfer handle: %s", exc)

    def _shutdown(self) -> None:
        for flight in self._inflight:
            self._release(flight.handle)
            self._fail(flight.future, TransferFailed("error", "agent stopped"))
        self._inflight.clear()
        if self._agent is None:
            return
        for name in list(self._remotes):
            self._remove_remote(name)
        if self._local_dlist is not None:
            self._local_dlist.release()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
        self._agent = None

    # -- thread → loop plumbing ---------------------------------------------------------------

    async def _call(self, fn: Callable[[], T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run ``fn`` on the NIXL thread and await its result (``TimeoutError`` if the thread is stuck)."""
        assert self._loop is not None
        future: asyncio.Future[T] = self._loop.create_future()

        def command() -> None:
            try:
                value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                self._fail(future, exc)
            else:
                self._resolve(future, value)

        if self._thread is None:
            raise RuntimeError("NIXL agent is not running")
        self._commands.put(command)
        return await asyncio.wait_for(future, timeout)

    def _resolve(self, future: asyncio.Future[Any], value: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_set_result, future, value)

    def _fail(self, future: asyncio.Future[Any], exc: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_set_exception, future, exc)


def map_buffer(nbytes: int, *, prefault: bool) -> mmap.mmap:
    """An anonymous, zeroed mapping for a KV buffer, advised for huge pages, populated if asked.

    Unpopulated, a large pool costs memory only where blocks are written.
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = [getattr(mmap, "MADV_HUGEPAGE", None), MADV_POPULATE_WRITE if prefault else None]
    for option in filter(None, advice):
        try:
            mapping.madvise(option)
        except OSError as exc:  # an older kernel, or THP disabled: a slower first READ, nothing worse
            log.debug("madvise(%d) on the KV buffer: %s", option, exc)
    return mapping


def _tick() -> None:
    """A timed-out wait: nothing to run, just a progress tick."""


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _reason(exc: Exception) -> str:
    return "disconnect" if "DISCONNECT" in type(exc).__name__.upper() or "DISCONNECT" in str(exc) else "error"
