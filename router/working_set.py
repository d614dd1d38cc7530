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
request is sent to the pod and when the pod is scraped. A request sent costs one dict operation
per sampled block (32 for an 8,192-token prompt at one in 16); a decision reads one number.

The same sample, in touch order, gives a block's place in the pod's LRU order: ``surviving``
cuts a prefix the KV events still report where a cacheful of other blocks was sent after it,
before the pod's ``BlockRemoved`` arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

import numpy as np

DEFAULT_WINDOW = 20.0
SAMPLE_BITS = 4


class WorkingSet:
    __slots__ = ("window", "tokens", "_mask", "_scale", "_touched", "_horizon")

    def __init__(self, block_size: int = 16, window: float = DEFAULT_WINDOW, sample_bits: int = SAMPLE_BITS) -> None:
        self.window = window
        self.tokens = 0
        """Distinct prompt tokens touched in the window, as of the last touch or ``expire``."""
        self._mask = np.uint64((1 << sample_bits) - 1)
        self._scale = block_size << sample_bits
        """Tokens each sampled block stands for."""
        self._touched: OrderedDict[int, float] = OrderedDict()
        """Sampled fingerprint -> when it was last touched, oldest first."""
        self._horizon: tuple[int, float] | None = None
        """``surviving``'s (k, touch time of the k-th most recently touched sample), until the
        next touch or expiry."""

    def touch(self, fingerprints: np.ndarray | Sequence[int], now: float) -> None:
        """A request that reads or stores these prompt blocks was sent to the pod at ``now``."""
        if len(fingerprints):
            keys = np.asarray(fingerprints, dtype=np.uint64)
            touched = self._touched
            for key in keys[(keys & self._mask) == 0].tolist():
                touched[key] = now
                touched.move_to_end(key)
            self._horizon = None
        self.expire(now)

    def expire(self, now: float) -> None:
        """Forget the blocks last touched more than ``window`` seconds before ``now``."""
        touched, since = self._touched, now - self.window
        while touched and next(iter(touched.values())) < since:
            touched.popitem(last=False)
            self._horizon = None
        self.tokens = len(touched) * self._scale

    def surviving(self, fingerprints: np.ndarray, capacity: int) -> int:
        """How many leading blocks of ``fingerprints`` (a prefix the pod is believed to hold)
        are still there when a request sent now runs, the pod's cache being least-recently-used.

        A block is evicted once ``capacity`` tokens of other blocks were touched after it (its
        LRU stack distance; the requests sent since are counted, computed or still queued,
        since a request sent now runs after them). A sampled block's distance is the sample
        touched after it; the prefix is cut at its first sampled block that is that far down.
        A block this router has not touched in the window is left as believed: another router
        may have sent it lately."""
        touched = self._touched
        k = -(-capacity // self._scale)  # samples that make a cacheful
        if len(touched) < k:
            return len(fingerprints)  # fewer tokens touched than the cache holds: nothing pushed out
        horizon = self._horizon
        if horizon is None or horizon[0] != k:  # touch order is time order: the k-th from the end
            horizon = self._horizon = (k, next(islice(reversed(touched.values()), k - 1, None)))
        oldest_kept = horizon[1]  # a block last touched before it has a cacheful touched after it
        sampled = np.flatnonzero((fingerprints & self._mask) == 0).tolist()
        if not sampled:
            return len(fingerprints)
        # A request that touches a block touches every block before it: along a prefix the last
        # touch only gets older, so if its last sampled block is kept, so is all of it.
        t = touched.get(int(fingerprints[sampled[-1]]))
        if t is not None and t >= oldest_kept:
            return len(fingerprints)
        for i in sampled:
            t = touched.get(int(fingerprints[i]))
            if t is not None and t < oldest_kept:
                return i
        return len(fingerprints)

    def clear(self) -> None:
        self._touched.clear()
        self._horizon = None
        self.tokens = 0
