"""How much of a pod's KV cache its recent requests use: the part a new prefix would push out.

A pod's cache is least-recently-used: storing a prefix it does not hold evicts as many tokens
as the prefix has, the ones touched longest ago. That costs nothing while the pod's *working
set* (the distinct prompt tokens its requests touched in the last ``window`` seconds) plus the
new prefix fits in its capacity; past it, the eviction reaches blocks that are still in use, and
some later request computes them again. ``WorkingSet`` estimates that working set, so a router
can charge a placement for the in-use blocks it evicts (``LoadCounter.room``, read by
``kvflow.router.plugins.ttft``).

It is a distinct count, estimated by hash sampling: block fingerprints are uniformly random
64-bit keys, so the blocks whose low ``sample_bits`` bits are zero are a fair one-in-2**bits
sample of any set of blocks, shared prefixes counted once however many requests touch them.
The sample is an ordered dict in touch order (oldest first), expired from the front when a
request is sent to the pod and when the pod is scraped, beside a count of its samples by touch
time (one entry per request sent in the window). A request sent costs a few dict operations per
sampled block (32 blocks for an 8,192-token prompt at one in 16, 256 at one in 2: work a router
on an event loop does after the request is sent); a decision reads one number.

The same sample, in touch order, gives a block's place in the pod's LRU order: ``surviving``
cuts a prefix the KV events still report where a cacheful of other blocks was sent after it,
before the pod's ``BlockRemoved`` arrives. Beside it, the blocks of the requests in flight there
(``pin`` / ``unpin``, one block in 16 of each): ``in_use``, which vLLM does not evict.

How fine the sample is follows the pod's capacity once it is known (``fit``): about
``SAMPLES_PER_CACHEFUL`` samples make a cacheful, at most one block in ``2**SAMPLE_BITS``. A
count of ``k`` samples is off by about ``1/sqrt(k)`` of itself, and a prefix near the edge of the
pod's LRU order is cut or kept on that count: at one block in 16 a 2,400-block pod (the routing
benchmark's) has 150 samples a cacheful, 8 % off, and on the benchmark's replay the cut was then
wrong more often than right; at one in 2 (1,200 samples, 3 %) it halved the blocks misjudged. A
30,000-block pod keeps one in 16 (1,900 samples).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile

import numpy as np

DEFAULT_WINDOW = 20.0
SAMPLE_BITS = 4
"""The coarsest sample: one block in 16 (and the sample before the pod's capacity is known)."""
_COARSE = np.uint64((1 << SAMPLE_BITS) - 1)
SAMPLES_PER_CACHEFUL = 1024
"""``fit`` samples a pod's blocks as finely as gives at least this many samples a cacheful."""


class WorkingSet:
    __slots__ = ("window", "tokens", "_block_size", "_bits", "_fixed", "_mask", "_scale", "_touched", "_by_time",
                 "_pinned")

    def __init__(self, block_size: int = 16, window: float = DEFAULT_WINDOW, sample_bits: int | None = None) -> None:
        """``sample_bits``: sample one block in ``2**sample_bits``, whatever the capacity (None:
        ``SAMPLE_BITS`` until ``fit`` is told the pod's capacity)."""
        self.window = window
        self.tokens = 0
        """Distinct prompt tokens touched in the window, as of the last touch or ``expire``."""
        self._block_size = block_size
        self._fixed = sample_bits is not None
        self._touched: OrderedDict[int, float] = OrderedDict()
        """Sampled fingerprint -> when it was last touched, oldest first."""
        self._by_time: dict[float, int] = {}
        """Touch time -> samples last touched then, oldest first (one entry per request sent in
        the window): how many were touched after a time, counted from the newest."""
        self._pinned: dict[int, int] = {}
        """Sampled fingerprint -> requests in flight here that use it (``pin``, ``unpin``)."""
        self._sample(SAMPLE_BITS if sample_bits is None else sample_bits)

    def _sample(self, bits: int) -> None:
        self._bits = bits
        self._mask = np.uint64((1 << bits) - 1)
        self._scale = self._block_size << bits
        """Tokens each sampled block stands for."""

    @property
    def sample_bits(self) -> int:
        """One block in ``2**sample_bits`` is sampled."""
        return self._bits

    @property
    def samples(self) -> int:
        """Sampled blocks touched in the window, as of the last touch or ``expire`` (each stands
        for ``2**sample_bits`` blocks: ``tokens`` is this many times their tokens)."""
        return len(self._touched)

    def last_touches(self) -> dict[int, float]:
        """A snapshot of the sample: each sampled fingerprint -> when it was last touched, in
        touch order (oldest first, the pod's LRU order)."""
        return dict(self._touched)

    def samples_by_time(self) -> dict[float, int]:
        """A snapshot: each touch time in the window -> how many samples were last touched then,
        oldest first (what places a block in the LRU order: the samples touched after it)."""
        return dict(self._by_time)

    def fit(self, capacity: int) -> None:
        """The pod holds ``capacity`` tokens: sample finely enough to place a block in its LRU
        order (``SAMPLES_PER_CACHEFUL``). A new rate starts an empty sample."""
        blocks = capacity // self._block_size
        if self._fixed or blocks <= 0:
            return
        bits = min(SAMPLE_BITS, max(0, (blocks // SAMPLES_PER_CACHEFUL).bit_length() - 1))
        if bits != self._bits:
            self._sample(bits)
            self.clear()

    def touch(self, fingerprints: np.ndarray | Sequence[int], now: float) -> None:
        """A request that reads or stores these prompt blocks was sent to the pod at ``now``."""
        touched, by_time = self._touched, self._by_time
        if by_time:
            now = max(now, next(reversed(by_time)))  # touch order is time order, whatever the clock
        if len(fingerprints):
            keys = np.asarray(fingerprints, dtype=np.uint64)
            sampled = (keys[(keys & self._mask) == 0] if self._bits else keys).tolist()
            earlier = list(map(touched.get, sampled))
            for key in sampled:
                touched[key] = now
                touched.move_to_end(key)
            # a prompt's fingerprints are distinct (each is chained to those before it), and its
            # blocks were last touched by a few requests at most: a few distinct times
            for t in set(earlier):
                if t is not None:
                    _take(by_time, t, earlier.count(t))
            if sampled:
                by_time[now] = by_time.pop(now, 0) + len(sampled)
        self.expire(now)

    def pin(self, fingerprints: np.ndarray) -> None:
        """A request that uses these prompt blocks is in flight here (until ``unpin``). Kept for
        one block in 16 whatever the sample (the fixed coarse sample: a few dict updates a request)."""
        pinned = self._pinned
        for key in _coarse(fingerprints):
            pinned[key] = pinned.get(key, 0) + 1

    def unpin(self, fingerprints: np.ndarray) -> None:
        """The request ``pin`` was told of ended here."""
        pinned = self._pinned
        for key in _coarse(fingerprints):
            left = pinned.get(key, 0) - 1
            if left > 0:
                pinned[key] = left
            else:
                pinned.pop(key, None)

    def expire(self, now: float) -> None:
        """Forget the blocks last touched more than ``window`` seconds before ``now``."""
        touched, by_time, since = self._touched, self._by_time, now - self.window
        old = list(takewhile(since.__gt__, by_time))  # the touch times before the window, oldest first
        if old:
            popitem = touched.popitem
            for when in old:  # the samples last touched then are the oldest in touch order
                for _ in range(by_time.pop(when)):
                    popitem(last=False)
        self.tokens = len(touched) * self._scale

    def in_use(self, fingerprints: np.ndarray) -> int:
        """How many leading blocks of ``fingerprints`` a request in flight here uses (``pin``),
        to the last block of the pins' one-in-16 sample (the blocks after it, 15 on average, may
        be in use too: they are not counted)."""
        pinned, held = self._pinned, 0
        if pinned:
            at = np.flatnonzero((fingerprints & _COARSE) == 0)
            for i, key in zip(at.tolist(), fingerprints[at].tolist()):
                if key not in pinned:  # a prefix is used from its first block
                    break
                held = i + 1
        return held

    def surviving(self, fingerprints: np.ndarray, capacity: int) -> int:
        """How many leading blocks of ``fingerprints`` (a prefix the pod is believed to hold)
        are still there when a request sent now runs, the pod's cache being least-recently-used.

        A block is evicted once ``capacity`` tokens of other blocks were used after it (its LRU
        stack distance; the requests sent since are counted, computed or still queued, since a
        request sent now runs after them). The blocks a request used are freed together, its
        last block first, so a prefix at the edge of the LRU order loses its tail and keeps its
        head (vLLM's ``free_blocks`` queues them so). So a block's distance is the blocks
        sampled after it was touched, plus the blocks of the same touch before it in the prefix;
        the prefix is cut at the first block that puts past a cacheful. A block this router has
        not touched in the window is left as believed: another router may have sent it lately."""
        touched, n = self._touched, len(fingerprints)
        per = 1 << self._bits  # blocks a sample stands for
        cacheful = capacity / self._block_size - 1  # vLLM's block 0 is its null block: it holds nothing
        if len(touched) * per < cacheful:
            return n  # fewer blocks touched than the cache holds: nothing pushed out
        sampled = np.flatnonzero((fingerprints & self._mask) == 0) if self._bits else None
        if sampled is not None and not len(sampled):
            return n
        by_time = self._by_time

        def after(t: float) -> int:  # blocks touched after time t, counted up to a cacheful
            count = 0
            for when, samples in reversed(by_time.items()):  # one entry per request sent since
                if when <= t or count * per >= cacheful:
                    break
                count += samples
            return count * per

        # Along a prefix the last touch only gets older (a request that touches a block touches
        # every block before it), so the last sampled block is the furthest down: kept, all is.
        end = int(sampled[-1]) if sampled is not None else n - 1
        t = touched.get(int(fingerprints[end]))
        if t is not None and after(t) + end < cacheful:
            return n
        if t is None and not any(map(touched.__contains__, fingerprints[(fingerprints & _COARSE) == 0].tolist())):
            return n  # not one in 16 of its blocks sent here lately (another router's prefix): as believed
        keys = (fingerprints if sampled is None else fingerprints[sampled]).tolist()
        start, last, room = 0, -1, 0.0
        run: float | None = None  # the time of the run of blocks last touched together; its first: start
        for i, t in zip(range(n) if sampled is None else sampled.tolist(), map(touched.get, keys)):
            if t is not None:
                if t != run:
                    start, run = last + 1, t
                    room = cacheful - after(t)  # blocks of its run still held
                if i - start >= room:
                    return start + max(0, math.ceil(room))
            last = i
        return n

    def clear(self) -> None:
        self._touched.clear()  # (not the pins: their requests are still in flight, and unpin themselves)
        self._by_time.clear()
        self.tokens = 0


def _coarse(fingerprints: np.ndarray) -> list[int]:
    keys = np.asarray(fingerprints, dtype=np.uint64)
    return keys[(keys & _COARSE) == 0].tolist()


def _take(by_time: dict[float, int], t: float, n: int) -> None:
    """``n`` samples last touched at ``t`` were touched again or forgotten."""
    left = by_time.get(t, 0) - n
    if left > 0:
        by_time[t] = left
    else:
        by_time.pop(t, None)
