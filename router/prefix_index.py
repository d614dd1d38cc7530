"""Which endpoint holds which KV block: the prefix-cache indexes.

Each answers one question: for a request's block keys (its prefix fingerprints,
``fingerprint.py``), how many leading blocks does each endpoint hold? vLLM reuses only a
contiguous prefix, so the walk (``longest_prefixes``) goes down the chain intersecting holder
sets and stops as soon as no endpoint is left: one pass, touching only cached blocks. The two
that mirror the pods' caches keep their entries in a ``BlockTable`` (``block_table.py``: flat
arrays, 45-61 bytes per (block, endpoint) entry, an age order and a cap per endpoint).

* ``PrefixIndex`` is exact bookkeeping, fed by vLLM's KV events (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``; ``kv_events.apply`` fingerprints the stored blocks
  from their tokens): the precise scorer. It remembers vLLM's hash of each block it holds, as
  events name blocks by it. An endpoint never holds more entries than its KV capacity
  (``vllm:cache_config_info`` ``num_gpu_blocks``, or ``DEFAULT_CAPACITY`` until the pod
  reports it), nor the index more than ``MAX_ENTRIES``: beyond that the storing endpoint's
  oldest are evicted, so a pod whose events go astray, or that lies, cannot grow the router.
* ``SpeculativeIndex`` bridges the gap between routing a request and its pod's ``BlockStored``
  events (a prefill later): what the router just sent counts as cached there for a few
  seconds, continuing the prefix the events give. Without it, a burst of one group's requests
  scatters before the first events arrive.
* ``ApproxPrefixIndex`` learns from what the router itself routed and guesses eviction with a
  per-endpoint LRU bounded by the pod's cache size: the approximate scorer.
* ``CpuTierIndex`` (a ``PrefixIndex``'s ``cpu``): the blocks each pod's CPU offload tier holds,
  from the ``BlockStored``/``BlockRemoved`` events vLLM's OffloadingConnector sends with medium
  ``CPU``. Those events carry no tokens and no parent, only vLLM's hashes, so a block is known
  by the fingerprint the GPU index gave the same hash (the connector writes a block to CPU while
  the GPU holds it); ``continued`` says how far each pod's CPU tier carries a prefix on past
  its GPU match: the blocks a request would load back instead of computing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence, Set

import numpy as np

from kvflow.endpoints import EndpointId
from kvflow.router.block_table import BlockTable
from kvflow.router.fingerprint import Fingerprinter

DEFAULT_CAPACITY = 1 << 20
"""Blocks a pod may hold in the precise index before its metrics report its real capacity."""
MAX_ENTRIES = 1 << 24
"""(block, pod) entries the precise index holds at most, all pods together (about 1 GiB)."""


def longest_prefixes(holders: Mapping[int, Set[EndpointId]], chain: Iterable[int]) -> dict[EndpointId, int]:
    """Leading blocks of the chain each endpoint holds (endpoints holding none are absent).

    The walk every index answers, over a plain mapping: the reference that ``BlockTable.match``
    runs over its arrays (tests hold the two to the same answers). ``chain`` is not advanced
    past the first block nobody holds.
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
        for ep in alive - nxt:
            matched[ep] = i
        alive &= nxt
        if not alive:
            break
        i += 1
    for ep in alive:
        matched[ep] = i
    return matched


class PrefixIndex:
    """Blocks per endpoint, as the endpoints report them (KV events), at most a pod's capacity.

    Keyed by the router's fingerprints (``fingerprinter``'s, the ones requests are walked
    with), with vLLM's hash of each block beside it. Storing a block the endpoint already
    holds changes nothing; over capacity, the blocks it stored first are evicted first.
    """

    def __init__(
        self,
        default_capacity: int | None = DEFAULT_CAPACITY,
        *,
        fingerprinter: Fingerprinter | None = None,
        max_entries: int | None = MAX_ENTRIES,
    ) -> None:
        self.fingerprinter = fingerprinter or Fingerprinter(16)
        """Fingerprints the blocks events report (``kv_events.apply``)."""
        self._table = BlockTable(
            refresh=False, default_capacity=default_capacity, translate=True, max_entries=max_entries
        )
        self.cpu = CpuTierIndex()
        """The pods' CPU offload tiers, from their events with medium ``CPU``."""

    def __len__(self) -> int:
        return len(self._table)

    @property
    def holders(self) -> Mapping[int, set[EndpointId]]:
        return self._table.holders

    def blocks_of(self, endpoint: EndpointId) -> int:
        return self._table.blocks_of(endpoint)

    def nbytes(self) -> int:
        return self._table.nbytes()

    def set_capacity(self, endpoint: EndpointId, blocks: int) -> None:
        """The pod's real cache size, once its metrics tell it; its oldest beyond it are evicted."""
        self._table.set_capacity(endpoint, blocks)

    def add(self, endpoint: EndpointId, fingerprints: Iterable[int], hashes: Iterable[int] | None = None) -> None:
        """``endpoint`` stored these blocks; ``hashes``: vLLM's hash of each, as later events name
        them. Raises ValueError, before changing anything, if a value is not an unsigned 64-bit int."""
        self._table.add(endpoint, fingerprints, hashes)

    def remove(self, endpoint: EndpointId, fingerprints: Iterable[int]) -> None:
        self._table.remove(endpoint, fingerprints)

    def remove_hashes(self, endpoint: EndpointId, hashes: Iterable[int]) -> list[int]:
        """``endpoint`` evicted the blocks vLLM hashes so: the fingerprints of those the index knew."""
        return self._table.remove_hashes(endpoint, hashes)

    def fingerprint_of(self, block_hash: int) -> int | None:
        """The fingerprint of the block vLLM hashes to ``block_hash``, while a pod holds it."""
        return self._table.translated(block_hash)

    def clear(self, endpoint: EndpointId) -> None:
        """The endpoint's cache is gone (``AllBlocksCleared``, a restart): both tiers."""
        self._table.clear(endpoint)
        self.cpu.clear(endpoint)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        return self._table.match(chain)


