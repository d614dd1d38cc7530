"""``BlockTable``: which endpoints hold which KV blocks, in flat arrays (45-61 bytes an entry).

The prefix indexes keep one entry per (block, endpoint); as Python dicts of sets that cost
about 350 bytes an entry, so a million blocks on many pods took most of a gigabyte. Here
every field is a slot in an ``array.array`` of machine ints, read and written from Python by
index (numpy rebuilds the slots and compacts logs; a store's keys and a walk over computed
hashes are looked up in C, ``kvflow._native``, or all at once with numpy where that is not
built):

* **blocks**, one record per distinct block: ``key[r]`` its 64-bit key (the router's prefix
  fingerprint, ``router/fingerprint.py``),
  ``mix[r]`` its *holder mix* — the XOR of a random 32-bit key per holding endpoint, so equal
  mixes mean equal holder sets (but for a 2**-32 chance where the holders change: a walk would
  then count a pod a block further than it holds, a mis-score in billions of walks; 32 bits
  rather than 64 keep an entry under 64 bytes) — and ``first[r]`` its first entry
  (a free record links the free list as -2 - next).
* **slots**, key -> record: open addressing, probed linearly from a multiply-shift of the
  key with a random odd multiplier, at most half full (recently stored blocks, the hot ones,
  sit at the end of probe runs), deleted from by backward shift (no tombstones). A multiplier
  is linear, so some draws pile structured keys (an arithmetic progression, keys equal in their
  low bits) into long probe runs: a store that makes a run longer than random keys would at
  that load (``probe_bound``) draws another multiplier and places the records again.
* **entries**, one per (block, endpoint): ``owner`` (a small int per endpoint), ``block`` (its
  record; on the free list, the next free entry), ``next`` (the block's next holder) and
  ``stamp`` (its place in its endpoint's age log).
* **age logs**, one per endpoint: entry ids, oldest first. Storing a block appends its entry
  (with ``refresh``, storing it again does too: LRU instead of FIFO). An entry is current at
  the place its stamp names, so a removal just leaves a stale place behind, skipped when met
  at the head and dropped when the log is compacted (stale places are at most half the log).
* **translation** (``translate=True``, the precise index): vLLM's hash of each block, as its
  pods' events name it: ``vkey[r]`` and a second slot table over it (``vslots``, up to 70 %
  full: it is read only when events arrive). ``BlockRemoved`` events and a ``BlockStored``'s
  parent carry only vLLM's hashes. A block's translation leaves with its record (when no
  endpoint holds it). The first hash registered for a block is kept in ``vkey``; another hash
  of the same block (pods with another hash seed or algorithm) goes to a small dict; a hash
  already registered for another block keeps that block (the first writer wins).

A cap on all entries (``max_entries``) holds the table whatever the endpoints report: an
endpoint whose store would go past it evicts its own oldest first.

Freed records and entries are reused; the arrays keep their high-water size.
``tests/router/test_block_table.py`` checks every operation against a dict-of-sets model.
"""

from __future__ import annotations

import math
import secrets
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from kvflow.endpoints import EndpointId

try:
    from kvflow import _native as native
except ImportError:  # installed without a C compiler: numpy finds the same records
    native = None  # type: ignore[assignment]

UINT64_MAX = (1 << 64) - 1
MAX_ENDPOINTS = 0xFFFF
_NONE = -1
_FREE = 0xFFFF  # the owner of a free entry
_MAX_LOAD = 0.5
_MAX_VLOAD = 0.7  # the translation's slots: read per event block, not per decision
_MIN_SLOTS = 1 << 10
_LOG_SLACK = 1024  # stale log places an endpoint may keep beyond half its entries
_VECTOR_MIN = 64  # keys looked up with numpy from this many on
_WINDOW = 8  # slots of each probe run read at once by ``find_many``
_WINDOW_STEPS = np.arange(_WINDOW, dtype=np.int64)
_REDRAWS = 8  # multipliers a placement tries before it keeps the last
_SHORT_RUN = 16  # probe runs shorter than this are never too long (``_Slots.probe_bound`` adds to it)


