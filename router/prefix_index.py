"""Which endpoint holds which KV block: the two prefix-cache indexes.

Both map an external block hash (an int) to the set of endpoints holding it, and answer one
question: for a request's hash chain, how many leading blocks does each endpoint hold? vLLM
reuses only a contiguous prefix, so the walk intersects holder sets block by block and stops
as soon as no endpoint is left — one pass over the chain, touching only cached blocks.

* ``PrefixIndex`` is exact bookkeeping, fed by vLLM's KV events (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``): the precise scorer.
* ``SpeculativeIndex`` bridges the gap between routing a request and its pod's ``BlockStored``
  events (a prefill later): what the router just sent counts as cached there for a few seconds.
  Without it, a burst of one group's requests scatters before the first events arrive.
* ``ApproxPrefixIndex`` learns from what the router itself routed and guesses eviction with a
  per-endpoint LRU bounded by the pod's cache size: the approximate scorer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from kvflow.endpoints import EndpointId


def longest_prefixes(holders: dict[int, set[EndpointId]], chain: Iterable[int]) -> dict[EndpointId, int]:
    """Leading blocks of the chain each endpoint holds (endpoints holding none are absent).

    ``chain`` may compute hashes lazily: it is not advanced past the first block nobody holds.
    """
    matched: dict[EndpointId, int] = {}
    it = iter(chain)
    first = next(it, None)
    alive = holders.get(first) if first is not None else None
    if not alive:
        return matched
    alive = set(alive)
    i = 1
    for h in it:
        nxt = holders.get(h)
        if not nxt:
            break
        if alive <= nxt:  # the common case: everyone still matching keeps matching
            i += 1
            continue
        survivors = alive & nxt
        for ep in alive - survivors:
            matched[ep] = i
        alive = survivors
        if not alive:
            break
        i += 1
    for ep in alive:
        matched[ep] = i
    return matched



def drop_holder(holders: dict[int, set[EndpointId]], h: int, endpoint: EndpointId) -> None:
    """Forget that ``endpoint`` holds block ``h``; forget the block once nobody holds it."""
    eps = holders.get(h)
    if eps is not None:
        eps.discard(endpoint)
        if not eps:
            del holders[h]

class PrefixIndex:
    """Blocks per endpoint, as the endpoints report them (KV events)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[EndpointId]] = {}
        self._blocks: dict[EndpointId, set[int]] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def blocks_of(self, endpoint: EndpointId) -> int:
        return len(self._blocks.get(endpoint, ()))

    def add(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        mine = self._blocks.setdefault(endpoint, set())
        holders = self.holders
        for h in hashes:
            mine.add(h)
            eps = holders.get(h)
            if eps is None:
                holders[h] = {endpoint}
            else:
                eps.add(endpoint)

    def remove(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        mine = self._blocks.get(endpoint)
        if mine is None:
            return
        for h in hashes:
            mine.discard(h)
            self._drop_holder(h, endpoint)

    def clear(self, endpoint: EndpointId) -> None:
        for h in self._blocks.pop(endpoint, ()):
            self._drop_holder(h, endpoint)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        return longest_prefixes(self.holders, chain)

    def _drop_holder(self, h: int, endpoint: EndpointId) -> None:
        drop_holder(self.holders, h, endpoint)


class ApproxPrefixIndex:
    """Blocks per endpoint as the router guesses them: what it routed there, LRU-bounded."""

    def __init__(self, capacity_per_endpoint: int = 4096) -> None:
        self.default_capacity = capacity_per_endpoint
        self.holders: dict[int, set[EndpointId]] = {}
        self._lru: dict[EndpointId, OrderedDict[int, None]] = {}
        self._capacity: dict[EndpointId, int] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def blocks_of(self, endpoint: EndpointId) -> int:
        return len(self._lru.get(endpoint, ()))

    def set_capacity(self, endpoint: EndpointId, blocks: int) -> None:
        """The pod's real cache size, once its metrics tell it."""
        self._capacity[endpoint] = max(1, blocks)
        self._evict(endpoint)

    def add(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """A request with these blocks ran there: they are now its most recently used.

        Touched tail-first, as vLLM frees a request's blocks, so a prefix outlives its suffix.
        """
        lru = self._lru.setdefault(endpoint, OrderedDict())
        holders = self.holders
        for h in reversed(list(hashes)):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                eps = holders.get(h)
                if eps is None:
                    holders[h] = {endpoint}
                else:
                    eps.add(endpoint)
        self._evict(endpoint)

    def clear(self, endpoint: EndpointId) -> None:
        for h in self._lru.pop(endpoint, ()):
            self._drop_holder(h, endpoint)

    def discard(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """Forget these blocks on ``endpoint`` (a request sent there failed: it computed nothing)."""
        lru = self._lru.get(endpoint)
        if lru is None:
            return
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._drop_holder(h, endpoint)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        return longest_prefixes(self.holders, chain)

    def _evict(self, endpoint: EndpointId) -> None:
        lru = self._lru.get(endpoint)
        if lru is None:
            return
        limit = self._capacity.get(endpoint, self.default_capacity)
        while len(lru) > limit:
            h, _ = lru.popitem(last=False)
            self._drop_holder(h, endpoint)

    def _drop_holder(self, h: int, endpoint: EndpointId) -> None:
        drop_holder(self.holders, h, endpoint)


class SpeculativeIndex:
    """Blocks the router just sent to an endpoint, believed cached there for ``ttl`` seconds."""

    def __init__(self, ttl: float = 2.0) -> None:
        self.ttl = ttl
        self.index = PrefixIndex()
        self._queue: deque[tuple[float, EndpointId, tuple[int, ...]]] = deque()

    def __len__(self) -> int:
        return len(self.index)

    def add(self, endpoint: EndpointId, hashes: Iterable[int], now: float) -> None:
        if self.ttl <= 0:
            return
        blocks = tuple(hashes)
        self.index.add(endpoint, blocks)
        self._queue.append((now + self.ttl, endpoint, blocks))

    def expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            _, endpoint, blocks = queue.popleft()
            self.index.remove(endpoint, blocks)

    def clear(self, endpoint: EndpointId) -> None:
        self.index.clear(endpoint)

    def discard(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """Forget these blocks on ``endpoint`` before they expire (the request sent there failed)."""
        self.index.remove(endpoint, hashes)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        return self.index.match(chain)