class CpuTierIndex:
    """Per endpoint, the fingerprints of the blocks its CPU offload tier holds, with vLLM's hash
    of each (removals name them by it). At most ``max_blocks`` an endpoint: beyond it the
    oldest stored go first (vLLM's own LRU evicts, and says so, long before)."""

    def __init__(self, max_blocks: int = DEFAULT_CAPACITY) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[EndpointId, dict[int, int]] = {}
        """Endpoint -> fingerprint -> vLLM hash, oldest stored first."""
        self._fingerprints: dict[EndpointId, dict[int, int]] = {}
        """Endpoint -> vLLM hash -> fingerprint."""

    def __len__(self) -> int:
        """(block, endpoint) entries."""
        return sum(map(len, self._blocks.values()))

    def blocks_of(self, endpoint: EndpointId) -> int:
        return len(self._blocks.get(endpoint, ()))

    def offloads(self, endpoint: EndpointId) -> bool:
        """The endpoint offloads to a CPU tier: its tier holds blocks, as its events said."""
        return bool(self._blocks.get(endpoint))

    def holds(self, endpoint: EndpointId, fingerprint: int) -> bool:
        return fingerprint in self._blocks.get(endpoint, ())

    def store(self, endpoint: EndpointId, fingerprints: Sequence[int], hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(endpoint, {})
        by_hash = self._fingerprints.setdefault(endpoint, {})
        for fp, h in zip(fingerprints, hashes, strict=True):
            if fp not in blocks:
                blocks[fp] = h
                by_hash[h] = fp
        while len(blocks) > self.max_blocks:
            fp = next(iter(blocks))
            by_hash.pop(blocks.pop(fp), None)

    def remove_hashes(self, endpoint: EndpointId, hashes: Iterable[int]) -> list[int]:
        """The tier evicted these blocks: the fingerprints of those it was known to hold."""
        by_hash, blocks = self._fingerprints.get(endpoint), self._blocks.get(endpoint)
        if not by_hash or blocks is None:
            return []
        gone = []
        for h in hashes:
            fp = by_hash.pop(h, None)
            if fp is not None:
                blocks.pop(fp, None)
                gone.append(fp)
        return gone

    def clear(self, endpoint: EndpointId) -> None:
        self._blocks.pop(endpoint, None)
        self._fingerprints.pop(endpoint, None)

    def continued(self, chain: Sequence[int] | np.ndarray, gpu: Mapping[EndpointId, int],
                  endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        """For each of ``endpoints`` with a CPU tier: how many blocks of ``chain`` after its GPU
        match (``gpu``, 0 where absent) the tier holds, from the first (vLLM loads a contiguous
        run); endpoints whose tier continues nothing are absent."""
        out: dict[EndpointId, int] = {}
        n = len(chain)
        for eid in endpoints:
            blocks = self._blocks.get(eid)
            if not blocks:
                continue
            start = gpu.get(eid, 0)
            i = start
            while i < n and int(chain[i]) in blocks:
                i += 1
            if i > start:
                out[eid] = i - start
        return out


class ApproxPrefixIndex:
    """Blocks per endpoint as the router guesses them: what it routed there, LRU-bounded."""

    def __init__(self, capacity_per_endpoint: int = 4096) -> None:
        self.default_capacity = capacity_per_endpoint
        self._table = BlockTable(refresh=True, default_capacity=capacity_per_endpoint)

    def __len__(self) -> int:
        return len(self._table)

    @property
    def holders(self) -> Mapping[int, set[EndpointId]]:
        return self._table.holders

    def blocks_of(self, endpoint: EndpointId) -> int:
        return self._table.blocks_of(endpoint)

    def set_capacity(self, endpoint: EndpointId, blocks: int) -> None:
        """The pod's real cache size, once its metrics tell it."""
        self._table.set_capacity(endpoint, blocks)

    def add(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """A request with these blocks ran there: they are now its most recently used.

        Touched tail-first, as vLLM frees a request's blocks, so a prefix outlives its suffix.
        """
        blocks = hashes[::-1] if isinstance(hashes, (list, np.ndarray)) else list(hashes)[::-1]
        self._table.add(endpoint, blocks)

    def clear(self, endpoint: EndpointId) -> None:
        self._table.clear(endpoint)

    def discard(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """Forget these blocks on ``endpoint`` (a request sent there failed: it computed nothing)."""
        self._table.remove(endpoint, hashes)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        return self._table.match(chain)


class SpeculativeIndex:
    """Blocks the router just sent to an endpoint, believed cached there for ``ttl`` seconds.

    A guess bridges the time until the pod's KV events speak of the blocks: a send guesses
    all the prompt's blocks there, and ``extend`` carries each endpoint's matched prefix (what
    its events say) on through its guessed blocks.
    An event about a block ends the guess (stored: the precise index knows it now; removed:
    it is gone), but for a removal while the request that made the guess is still waiting for
    its prefill there: the pod evicted an older copy, and the request stores the block again
    when it runs (a burst of one prefix onto a busy pod whose old copy is being pushed out).
    Guesses live in one set per endpoint, so adding, expiring and ending them are set
    operations in C, not a loop over blocks; the sets hold only what was routed in ``ttl``.
    """

    def __init__(self, ttl: float = 2.0) -> None:
        self.ttl = ttl
        self._blocks: dict[EndpointId, set[int]] = {}
        """Endpoint -> its guessed blocks (endpoints with none are absent)."""
        self._queue: deque[tuple[float, EndpointId, set[int]]] = deque()
        self._waiting: dict[EndpointId, list[set[int]]] = {}
        """Endpoint -> the guesses of requests sent there and not yet prefilled."""

    def __len__(self) -> int:
        """(block, endpoint) guesses."""
        return sum(map(len, self._blocks.values()))

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def add(self, endpoint: EndpointId, hashes: list[int], now: float) -> set[int] | None:
        """Guess ``hashes`` cached on ``endpoint``, sent there ``now`` by a request that waits for
        its prefill until ``prefilled`` is told; returns the guess to tell it with (None: off)."""
        if self.ttl <= 0 or not hashes:
            return None
        guess = set(hashes)
        self._blocks.setdefault(endpoint, set()).update(guess)
        self._queue.append((now + self.ttl, endpoint, guess))
        self._waiting.setdefault(endpoint, []).append(guess)
        return guess

    def prefilled(self, endpoint: EndpointId, guess: set[int]) -> None:
        """The request that made ``guess`` was prefilled (or left): removals end its blocks' guesses again."""
        waiting = self._waiting.get(endpoint)
        if waiting is None:
            return
        for i, g in enumerate(waiting):
            if g is guess:
                del waiting[i]
                break
        if not waiting:
            del self._waiting[endpoint]

    def expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            _, endpoint, guess = queue.popleft()
            self.prefilled(endpoint, guess)
            self.discard(endpoint, guess)

    def discard(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """Forget these blocks on ``endpoint`` before they expire (an event spoke of them, or
        the request sent there failed)."""
        mine = self._blocks.get(endpoint)
        if mine is not None:
            mine.difference_update(hashes)
            if not mine:
                del self._blocks[endpoint]

    def removed(self, endpoint: EndpointId, hashes: Iterable[int]) -> None:
        """The pod evicted these blocks: ``discard`` them, but for those a request still waiting
        for its prefill there was sent with (it computes them again)."""
        waiting = self._waiting.get(endpoint)
        if waiting:
            gone = set(hashes)
            for guess in waiting:
                gone = gone.difference(guess)  # iterates the (short) removal, looks up the guess
            hashes = gone
        self.discard(endpoint, hashes)

    def clear(self, endpoint: EndpointId) -> None:
        self._blocks.pop(endpoint, None)

    def extend(self, matched: dict[EndpointId, int], chain: Sequence[int]) -> None:
        """Carry each endpoint's matched prefix of ``chain`` (``matched``: leading blocks it is
        known to hold, absent for none) on through the blocks guessed there."""
        n = len(chain)
        for endpoint, mine in self._blocks.items():
            i = start = matched.get(endpoint, 0)
            while i < n and chain[i] in mine:
                i += 1
            if i > start:
                matched[endpoint] = i