def checked_hashes(hashes: Iterable[Any]) -> list[int]:
    """The keys as a list, or a ValueError naming the first that is not an unsigned 64-bit int."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == np.uint64:
        return hashes.tolist()  # type: ignore[no-any-return]
    out = hashes if type(hashes) is list else list(hashes)
    for h in out:
        if type(h) is not int or not 0 <= h <= UINT64_MAX:
            raise ValueError(f"block hash {h!r:.40} is not an unsigned 64-bit int")
    return out


def _probes(index: _Slots, keys: list[int]) -> tuple[list[int], list[int]]:
    """Each key's home slot, and a first slot to read for it: its ``probe`` slot as the table is
    now, in C (``kvflow._native``) or for many keys with numpy; else its home. Either is the
    key's slot, a free slot where it goes, or a slot holding another key, past which the caller
    probes on (a home taken, or a free slot a record stored since took)."""
    if native is not None:
        return native.probe_slots(index.slots, index.keys, keys, index.mul, index.shift)
    if len(keys) >= _VECTOR_MIN:
        hashes = np.array(keys, np.uint64)
        return index.homes(hashes).tolist(), index.probe_many(hashes).tolist()
    mul, shift, mask = index.mul, index.shift, index.mask
    homes = [(h * mul >> shift) & mask for h in keys]  # ``_Slots.home``, inlined
    return homes, homes


def _table_size(blocks: int, load: float = _MAX_LOAD) -> int:
    """The smallest power-of-two slot table that holds ``blocks`` under the load limit."""
    size = _MIN_SLOTS
    while blocks > load * size:
        size *= 2
    return size


class _Slots:
    """An open-addressing table of record numbers, probed linearly from a multiply-shift of a
    64-bit key with a random odd multiplier; ``keys`` gives each record's key."""

    __slots__ = ("slots", "keys", "mul", "shift", "mask", "count")

    def __init__(self, keys: array[int], size: int) -> None:
        self.keys = keys
        self.mul = secrets.randbits(64) | 1
        self.count = 0
        self.resize(size, np.zeros(0, np.int64))

    def resize(self, size: int, records: np.ndarray) -> None:
        """A table of ``size`` slots (a power of two) holding ``records``."""
        self.slots = array("i", bytes(4 * size))
        self.shift, self.mask = 64 - (size.bit_length() - 1), size - 1
        self.count = len(records)
        self._place(records)
        for _ in range(_REDRAWS):
            if self.longest_probe() <= self.probe_bound():
                break
            self.redraw()

    def redraw(self) -> None:
        """Place the same records again from a new multiplier."""
        self.mul = secrets.randbits(64) | 1
        self._place(self.live())

    def _place(self, records: np.ndarray) -> None:
        slots = np.frombuffer(self.slots, np.int32)
        slots[:] = _NONE
        if not len(records):
            return
        home = self.homes(np.frombuffer(self.keys, np.uint64)[records])
        # Probe runs are short at this load: place every record whose slot is free (the first
        # claimant of each), move the others one slot on, repeat. No slot is emptied meanwhile,
        # so no record lands beyond a free slot of its probe run.
        while records.size:
            claims = np.zeros(records.size, bool)
            claims[np.unique(home, return_index=True)[1]] = True
            placed = claims & (slots[home] == _NONE)
            slots[home[placed]] = records[placed]
            records, home = records[~placed], (home[~placed] + 1) & self.mask

    def probe_bound(self) -> int:
        """A probe run longer than this is a bad multiplier, not bad luck: twice the longest run
        that random keys give at this load (about ln n / (a - 1 - ln a) slots for n keys at
        load a; 15 for 20,000 keys at 0.3, 45 for a million at 0.5, 150 for 1.5 million at 0.7)."""
        load = self.count / len(self.slots)
        if self.count < 2 or load >= 1:
            return len(self.slots)
        return _SHORT_RUN + int(2 * math.log(self.count) / (load - 1 - math.log(load)))

    def homes(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * np.uint64(self.mul)) >> np.uint64(self.shift)).astype(np.int64)  # numpy's product wraps

    def live(self) -> np.ndarray:
        slots = np.frombuffer(self.slots, np.int32)
        return slots[slots >= 0].astype(np.int64)

    def home(self, h: int) -> int:
        """The slot the probe run of key ``h`` starts at (``homes`` for an array of keys)."""
        return (h * self.mul >> self.shift) & self.mask

    def probe(self, h: int) -> int:
        """The slot of ``h``'s probe run that holds the record with key ``h``, else the free slot
        the run ends at (where such a record goes). Every lookup one key at a time is this loop;
        ``find_many`` is its numpy form and ``prefix_runs`` its C one. Keys in the table are
        distinct, so the first record with key ``h`` is the only one."""
        slots, key, mask = self.slots, self.keys, self.mask
        s = (h * self.mul >> self.shift) & mask
        r = slots[s]
        while r >= 0 and key[r] != h:
            s = (s + 1) & mask
            r = slots[s]
        return s

    def find(self, h: int) -> int:
        """The record whose key is ``h``, or -1."""
        return self.slots[self.probe(h)]

    def find_all(self, keys: list[int]) -> list[int]:
        """``find`` of each key, their probes all at once (``_probes``)."""
        slots, key, probe = self.slots, self.keys, self.probe
        found = []
        for h, s in zip(keys, _probes(self, keys)[1]):
            r = slots[s]
            if r >= 0 and key[r] != h:  # another key there (a home, without C): the run goes on
                r = slots[probe(h)]
            found.append(r)
        return found

    def delete(self, r: int) -> bool:
        """Take record ``r`` out, if it is in. Backward shift: the later records of its probe
        run move up into the hole, so no lookup stops early."""
        slots, key, mul, shift, mask = self.slots, self.keys, self.mul, self.shift, self.mask
        s = self.probe(key[r])
        if slots[s] != r:
            return False
        hole, s = s, (s + 1) & mask
        while (moved := slots[s]) >= 0:
            home = (key[moved] * mul >> shift) & mask
            if (s - home) & mask >= (s - hole) & mask:  # its home is not in (hole, s]: it may move
                slots[hole] = moved
                hole = s
            s = (s + 1) & mask
        slots[hole] = _NONE
        self.count -= 1
        return True

    def probe_many(self, hashes: np.ndarray) -> np.ndarray:
        """``probe`` for many keys at once, in numpy. Most keys sit in their home slot, or end
        their run there (the table is at most half full), so every key's home is read and
        compared first; the keys whose home holds another key go on with the next ``_WINDOW``
        slots of their probe run, read at once, the rare longer runs through ``probe``. (Home
        first, because reading every key's first ``_WINDOW`` slots at once reads mostly slots no
        key needs.)"""
        slots, keys = np.frombuffer(self.slots, np.int32), np.frombuffer(self.keys, np.uint64)
        at = self.homes(hashes)
        if not len(keys):  # no record yet: every slot is free
            return at
        found = slots[at]
        on = np.flatnonzero((found >= 0) & (keys[found] != hashes))  # found -1 reads the last key: masked out
        if not on.size:
            return at
        window = (at[on, None] + 1 + _WINDOW_STEPS) & self.mask
        found = slots[window]
        stop = (found < 0) | (keys[found] == hashes[on, None])
        rows, first = np.arange(len(on)), stop.argmax(axis=1)
        got = stop[rows, first]
        at[on] = np.where(got, window[rows, first], _NONE)
        for j in on[~got].tolist():  # a full window without the key: its run goes on
            at[j] = self.probe(int(hashes[j]))
        return at

    def find_many(self, hashes: np.ndarray) -> np.ndarray:
        """``find`` for many keys at once, in numpy (``probe_many``)."""
        records: np.ndarray = np.frombuffer(self.slots, np.int32)[self.probe_many(hashes)]
        return records

    def prefix_runs(self, hashes: np.ndarray, mixes: array[int]) -> tuple[int, list[tuple[int, int]]]:
        """How many leading ``hashes`` have a record, and where along them the records' holder
        ``mixes`` change: ``(i, record)`` for the first and for each whose mix differs from the one
        before. One probe run after another in C (``kvflow._native``), else ``find_many`` cut at
        its first miss."""
        if native is not None:
            return native.find_prefix_runs(self.slots, self.keys, mixes, np.ascontiguousarray(hashes, np.uint64),
                                           self.mul, self.shift)
        if not len(hashes) or self.find(int(hashes[0])) < 0:  # nobody holds the first block: no need to look further
            return 0, []
        records = self.find_many(hashes)
        missing = np.flatnonzero(records < 0)
        if missing.size:
            records = records[: missing[0]]
        found = np.frombuffer(mixes, np.uint32)[records]
        starts = [0, *(np.flatnonzero(found[1:] != found[:-1]) + 1).tolist()]
        return len(records), list(zip(starts, records[starts].tolist()))

    def longest_probe(self) -> int:
        slots = np.frombuffer(self.slots, np.int32)
        at = np.flatnonzero(slots >= 0)
        if not at.size:
            return 0
        home = self.homes(np.frombuffer(self.keys, np.uint64)[slots[at]])
        return int(((at - home) & self.mask).max()) + 1


class BlockTable:
    """(block, endpoint) entries, an age order per endpoint, and a cap on each endpoint's count."""

    def __init__(
        self,
        *,
        refresh: bool,
        default_capacity: int | None = None,
        translate: bool = False,
        max_entries: int | None = None,
    ) -> None:
        self.refresh = refresh
        """Storing a block an endpoint holds makes it the youngest (else nothing changes)."""
        self.default_capacity = default_capacity
        """The cap for an endpoint whose capacity was never set (None: no cap)."""
        self.max_entries = max_entries
        """The cap on all entries together (None: none)."""
        self.translate = translate
        self._capacity: dict[EndpointId, int] = {}
        # blocks
        self._key = array("Q")
        self._mix = array("I")
        self._first = array("i")
        self._free_record = _NONE
        self._blocks = 0
        self._index = _Slots(self._key, _MIN_SLOTS)
        # vLLM's hashes of the blocks (translate only)
        self._vkey = array("Q")
        self._vindex = _Slots(self._vkey, _MIN_SLOTS if translate else 1)
        self._alias: dict[int, int] = {}
        self._aliases_of: dict[int, list[int]] = {}
        # entries
        self._owner = array("H")
        self._block = array("i")
        self._next = array("i")
        self._stamp = array("I")
        self._free_entry = _NONE
        self._total = 0
        # endpoints, by small int
        self._ids: list[EndpointId | None] = []
        self._keys: list[int] = []
        self._counts: list[int] = []
        self._logs: list[array[int]] = []
        self._log_start: list[int] = []
        self._by_id: dict[EndpointId, int] = {}
        self._free_endpoints: list[int] = []

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct blocks held by anyone."""
        return self._blocks

    def blocks_of(self, endpoint: EndpointId) -> int:
        p = self._by_id.get(endpoint)
        return 0 if p is None else self._counts[p]

    def entries(self) -> int:
        """(block, endpoint) entries in all."""
        return self._total

    def nbytes(self) -> int:
        """Bytes the arrays and the translation hold, over-allocation included (not the few
        Python objects per endpoint)."""
        arrays = (self._index.slots, self._key, self._mix, self._first, self._owner, self._block, self._next,
                  self._stamp, self._vindex.slots, self._vkey)
        aliases = sys.getsizeof(self._alias) + sys.getsizeof(self._aliases_of) + 100 * len(self._alias)
        return sum(sys.getsizeof(a) for a in (*arrays, *self._logs)) + (aliases if self._alias else 0)

    def longest_probe(self) -> int:
        """Slots the longest lookup reads, by key or by vLLM hash (a health check: short
        whatever keys pods send)."""
        return max(self._index.longest_probe(), self._vindex.longest_probe())

    def placement(self) -> tuple[list[int | None], list[tuple[int, int] | None]]:
        """A snapshot of the slot tables, slot by slot: the key of the block each slot of the
        key table names, and (vLLM's hash, the block's key) for each slot of the translation's
        (None: a free slot). Where a block sits follows the tables' multipliers and the order
        of stores and removals only, however a store probed (in C, with numpy, one at a time)."""
        key, vkey = self._key, self._vkey
        keys = [None if r < 0 else key[r] for r in self._index.slots]
        hashes = [None if r < 0 else (vkey[r], key[r]) for r in self._vindex.slots]
        return keys, hashes

    def capacity_of(self, endpoint: EndpointId) -> int | None:
        return self._capacity.get(endpoint, self.default_capacity)

    def holders_of(self, h: int) -> set[EndpointId]:
        r = self._index.find(h)
        return set() if r < 0 else {self._ids[p] for p in self._holders(r)}  # type: ignore[misc]

    def oldest_first(self, endpoint: EndpointId) -> list[int]:
        """The endpoint's block keys, oldest (the next to be evicted) first."""
        p = self._by_id.get(endpoint)
        if p is None:
            return []
        log, start = self._logs[p], self._log_start[p]
        return [self._key[self._block[log[q]]] for q in range(start, len(log)) if self._current(p, log[q], q)]

    @property
    def holders(self) -> Mapping[int, set[EndpointId]]:
        """Block key -> the endpoints holding it (a read-only view)."""
        return _HoldersView(self)

    def translated(self, h: int) -> int | None:
        """The key of the block vLLM hashes to ``h``, while an endpoint holds it (translate only)."""
        r = self._vrecord(h)
        return None if r < 0 else self._key[r]

    def _vrecord(self, h: int) -> int:
        """The record vLLM's hash ``h`` names, or -1."""
        r = self._vindex.find(h)
        return r if r >= 0 else self._alias.get(h, _NONE)

    def match(self, chain: Iterable[int]) -> dict[EndpointId, int]:
        """Leading blocks of ``chain`` each endpoint holds (endpoints holding none are absent).

        ``prefix_index.longest_prefixes``'s walk over this table. Keys already computed — an
        array (a request's fingerprints), or a long list — are looked up all at once with
        numpy; any other iterable one key at a time, and it is not advanced past the first
        block nobody holds. A block whose holder mix equals the previous block's has the same
        holders, so the common case (the same endpoints hold block after block) costs one
        probe and one compare a block.
        """
        matched: dict[int, int] = {}
        keys = getattr(chain, "array", chain)
        if isinstance(keys, list) and len(keys) >= _VECTOR_MIN:
            keys = np.array(checked_hashes(keys), np.uint64)
        if isinstance(keys, np.ndarray) and len(keys) >= _VECTOR_MIN:
            alive, i = self._walk_array(keys, matched)
        else:
            alive, i = self._walk_lazy(iter(keys.tolist() if isinstance(keys, np.ndarray) else keys), matched)
        for p in alive:
            matched[p] = i
        ids = self._ids
        return {ids[p]: n for p, n in matched.items()}  # type: ignore[misc]

    def _walk_array(self, keys: np.ndarray, matched: dict[int, int]) -> tuple[set[int], int]:
        """The walk over computed keys: (endpoints still matching, blocks walked)."""
        stop, runs = self._index.prefix_runs(keys, self._mix)
        alive: set[int] | None = None
        for i, r in runs:
            alive = self._narrow(alive, r, i, matched)
            if not alive:
                return alive, i
        return alive or set(), stop

    def _walk_lazy(self, it: Iterator[int], matched: dict[int, int]) -> tuple[set[int], int]:
        """The walk over keys as they come: one probe per block."""
        index, key, mix = self._index, self._key, self._mix
        slots, probe, mul, shift, mask = index.slots, index.probe, index.mul, index.shift, index.mask
        alive: set[int] | None = None
        last_mix, i = 0, 0
        for h in it:
            r = slots[(h * mul >> shift) & mask]  # its home: most keys are there
            if r >= 0 and key[r] != h:  # another block there: the run goes on
                r = slots[probe(h)]
            if r < 0:
                break
            if alive is None or mix[r] != last_mix:
                last_mix = mix[r]
                alive = self._narrow(alive, r, i, matched)
                if not alive:
                    break
            i += 1
        return alive or set(), i

    def _narrow(self, alive: set[int] | None, r: int, i: int, matched: dict[int, int]) -> set[int]:
        """Block ``i`` (record ``r``) has other holders than the block before: who still matches."""
        holders = self._holders(r)
        if alive is None:
            return holders
        if not alive <= holders:
            for p in alive - holders:
                matched[p] = i
            alive &= holders
        return alive

    # -- updates ---------------------------------------------------------------------------

    def add(self, endpoint: EndpointId, keys: Iterable[int], hashes: Iterable[int] | None = None) -> None:
        """``endpoint`` now holds these blocks, stored in this order; then its oldest are
        evicted while it holds more than its capacity (or the table more than ``max_entries``).

        ``hashes``: vLLM's hash of each block (``translate`` tables), by which later events
        name them.
        """
        keys = checked_hashes(keys)
        if not keys:
            return
        vhashes = checked_hashes(hashes) if hashes is not None and self.translate else None
        if vhashes is not None and len(vhashes) != len(keys):
            raise ValueError(f"{len(vhashes)} vLLM hashes for {len(keys)} blocks")
        p = self._endpoint_index(endpoint)
        index = self._index
        if self._blocks + len(keys) > _MAX_LOAD * len(index.slots):
            index.resize(_table_size(self._blocks + len(keys)), self._live_records())
        # One loop, inlined but for the probes: a routed 8k-token prompt stores 512 blocks.
        slots, key, mix, first, probe, mask = index.slots, self._key, self._mix, self._first, index.probe, index.mask
        owner, block, nxt, stamp = self._owner, self._block, self._next, self._stamp
        log, endpoint_key, refresh = self._logs[p], self._keys[p], self.refresh
        records: list[int] | None = [] if vhashes is not None else None
        added = far = 0
        for h, home, s in zip(keys, *_probes(index, keys)):
            r = slots[s]
            if r >= 0 and key[r] != h:  # another block there: the run goes on
                s = probe(h)
                r = slots[s]
            if r < 0:  # a new block: its record takes the free slot the probe stopped at
                r = self._free_record
                if r >= 0:
                    self._free_record = -2 - first[r]
                    key[r], mix[r], first[r] = h, 0, _NONE
                else:
                    r = len(first)
                    key.append(h)
                    mix.append(0)
                    first.append(_NONE)
                    if self.translate:
                        self._vkey.append(0)
                slots[s] = r
                index.count += 1
                self._blocks += 1
                if (s - home) & mask > far:
                    far = (s - home) & mask
                if records is not None:
                    records.append(~r)  # new: its vLLM hash is not registered yet
            else:
                if records is not None:
                    records.append(r)
                e = first[r]
                while e >= 0 and owner[e] != p:
                    e = nxt[e]
                if e >= 0:  # held already
                    if refresh:
                        stamp[e] = len(log)
                        log.append(e)
                    continue
            e = self._free_entry
            if e >= 0:
                self._free_entry = block[e]
                owner[e], block[e], nxt[e], stamp[e] = p, r, first[r], len(log)
            else:
                e = len(owner)
                owner.append(p)
                block.append(r)
                nxt.append(first[r])
                stamp.append(len(log))
            first[r] = e
            mix[r] ^= endpoint_key
            log.append(e)
            added += 1
        self._counts[p] += added
        self._total += added
        if far >= _SHORT_RUN and far >= index.probe_bound():  # (no logarithms for the usual short runs)
            index.redraw()
        if records is not None:
            self._register(records, vhashes)  # type: ignore[arg-type]
        self._maybe_compact(p)
        self._evict(p)

    def remove(self, endpoint: EndpointId, keys: Iterable[int]) -> None:
        """``endpoint`` no longer holds these blocks (those it did not hold are ignored)."""
        p = self._by_id.get(endpoint)
        if p is not None:
            self._drop_records(p, self._index.find_all(checked_hashes(keys)))

    def remove_hashes(self, endpoint: EndpointId, hashes: Iterable[int]) -> list[int]:
        """``remove`` by vLLM's hashes: the keys of the blocks they name (translate only)."""
        # all named before any is dropped (a drop frees the name); no second lookup by key
        hashes = checked_hashes(hashes)
        records, alias = [], self._alias
        for h, r in zip(hashes, self._vindex.find_all(hashes)):  # ``_vrecord`` of each
            if r < 0:
                r = alias.get(h, _NONE)
            if r >= 0:
                records.append(r)
        key = self._key
        found = [key[r] for r in records]
        p = self._by_id.get(endpoint)
        if p is not None:
            self._drop_records(p, records)
        return found

    def _drop_records(self, p: int, records: list[int]) -> None:
        """Drop endpoint ``p``'s entries of these records (-1, or one it does not hold: ignored)."""
        owner, nxt, first = self._owner, self._next, self._first
        for r in records:
            e = first[r] if r >= 0 else _NONE  # < 0 once dropped: a block named twice is removed once
            while e >= 0 and owner[e] != p:
                e = nxt[e]
            if e >= 0:
                self._drop(e)
        self._after_drops(p)

    def clear(self, endpoint: EndpointId) -> None:
        """Forget everything ``endpoint`` holds (its capacity is kept)."""
        p = self._by_id.get(endpoint)
        if p is None:
            return
        log = self._logs[p]
        for q in range(self._log_start[p], len(log)):
            if self._current(p, log[q], q):
                self._drop(log[q])
        self._after_drops(p)

    def set_capacity(self, endpoint: EndpointId, blocks: int) -> None:
        """The most blocks ``endpoint`` may hold; its oldest beyond that are evicted now."""
        self._capacity[endpoint] = max(1, blocks)
        p = self._by_id.get(endpoint)
        if p is not None:
            self._evict(p)

    def forget(self, endpoint: EndpointId) -> None:
        """``clear``, and its capacity too (the endpoint left the pool)."""
        self.clear(endpoint)
        self._capacity.pop(endpoint, None)

    # -- blocks and their vLLM hashes ------------------------------------------------------

    def _register(self, records: list[int], hashes: list[int]) -> None:
        """vLLM's hash of each stored block (``~r`` for a record created by this store)."""
        vindex, vkey, alias = self._vindex, self._vkey, self._alias
        if vindex.count + len(records) > _MAX_VLOAD * len(vindex.slots):
            vindex.resize(_table_size(vindex.count + len(records), _MAX_VLOAD), vindex.live())
        vslots, probe, mask = vindex.slots, vindex.probe, vindex.mask
        far = 0
        for r, h, home, s in zip(records, hashes, *_probes(vindex, hashes)):  # the hash's slot, or the free one to put it in
            new = r < 0
            if new:
                r = ~r
            elif vkey[r] == h:  # stored again, or by another pod: named already (or the name is taken)
                continue
            x = vslots[s]
            if x >= 0 and vkey[x] != h:  # another hash there: the run goes on
                s = probe(h)
                x = vslots[s]
            if x >= 0 or h in alias:  # the hash names another block: the first writer keeps it
                if new:
                    vkey[r] = h ^ 1  # not h: storing h again must try again (the name may be free)
                continue
            if not new and vindex.find(vkey[r]) == r:  # another hash of a block already named
                alias[h] = r
                self._aliases_of.setdefault(r, []).append(h)
                continue
            vkey[r] = h
            vslots[s] = r
            vindex.count += 1
            if (s - home) & mask > far:
                far = (s - home) & mask
        if far >= _SHORT_RUN and far >= vindex.probe_bound():
            vindex.redraw()

    def _delete_block(self, r: int) -> None:
        """Take record ``r`` out of the slots (and its vLLM hashes) and onto the free list."""
        self._index.delete(r)
        if self.translate:
            self._vindex.delete(r)
            for h in self._aliases_of.pop(r, ()):
                del self._alias[h]
        self._first[r] = -2 - self._free_record  # <= -1: not a live record
        self._free_record = r
        self._blocks -= 1

    def _live_records(self) -> np.ndarray:
        return np.flatnonzero(np.frombuffer(self._first, np.int32) >= 0)

    # -- entries ---------------------------------------------------------------------------

    def _holders(self, r: int) -> set[int]:
        owner, nxt = self._owner, self._next
        out = set()
        e = self._first[r]
        while e >= 0:
            out.add(owner[e])
            e = nxt[e]
        return out

    def _drop(self, e: int) -> None:
        """Unlink entry ``e`` from its block (deleting a block nobody holds) and free it."""
        r, p = self._block[e], self._owner[e]
        first, nxt = self._first, self._next
        if first[r] == e:
            first[r] = nxt[e]
        else:
            prev = first[r]
            while nxt[prev] != e:
                prev = nxt[prev]
            nxt[prev] = nxt[e]
        self._mix[r] ^= self._keys[p]
        if first[r] < 0:
            self._delete_block(r)
        self._counts[p] -= 1
        self._total -= 1
        self._owner[e] = _FREE
        self._block[e] = self._free_entry
        self._free_entry = e

    # -- endpoints and their age logs ------------------------------------------------------

    def _endpoint_index(self, endpoint: EndpointId) -> int:
        p = self._by_id.get(endpoint)
        if p is not None:
            return p
        if self._free_endpoints:
            p = self._free_endpoints.pop()
            self._ids[p], self._keys[p], self._counts[p] = endpoint, secrets.randbits(32), 0
        else:
            p = len(self._ids)
            if p >= MAX_ENDPOINTS:
                raise ValueError(f"a block table holds at most {MAX_ENDPOINTS} endpoints")
            self._ids.append(endpoint)
            self._keys.append(secrets.randbits(32))
            self._counts.append(0)
            self._logs.append(array("i"))
            self._log_start.append(0)
        self._by_id[endpoint] = p
        return p

    def _current(self, p: int, e: int, q: int) -> bool:
        """Whether place ``q`` of ``p``'s log is entry ``e``'s current place."""
        return self._owner[e] == p and self._stamp[e] == q

    def _evict(self, p: int) -> None:
        """Drop ``p``'s oldest while it holds more than its capacity, or the table more than
        ``max_entries`` (the endpoint storing pays for the table's cap, not the others)."""
        limit = self._capacity.get(self._ids[p], self.default_capacity)  # type: ignore[arg-type]
        over = 0 if limit is None else self._counts[p] - limit
        if self.max_entries is not None:
            over = max(over, self._total - self.max_entries)
        if over <= 0:
            return
        keep = self._counts[p] - min(over, self._counts[p])
        log, q = self._logs[p], self._log_start[p]
        while self._counts[p] > keep:
            if self._current(p, log[q], q):
                self._drop(log[q])
            q += 1
        self._log_start[p] = q
        self._after_drops(p)

    def _after_drops(self, p: int) -> None:
        if self._counts[p] == 0:
            self._release(p)
        else:
            self._maybe_compact(p)

    def _maybe_compact(self, p: int) -> None:
        if len(self._logs[p]) > self._counts[p] + self._counts[p] // 2 + _LOG_SLACK:
            self._compact(p)

    def _compact(self, p: int) -> None:
        """Drop the log's stale places; current entries keep their order and get new stamps."""
        start = self._log_start[p]
        log = np.frombuffer(self._logs[p], np.int32)[start:]
        stamps = np.frombuffer(self._stamp, np.uint32)
        places = np.arange(start, start + len(log))
        current = log[(np.frombuffer(self._owner, np.uint16)[log] == p) & (stamps[log] == places)]
        stamps[current] = np.arange(len(current), dtype=np.uint32)
        del log, stamps  # numpy views pin the arrays' buffers
        self._logs[p] = array("i", current.tobytes())
        self._log_start[p] = 0

    def _release(self, p: int) -> None:
        """An endpoint that holds nothing gives its small int back (pods come and go)."""
        del self._by_id[self._ids[p]]  # type: ignore[arg-type]
        self._ids[p] = None
        self._logs[p] = array("i")
        self._log_start[p] = 0
        self._free_endpoints.append(p)


class _HoldersView(Mapping[int, set[EndpointId]]):
    __slots__ = ("_table",)

    def __init__(self, table: BlockTable) -> None:
        self._table = table

    def __getitem__(self, h: int) -> set[EndpointId]:
        found = self._table.holders_of(h) if type(h) is int and 0 <= h <= UINT64_MAX else set()
        if not found:
            raise KeyError(h)
        return found

    def __iter__(self) -> Iterator[int]:
        key = self._table._key
        return (key[r] for r in self._table._live_records().tolist())

    def __len__(self) -> int:
        return len(self._table)
